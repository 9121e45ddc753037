"""``flowreduce.spmd``'s all-reduce between hosts against torch gloo, on the emulated network, in one run.

    python benchmarks/warm_memory.py --gib 8      # once after boot
    python benchmarks/netem/spmd_vs_gloo.py --hosts 4 --rate 1gbit --rounds 3 \\
        --out benchmarks/results/spmd_netem-$(date -u +%F).txt

Runs as root in the root namespace: brings up an
:class:`~cluster.EmulatedCluster` of ``--hosts`` hosts x 1 single-threaded
worker at ``--rate`` (tbf both ways on every host link) and keeps it up for
the whole run. Both systems run one rank per host, so every collective
crosses the shaped links; float64 sum, rank ``r`` fills its vector with
``r + 1`` and every result is checked (every repetition).

* ``flowreduce``: this script again inside the head namespace (``--part
  flowreduce``, through ``EmulatedCluster.run``), one
  ``flowreduce.spmd(client, fn, ranks=hosts)`` job per round, rank ``r`` on
  host ``r`` (each rank is a host group of its own: the job's layout is
  checked), each collective a plan over Dask's comm between the workers;
  ``comm.allreduce(x, algorithm=a)`` for every ``a`` of ``--algorithms``
  (``auto``: the cost model's choice, recorded per size with
  ``comm.plan_for``).
* ``gloo``: ``benchmarks/peers/gloo_allreduce.py --rank i`` started in
  namespace ``fr-h{i}`` (``ip netns exec``) with ``GLOO_SOCKET_IFNAME=fr-eth{i}``,
  meeting at ``tcp://10.77.0.10:PORT``; one launch per size and round.

Timing (as ``benchmarks/spmd_latency.py`` and ``benchmarks/peers/_common.py``):
each repetition is a barrier, then ``perf_counter`` around one all-reduce on
every rank; the repetition's time is the maximum over the ranks; the table
gives the median over every repetition of every round. The systems alternate
over ``--rounds`` rounds (order reversed every other round), so that machine
noise falls on both. ``busbw = 2 (p - 1) / p * bytes / median``, against the
link's ``--rate``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
GLOO = HERE.parent / "peers" / "gloo_allreduce.py"
sys.path.insert(0, str(HERE))

DEFAULT_SIZES = "1e3,1e4,1e5,1e6,1e7"
#: timed repetitions per size, all rounds together
DEFAULT_REPEAT = "600,600,300,60,12"


def parse_sizes(text: str) -> list[int]:
    return [int(float(t)) for t in text.split(",") if t.strip()]


def warmup_for(nbytes: int) -> int:
    return 1 if nbytes >= 8_000_000 else 3 if nbytes >= 800_000 else 10


# -- flowreduce (inside the head namespace) ---------------------------------------------------------------------
def _rank(comm, sizes, repeats, warmups, algorithms):
    import time as _time

    import numpy as _np

    import flowreduce as _fr

    expect = comm.size * (comm.size + 1) // 2
    out = {"layout": {"hosts": list(comm.layout.hosts), "leaders": list(comm.leaders),
                      "workers": list(comm.layout.workers), "group": list(comm.group),
                      "flowreduce": _fr.__file__},
           "rows": []}
    for n, repeat, warmup in zip(sizes, repeats, warmups):
        x = _np.full(n, comm.rank + 1, dtype=_np.float64)
        for algorithm in algorithms:
            for _ in range(warmup):
                comm.allreduce(x, algorithm=algorithm)
            times, ok = _np.empty(repeat), True
            for i in range(repeat):
                comm.barrier()
                t0 = _time.perf_counter()
                y = comm.allreduce(x, algorithm=algorithm)
                times[i] = _time.perf_counter() - t0
                ok = ok and bool(_np.all(y == expect))
            auto = comm.plan_for("auto", x.nbytes)  # after the first "auto" all-reduce: on the measured link
            events = comm.events  # made from the worker's log at each read: once
            event = events[-1] if events[-1].collective == "allreduce" else events[-2]
            worst = _np.max(_np.stack(comm.allgather(times)), axis=0)
            oks = comm.allgather(_np.array([ok]))
            traffic = comm.allgather(_np.array([event.sent, event.received]))
            out["rows"].append({
                "size": n, "algorithm": algorithm, "times": worst.tolist(), "correct": bool(_np.all(oks)),
                "plan": event.algorithm, "path": event.path,
                "auto": f"{auto.algorithm}" + (f" ({auto.segments} segments)" if auto.segments > 1 else ""),
                "sent": [int(t[0]) for t in traffic], "received": [int(t[1]) for t in traffic]})
    link = comm.link  # measured by the first "auto" all-reduce (None: none ran, or a calibrated model)
    out["layout"]["link"] = None if link is None else [link.alpha, link.beta]
    return out


def flowreduce_part(args) -> int:
    from distributed import Client

    import flowreduce

    sizes, repeats = parse_sizes(args.sizes), [int(r) for r in args.repeat_per_round.split(",")]
    warmups = [warmup_for(n * 8) for n in sizes]
    algorithms = [a for a in args.algorithms.split(",") if a]
    with Client(os.environ["DASK_SCHEDULER_ADDRESS"], timeout="30s") as client:
        workers = sorted(client.scheduler_info(n_workers=-1)["workers"])
        ranks = len(workers)
        futures = flowreduce.spmd(client, _rank, ranks=ranks, workers=workers, timeout=300,
                                  sizes=sizes, repeats=repeats, warmups=warmups, algorithms=algorithms)
        results = client.gather(futures)
    Path(args.json).write_text(json.dumps(results[0]))
    return 0


# -- the driver (root namespace) ---------------------------------------------------------------------------------
def run_flowreduce(cluster, sizes, repeats, algorithms, timeout) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "flowreduce.json")
        proc = cluster.run(__file__, "--part", "flowreduce", "--json", out, "--sizes", ",".join(map(str, sizes)),
                           "--repeat-per-round", ",".join(map(str, repeats)), "--algorithms", ",".join(algorithms),
                           timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"flowreduce part failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}"
                               f"\n{proc.stderr[-6000:]}")
        return json.loads(Path(out).read_text())


_port = [29500]


def run_gloo(hosts: int, n: int, repeat: int, timeout: float) -> tuple[list[float], bool]:
    from cluster import host_ip, host_ns

    _port[0] += 1
    init = f"tcp://{host_ip(0)}:{_port[0]}"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "gloo.json")
        procs = []
        try:
            for i in range(hosts):
                env = dict(os.environ, GLOO_SOCKET_IFNAME=f"fr-eth{i}", OMP_NUM_THREADS="1")
                argv = ["ip", "netns", "exec", host_ns(i), sys.executable, str(GLOO), "--rank", str(i),
                        "--world-size", str(hosts), "--init-method", init, "--sizes", str(n),
                        "--repeat", str(repeat), "--warmup", str(warmup_for(n * 8))]
                if i == 0:
                    argv += ["--json", out]
                procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                              stderr=subprocess.STDOUT, text=True, start_new_session=True))
            deadline = time.monotonic() + timeout
            logs = []
            for p in procs:
                o, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
                logs.append(o)
            if any(p.returncode != 0 for p in procs) or not os.path.exists(out):
                raise RuntimeError("gloo failed: " + " | ".join(f"rc={p.returncode}: {o[-1500:]}"
                                                                for p, o in zip(procs, logs)))
            row = json.loads(Path(out).read_text())[0]
        finally:
            for p in procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, 9)
                    except ProcessLookupError:
                        pass
                    p.wait()
    return row["times"], row["correct"]


def measure(cluster, hosts, sizes, repeats, rounds, algorithms, timeout, log) -> dict:
    per_round = [max(1, -(-r // rounds)) for r in repeats]
    systems = ["flowreduce", "gloo"]
    fr = {a: {n: [] for n in sizes} for a in algorithms}
    fr_ok = {a: {n: True for n in sizes} for a in algorithms}
    info: dict = {"plans": {}, "auto": {}, "traffic": {}}
    gl = {n: [] for n in sizes}
    gl_ok = {n: True for n in sizes}
    for r in range(rounds):
        for system in systems if r % 2 == 0 else systems[::-1]:
            t0 = time.monotonic()
            if system == "flowreduce":
                got = run_flowreduce(cluster, sizes, per_round, algorithms, timeout)
                lay = got["layout"]
                info["layout"] = lay
                info.setdefault("links", []).append(lay.get("link"))
                if len(set(lay["hosts"])) != hosts or len(lay["leaders"]) != hosts or len(lay["group"]) != 1:
                    raise RuntimeError(f"ranks are not one per host group: {lay}")
                if len({w.rsplit(':', 1)[0] for w in lay["workers"]}) != hosts:
                    raise RuntimeError(f"ranks' workers are not on {hosts} different hosts: {lay['workers']}")
                for row in got["rows"]:
                    a, n = row["algorithm"], row["size"]
                    fr[a][n].extend(row["times"])
                    fr_ok[a][n] = fr_ok[a][n] and row["correct"]
                    info["plans"][a, n] = row["plan"]
                    info["auto"][n] = row["auto"]
                    info["traffic"][a, n] = (row["sent"], row["received"], row["path"])
            else:
                for n, rep in zip(sizes, per_round):
                    times, ok = run_gloo(hosts, n, rep, timeout)
                    gl[n].extend(times)
                    gl_ok[n] = gl_ok[n] and ok
            log(f"# round {r + 1}/{rounds} {system} done in {time.monotonic() - t0:.0f} s "
                f"({time.strftime('%H:%M:%S')}, load {os.getloadavg()[0]:.2f})")
    return {"fr": fr, "fr_ok": fr_ok, "gloo": gl, "gloo_ok": gl_ok, **info}


def table(res: dict, hosts: int, sizes: list[int], algorithms: list[str], link: float) -> list[str]:
    factor = 2 * (hosts - 1) / hosts
    extra = [a for a in algorithms if a != "auto"]
    head = (f"{'size':>9} {'bytes':>10} {'reps':>5} {'flowreduce ms':>14} {'gloo ms':>10} {'fr/gloo':>8} "
            f"{'auto plan':>28} {'fr busbw MB/s':>14} {'gloo busbw MB/s':>16} {'correct':>8}"
            + "".join(f" {a + ' ms':>22}" for a in extra))
    lines = [head]
    for n in sizes:
        nbytes = n * 8
        f = statistics.median(res["fr"]["auto"][n]) if "auto" in res["fr"] else float("nan")
        g = statistics.median(res["gloo"][n])
        ok = res["gloo_ok"][n] and all(res["fr_ok"][a][n] for a in algorithms)
        plan = res["auto"].get(n, "")
        lines.append(
            f"{n:>9.0e} {nbytes:>10d} {len(res['gloo'][n]):>5d} {f * 1e3:>14.3f} {g * 1e3:>10.3f} {f / g:>7.2f}x "
            f"{plan:>28} {factor * nbytes / f / 1e6:>14.1f} {factor * nbytes / g / 1e6:>16.1f} "
            f"{'yes' if ok else 'NO':>8}"
            + "".join(f" {statistics.median(res['fr'][a][n]) * 1e3:>14.3f} ({statistics.median(res['fr'][a][n]) / g:>4.2f}x)"
                      for a in extra))
    lines.append(f"# busbw = 2(p-1)/p x bytes / median; the link: {link / 1e6:.0f} MB/s each way per host")
    for a in algorithms:
        for n in sizes:
            sent, received, path = res["traffic"][(a, n)]
            lines.append(f"# flowreduce algorithm={a} size={n:.0e}: plan {res['plans'][(a, n)]}, path {path}, "
                         f"bytes sent per rank {sent}, received {received}")
    return lines


def driver(args, argv: list[str]) -> int:
    from cluster import EmulatedCluster, rate_bytes

    sizes = parse_sizes(args.sizes)
    repeats = [int(r) for r in args.repeat.split(",")]
    if len(repeats) != len(sizes):
        raise SystemExit("--repeat needs one count per size")
    algorithms = [a for a in args.algorithms.split(",") if a]
    if "auto" not in algorithms:
        algorithms.insert(0, "auto")

    lines: list[str] = []

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    start = datetime.datetime.now(datetime.timezone.utc)
    lines.append(f"$ python benchmarks/netem/spmd_vs_gloo.py {' '.join(argv)}")
    lines.append(f"# {start:%Y-%m-%d %H:%M} UTC, code of {commit}, load average before "
                 f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} cores; emulated cluster "
                 f"{args.hosts} hosts x 1 worker (nthreads=1) @ {args.rate} (tbf both ways per host link); "
                 f"one rank per host, float64 sum; each repetition a barrier then one all-reduce, its time the "
                 f"maximum over ranks; median over {args.rounds} interleaved rounds")
    with EmulatedCluster(hosts=args.hosts, workers_per_host=1, rate=args.rate, nthreads=1,
                         memory_limit=args.memory_limit) as cluster:
        log(f"# cluster up: {cluster.hosts}")
        res = measure(cluster, args.hosts, sizes, repeats, args.rounds, algorithms, args.timeout, log)
    lines.append(f"# flowreduce layout: hosts {res['layout']['hosts']}, leaders {res['layout']['leaders']}, "
                 f"workers {res['layout']['workers']}; flowreduce from {res['layout']['flowreduce']}")
    links = ", ".join("none" if k is None else f"alpha {k[0] * 1e3:.2f} ms, {1 / k[1] / 1e6:.0f} MB/s"
                      for k in res.get("links", []))
    lines.append(f"# the link each round's job measured at its first auto all-reduce (comm.link): {links}")
    lines += table(res, args.hosts, sizes, algorithms, rate_bytes(args.rate))
    end = datetime.datetime.now(datetime.timezone.utc)
    lines.append(f"# done {end:%H:%M} UTC ({(end - start).total_seconds() / 60:.1f} min), load average after: "
                 f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(
            {"fr": {a: {str(n): v for n, v in d.items()} for a, d in res["fr"].items()},
             "gloo": {str(n): v for n, v in res["gloo"].items()}, "auto": {str(n): v for n, v in res["auto"].items()}}))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--sizes", default=DEFAULT_SIZES)
    p.add_argument("--repeat", default=DEFAULT_REPEAT, help="timed repetitions per size, all rounds together")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--algorithms", default="auto,ring",
                   help="flowreduce's algorithm= values, each timed (auto always)")
    p.add_argument("--memory-limit", default="4GB")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per system and round")
    p.add_argument("--out", default=None, help="also write the table here")
    p.add_argument("--json-out", default=None, help="every repetition's time, as JSON")
    # internal: the flowreduce half, run inside the head namespace
    p.add_argument("--part", choices=["flowreduce"], default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    p.add_argument("--repeat-per-round", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.part == "flowreduce":
        return flowreduce_part(args)
    return driver(args, argv)


if __name__ == "__main__":
    sys.exit(main())
