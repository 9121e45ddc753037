"""Where one ``comm.allreduce`` between hosts spends its time: every message of its plan, timed.

    python benchmarks/netem/cluster.py --hosts 4 --workers-per-host 1 --rate 1gbit -- \\
        benchmarks/netem/spmd_steps_probe.py --sizes 1e5,1e6,1e7 --algorithms ring,butterfly --repeat 3

Runs inside the head namespace (``DASK_SCHEDULER_ADDRESS`` set): one
``flowreduce.spmd`` job, one rank per worker (host). On every rank the
communicator's ``_send``/``_take`` and its worker mailbox's ``_queue``, ``_write_batch``
(the event loop's hand-over and write) and ``_put`` (the arrival) are wrapped to stamp
``time.time()`` (one clock: the "hosts" share the machine). Per message
of the last repetition of each (size, algorithm)::

    call     the rank's thread hands the value to send (before the copy)
    loop     the sender's event loop has it (after copy + hand-over), queued on the stream to the peer
    write    its write on that stream starts (after the messages queued before it)
    written  the write returned (the bytes are in the socket)
    arrived  the receiver's handler put it in the mailbox (read + deserialised)
    taken    the receiver's rank got it (or was already waiting)

and per rank the collective's wall time, the time its thread spent in
sends (copy + hand-over) and waiting in takes, and what is left (the
plan's reduces, concatenations, the result's copy). The link time of a
message is ``bytes / rate``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def _rank(comm, sizes, algorithms, repeat, variants=("copy",)):
    import asyncio
    import itertools
    import sys as _sys
    import time as _time

    import numpy as _np
    from distributed.protocol import to_serialize

    log = []
    box = comm.mailbox
    orig_send, orig_take = comm._send, comm._take
    orig_queue, orig_write, orig_put = box._queue, box._write_batch, box._put

    def send_uncopied(rank, key, value):  # diagnostic only (the communicator's sends are uncopied since)
        box.send(comm.layout.workers[rank], comm.run, f"{key}:{comm.rank}>{rank}", value)

    sender = [orig_send]
    orig_box_send = box.send

    async def rpc_write(address, run, key, value):  # the way before streams: one rpc call per message
        t = _time.time()
        try:
            await box.worker.rpc(address).flowreduce_spmd_deliver(run=run, key=key, value=to_serialize(value),
                                                                  reply=False)
        except Exception as e:
            box.fail(run, f"sending {key} to {address} failed: {e!r}")
        log.append(("write", key, None, t, _time.time(), getattr(value, "nbytes", 0)))

    def rpc_send(address, run, key, value):
        if address == box.worker.address:
            box._put(run, key, value)
            return
        asyncio.run_coroutine_threadsafe(rpc_write(address, run, key, value), box.worker.loop.asyncio_loop)

    def send(rank, key, value):
        t = _time.time()
        sender[0](rank, key, value)
        log.append(("send", f"{key}:{comm.rank}>{rank}", rank, t, _time.time(), getattr(value, "nbytes", 0)))

    def take(rank, key, what, deadline):
        t = _time.time()
        v = orig_take(rank, key, what, deadline)
        log.append(("take", f"{key}:{rank}>{comm.rank}", rank, t, _time.time(), getattr(v, "nbytes", 0)))
        return v

    def queue(address, run, key, value):  # the loop has it
        log.append(("loop", key, address, _time.time(), _time.time(), getattr(value, "nbytes", 0)))
        orig_queue(address, run, key, value)

    async def write(comm_, batch):  # its write on the stream to the peer starts, and returns
        t = _time.time()
        await orig_write(comm_, batch)
        for _run, key, value in batch:
            log.append(("write", key, None, t, _time.time(), getattr(value, "nbytes", 0)))

    def put(run, key, value):
        log.append(("arrive", key, None, _time.time(), _time.time(), getattr(value, "nbytes", 0)))
        orig_put(run, key, value)

    orig_post, orig_take_async = comm._post, comm._take_async

    def post(rank, key, value):  # a plan on the event loop sends
        t = _time.time()
        orig_post(rank, key, value)
        log.append(("send", f"{key}:{comm.rank}>{rank}", rank, t, _time.time(), getattr(value, "nbytes", 0)))

    async def take_async(rank, key, what, deadline):
        t = _time.time()
        v = await orig_take_async(rank, key, what, deadline)
        log.append(("take", f"{key}:{rank}>{comm.rank}", rank, t, _time.time(), getattr(v, "nbytes", 0)))
        return v

    comm._send, comm._take, comm._post, comm._take_async = send, take, post, take_async
    box._queue, box._write_batch, box._put = queue, write, put
    out = []
    try:
        for n in sizes:
            x = _np.full(n, comm.rank + 1, dtype=_np.float64)
            for algorithm in algorithms:
                for i, variant in itertools.product(range(repeat + 1), variants):  # variants alternate
                    sender[0] = send_uncopied if variant == "uncopied" else orig_send
                    box.send = rpc_send if variant == "rpc" else orig_box_send
                    comm.plan_on_loop = variant not in ("thread", "rpc")
                    switch = _sys.getswitchinterval()
                    if variant.startswith("switch"):  # e.g. switch0.0005
                        _sys.setswitchinterval(float(variant[6:] or 0.0005))
                    comm.barrier()
                    del log[:]
                    t0 = _time.time()
                    y = comm.allreduce(x, algorithm=algorithm)
                    t1 = _time.time()
                    _sys.setswitchinterval(switch)
                    ok = bool(_np.all(y == comm.size * (comm.size + 1) // 2))
                    if i:  # the first of each variant is a warm-up
                        out.append({"size": n, "algorithm": algorithm, "variant": variant, "rep": i, "start": t0,
                                    "stop": t1, "ok": ok, "plan": comm.last_collective()[1].algorithm,
                                    "log": [e for e in log if e[1].startswith("a")]})
    finally:
        comm._send, comm._take, comm._post, comm._take_async = orig_send, orig_take, orig_post, orig_take_async
        del comm.plan_on_loop
        box._queue, box._write_batch, box._put = orig_queue, orig_write, orig_put
        box.send = orig_box_send
    return out


def main(argv=None) -> int:
    from distributed import Client

    import flowreduce

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1e5,1e6,1e7")
    p.add_argument("--algorithms", default="ring,butterfly")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--uncopied", action="store_true",
                   help="also time every repetition with the sent values not copied (diagnostic: the copy's cost; "
                        "safe here, where nobody changes them)")
    p.add_argument("--variants", default="copy",
                   help="comma-separated, alternating per repetition: copy (as the library runs), thread (the plan on "
                        "the rank's thread, not the event loop), rpc (that and one rpc call per message, as before "
                        "the streams), switchS (sys.setswitchinterval(S) around "
                        "the barrier and the all-reduce, e.g. switch0.0005)")
    p.add_argument("--quiet", action="store_true", help="only the summary")
    p.add_argument("--rate", type=float, default=125e6, help="link bytes/s (for the link time column)")
    args = p.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    algorithms = args.algorithms.split(",")
    with Client(os.environ["DASK_SCHEDULER_ADDRESS"], timeout="30s") as client:
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        futures = flowreduce.spmd(client, _rank, ranks=len(workers), workers=workers, timeout=300,
                                  sizes=sizes, algorithms=algorithms, repeat=args.repeat,
                                  variants=tuple(args.variants.split(",")) + (("uncopied",) if args.uncopied else ()))
        per_rank = client.gather(futures)
    p_ = len(per_rank)
    summary: dict = {}
    for k, first in enumerate(per_rank[0]):
        rows = [pr[k] for pr in per_rank]
        t0 = min(r["start"] for r in rows)
        wall = max(r["stop"] for r in rows) - t0
        ok = all(r["ok"] for r in rows)
        summary.setdefault((first["size"], first["algorithm"], first["plan"], first["variant"]), []).append((wall, ok))
        if args.quiet:
            continue
        print(f"\n## size {first['size']:.0e} ({first['size'] * 8} B) algorithm={first['algorithm']} "
              f"(plan {first['plan']}) {first['variant']} rep {first['rep']}: slowest rank {wall * 1e3:.1f} ms, "
              f"correct {ok}")
        for r, row in enumerate(rows):
            sends = sum(e[4] - e[3] for e in row["log"] if e[0] == "send")
            takes = sum(e[4] - e[3] for e in row["log"] if e[0] == "take")
            own = row["stop"] - row["start"]
            print(f"  rank {r}: {own * 1e3:7.1f} ms = sends (copy+hand-over) {sends * 1e3:6.1f} + waiting in takes "
                  f"{takes * 1e3:7.1f} + rest (reduce/concat/copy out) {(own - sends - takes) * 1e3:6.1f}")
        # per message: call -> loop -> written -> arrived -> taken
        msgs = {}
        for r, row in enumerate(rows):
            for kind, key, _peer, a, b, nb in row["log"]:
                m = msgs.setdefault(key, {"nbytes": nb})
                if kind == "send":
                    m["call"], m["src"] = a, r
                elif kind == "loop":
                    m["loop"] = a
                elif kind == "write":
                    m["write"], m["written"] = a, b
                elif kind == "arrive":
                    m["arrived"], m["dst"] = a, r
                elif kind == "take":
                    m["wait"], m["taken"] = a, b
        print("   message                  bytes   call  loop   write written arrived  taken   (ms from the start; "
              "link time = bytes/rate)")
        transit = []
        for key, m in sorted(msgs.items(), key=lambda kv: kv[1].get("call", 0)):
            def at(name, m=m):
                return f"{(m[name] - t0) * 1e3:7.1f}" if name in m else "      -"
            link = m["nbytes"] / args.rate * 1e3
            if "arrived" in m and "loop" in m:
                transit.append((m["arrived"] - m["loop"]) * 1e3 - link)
            print(f"   {key.split(' of job')[0][-22:]:>22} {m['nbytes']:>9d} {at('call')} {at('loop')} {at('write')} {at('written')} "
                  f"{at('arrived')} {at('taken')}   link {link:6.1f}")
        if transit:
            print(f"  loop->arrived minus link time: median {statistics.median(transit):.1f} ms over "
                  f"{len(transit)} messages (p={p_})")
    print("\n# summary: the slowest rank's time (collective start on the first rank to end on the last), per repetition")
    for (n, algorithm, plan, variant), got in summary.items():
        times = [w * 1e3 for w, _ in got]
        print(f"  size {n:.0e} algorithm={algorithm} (plan {plan}) {variant:>8}: median {statistics.median(times):8.1f} "
              f"ms over {len(times)} ({', '.join(f'{t:.0f}' for t in times)}), correct {all(o for _, o in got)}")
    return 0


if __name__ == "__main__":
    t = time.time()
    rc = main()
    print(f"# probe took {time.time() - t:.0f} s", file=sys.stderr)
    sys.exit(rc)
