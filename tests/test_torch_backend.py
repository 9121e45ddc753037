"""The ``flowreduce`` torch.distributed backend (flowreduce.torch.init_process_group) on a real
cluster: unmodified DistributedDataParallel inside flowreduce.spmd against real DDP over gloo
(4 processes on 127.0.0.1, tests/ddp_reference.py: an unused layer with
find_unused_parameters=True, a layer skipped on some steps, gradient accumulation with
no_sync, BatchNorm buffers), parameters within rtol 1e-5 of gloo's and bitwise identical across
ranks; torch.distributed's collectives (all_reduce sync and async_op, every op, broadcast,
all_gather, all_gather_into_tensor, reduce_scatter_tensor, barrier, new_group subgroups)
against torch references for world sizes 1..4 on 2 single-threaded worker processes (ranks
share processes from 3 on); a failing rank fails every rank; misuse says what to do;
init_process_group("flowreduce") outside an
SPMD rank (torch.multiprocessing processes, init_method tcp://) forms its group through the c10d
store: the same collective checks, and a DDP step. Asynchronous collectives: async all_reduces of
a rank stay pending while its peer is held (a Dask Event) and complete in issue order with
torch's values once it joins; a peer's failure reaches every pending work's wait() and future,
naming the rank and the collective; destroy_process_group runs what was issued, refuses more
and ends the groups' threads."""

from __future__ import annotations

import contextlib
import os
import socket
import threading

import pytest
from distributed import Client, LocalCluster, wait

import flowreduce

torch = pytest.importorskip("torch", reason="torch tests need the extra: pip install -e '.[torch]'")

from ddp_reference import MODELS, RANKS, RUNS, STEPS, make_optimizer, shard  # noqa: E402

dist = torch.distributed


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        with Client(cluster) as c:
            yield c


# -- DDP against DDP over gloo ---------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gloo_results(gloo_ddp_results):
    """Final state of real DDP over gloo, 4 processes (tests/ddp_reference.py), per run and rank
    (run once a session, tests/conftest.py: tests/test_torch.py compares with the same runs)."""
    return gloo_ddp_results


#: Ranks that share a worker process share torch's default generator: each seeds and builds its
#: model holding this lock (else the two threads' draws interleave and rank 0's model is not gloo's)
_SEEDING = threading.Lock()


def _ddp_rank(comm, runs):
    """ddp_reference.ddp_rank's loop, unmodified DDP, on the flowreduce backend."""
    from torch.nn.parallel import DistributedDataParallel

    from flowreduce.torch import init_process_group

    torch.set_num_threads(1)
    group = init_process_group(comm)
    assert dist.get_backend() == "flowreduce" and group.name() == "flowreduce"
    assert (dist.get_rank(), dist.get_world_size()) == (comm.rank, comm.size)
    out = {}
    for name, micro in runs:
        with _SEEDING:
            torch.manual_seed(0)
            module = MODELS[name]()
        model = DistributedDataParallel(module, find_unused_parameters=True)
        opt = make_optimizer(model.parameters())
        batches = iter(shard(comm.rank, comm.size, micro))
        for _ in range(STEPS):
            for m in range(micro):
                (x, use), y = next(batches)
                with model.no_sync() if m < micro - 1 else contextlib.nullcontext():
                    torch.nn.functional.cross_entropy(model(x, use), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        out[name, micro] = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    return out


def test_ddp_matches_gloo(client, gloo_results):
    """4 ranks on 2 worker processes (two rank threads per process), 20 steps of each run."""
    futures = flowreduce.spmd(client, _ddp_rank, ranks=RANKS, runs=RUNS, timeout=120)
    ours = client.gather(futures)
    for run in RUNS:
        params = {n for n, _ in MODELS[run[0]]().named_parameters()}
        for r in range(RANKS):
            mine, theirs = ours[r][run], gloo_results[run][r]
            assert mine.keys() == theirs.keys()
            for k in mine:
                torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=k, r=r: f"{run} rank {r} {k}: {m}")
                if k in params:  # parameters: the same bits on every rank (buffers are each rank's own)
                    assert torch.equal(mine[k], ours[0][run][k]), (run, r, k)
        # the runs moved the parameters: equal to gloo's is not equal to where they started
        torch.manual_seed(0)
        start = MODELS[run[0]]().state_dict()
        assert not torch.equal(start["hidden.weight"], ours[0][run]["hidden.weight"])
        assert torch.equal(start["never.weight"], ours[0][run]["never.weight"])  # never used: never moved


# -- the collectives against torch references ------------------------------------------------
OPS = {"SUM": torch.sum, "PRODUCT": torch.prod, "MIN": lambda s, dim: s.min(dim).values,
       "MAX": lambda s, dim: s.max(dim).values, "AVG": torch.mean}
INT_OPS = {"BAND": "bitwise_and", "BOR": "bitwise_or", "BXOR": "bitwise_xor"}


def _x(rank, dtype=torch.float64):
    """Small values per rank and element: sums and products exact."""
    return ((torch.arange(15, dtype=torch.int64).reshape(3, 5) * (rank + 2) + rank) % 4 + 1).to(dtype)


def _groups(n):
    """The subgroups every test job creates, in this order (every rank calls new_group for each)."""
    return [sorted({0, n - 1}), list(range(n)), [r for r in range(n) if r % 2 == 1] or [0]]


def _collectives(comm):
    from flowreduce.torch import init_process_group

    init_process_group(comm)
    return _collectives_torch()


def _collectives_torch():
    """Every collective on the default group and three subgroups; what each gave."""
    r, n = dist.get_rank(), dist.get_world_size()
    out = {}
    for name in OPS:
        t = _x(r)
        assert dist.all_reduce(t, op=getattr(dist.ReduceOp, name)) is None
        out["all_reduce", name] = t
    for name in INT_OPS:
        t = _x(r, torch.int64)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, name))
        out["all_reduce", name] = t
    t = _x(r, torch.float32)
    dist.all_reduce(t)
    out["all_reduce", "float32"] = t
    t = _x(r)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True)
    out["async", "wait"] = work.wait()
    out["async", "future"] = work.get_future().wait()[0].clone()
    out["async", "completed"] = work.is_completed()
    out["async", "tensor"] = t
    for root in range(n):
        t = _x(r)
        dist.broadcast(t, src=root)
        out["broadcast", root] = t
        t = _x(r)
        work = dist.broadcast(t, src=root, async_op=True)
        work.wait()
        out["broadcast-async", root] = t
    gathered = [torch.empty(3, 5, dtype=torch.float64) for _ in range(n)]
    dist.all_gather(gathered, _x(r))
    out["all_gather"] = torch.stack(gathered)
    flat = torch.empty(3 * n, 5, dtype=torch.float64)
    dist.all_gather_into_tensor(flat, _x(r))
    out["all_gather_into_tensor"] = flat
    scattered = torch.empty(2, 5, dtype=torch.float64)
    dist.reduce_scatter_tensor(scattered, torch.cat([_x(r)[:2] + i for i in range(n)]))
    out["reduce_scatter_tensor"] = scattered
    dist.barrier()
    groups = [dist.new_group(members) for members in _groups(n)]
    for i, (members, g) in enumerate(zip(_groups(n), groups)):
        if r not in members:
            assert g == dist.GroupMember.NON_GROUP_MEMBER
            continue
        assert (dist.get_rank(g), dist.get_world_size(g)) == (members.index(r), len(members))
        t = _x(r)
        dist.all_reduce(t, group=g)
        out["sub", i, "all_reduce"] = t
        t = _x(r)
        dist.broadcast(t, src=members[-1], group=g)
        out["sub", i, "broadcast"] = t
        gathered = [torch.empty(3, 5, dtype=torch.float64) for _ in members]
        dist.all_gather(gathered, _x(r), group=g)
        out["sub", i, "all_gather"] = torch.stack(gathered)
        dist.barrier(group=g)
    t = _x(r)
    dist.all_reduce(t)  # the world again, after the subgroups
    out["after"] = t
    return out


@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_collectives(client, size):
    _check_collectives(client.gather(flowreduce.spmd(client, _collectives, ranks=size, timeout=60)))


def _check_collectives(results):
    size = len(results)
    xs = torch.stack([_x(r) for r in range(size)])
    ints = torch.stack([_x(r, torch.int64) for r in range(size)])
    for r, out in enumerate(results):
        for name, f in OPS.items():
            torch.testing.assert_close(out["all_reduce", name], f(xs, dim=0), rtol=0, atol=0)
        for name, fn in INT_OPS.items():
            want = ints[0]
            for other in ints[1:]:
                want = getattr(torch, fn)(want, other)
            assert torch.equal(out["all_reduce", name], want), name
        assert out["all_reduce", "float32"].dtype == torch.float32
        assert torch.equal(out["all_reduce", "float32"], xs.sum(0).float())
        assert out["async", "completed"] is True and out["async", "wait"] is True
        assert torch.equal(out["async", "tensor"], xs.max(0).values)
        assert torch.equal(out["async", "future"], xs.max(0).values)
        for root in range(size):
            assert torch.equal(out["broadcast", root], xs[root])
            assert torch.equal(out["broadcast-async", root], xs[root])
        assert torch.equal(out["all_gather"], xs)
        assert torch.equal(out["all_gather_into_tensor"], xs.reshape(3 * size, 5))
        full = torch.stack([torch.cat([xs[q][:2] + i for i in range(size)]) for q in range(size)]).sum(0)
        assert torch.equal(out["reduce_scatter_tensor"], full[2 * r:2 * r + 2])
        for i, members in enumerate(_groups(size)):
            if r not in members:
                assert ("sub", i, "all_reduce") not in out
                continue
            assert torch.equal(out["sub", i, "all_reduce"], xs[members].sum(0)), (i, members)
            assert torch.equal(out["sub", i, "broadcast"], xs[members[-1]])
            assert torch.equal(out["sub", i, "all_gather"], xs[members])
        assert torch.equal(out["after"], xs.sum(0))


# -- plain processes: the group through the c10d store ----------------------------------------
def _store_rank(rank, size, port, out_dir):
    """A torch.multiprocessing process, not a Dask worker: init_process_group("flowreduce", tcp://)."""
    import flowreduce.torch  # noqa: F401  (registers the backend)

    torch.set_num_threads(1)
    dist.init_process_group("flowreduce", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        assert dist.get_backend() == "flowreduce"
        out = _collectives_torch()
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(rank)  # different on each rank: DDP broadcasts rank 0's at construction
        model = DistributedDataParallel(torch.nn.Linear(3, 2))
        model(torch.full((4, 3), float(rank + 1))).sum().backward()
        out["ddp"] = (model.module.weight.detach().clone(), model.module.weight.grad.clone())
        torch.save(out, os.path.join(out_dir, f"store-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_plain_processes_form_the_group_through_the_store(tmp_path):
    """torchrun's way: 2 plain processes, init_process_group("flowreduce", init_method="tcp://...");
    the collectives against torch, and a DDP step (parameters from rank 0, gradients averaged)."""
    import torch.multiprocessing as mp

    size = 2
    mp.spawn(_store_rank, args=(size, _free_port(), str(tmp_path)), nprocs=size, join=True)
    results = [torch.load(os.path.join(tmp_path, f"store-rank{r}.pt"), weights_only=False) for r in range(size)]
    ddp = [out.pop("ddp") for out in results]
    _check_collectives(results)
    torch.manual_seed(0)
    weight = torch.nn.Linear(3, 2).weight.detach()
    grad = torch.full((2, 3), (1.0 + 2.0) * 4 / size)  # d(sum(x W^T))/dW = column sums of x, averaged
    for w, g in ddp:
        assert torch.equal(w, weight) and torch.equal(g, grad), (w, g)


# -- failures and misuse ---------------------------------------------------------------------
def _one_fails(comm):
    from flowreduce.torch import init_process_group

    init_process_group(comm)
    if dist.get_rank() == 1:
        raise ValueError("rank one gives up")
    t = torch.ones(4)
    for _ in range(3):
        dist.all_reduce(t)
    return t


def test_a_failing_rank_fails_every_rank(client):
    futures = flowreduce.spmd(client, _one_fails, ranks=3, timeout=60)
    wait(futures, timeout=60)
    assert all(f.status == "error" for f in futures)
    assert "rank one gives up" in str(futures[1].exception())
    for r in (0, 2):  # the others' all_reduce raised, naming the rank and what it raised
        why = str(futures[r].exception())
        assert "allreduce" in why and "rank 1" in why and "rank one gives up" in why, why


def _outside(comm):
    """init_process_group(backend="flowreduce") from a thread of a worker that is not a rank (a store
    group, as in plain processes), a wrong argument, a second call."""
    import threading

    from flowreduce.torch import init_process_group

    init_process_group(comm)
    caught = []

    def plain():
        dist.init_process_group("flowreduce", rank=0, world_size=1, store=dist.HashStore())
        t = torch.ones(2)
        dist.all_reduce(t)
        caught.append(f"{dist.get_world_size()} {type(dist.group.WORLD.comm).__name__} {t.tolist()}")
        dist.destroy_process_group()

    thread = threading.Thread(target=plain)
    thread.start()
    thread.join()
    try:
        init_process_group(object())
    except Exception as e:  # noqa: BLE001
        caught.append(f"{type(e).__name__}: {e}")
    try:
        init_process_group(comm)
    except Exception as e:  # noqa: BLE001
        caught.append(str(e))
    return caught


def test_misuse_says_what_to_do(client):
    outside, wrong, twice = client.gather(flowreduce.spmd(client, _outside, ranks=1, timeout=60))[0]
    assert outside == "1 StoreComm [1.0, 1.0]"  # the thread's own group, apart from the rank's
    assert wrong.startswith("OptionError") and "communicator" in wrong
    assert "already called" in twice


# -- asynchronous collectives: works that complete on the group's thread ----------------------
def _held(comm, name, ops):
    """Rank 0 issues ``ops`` all_reduces with async_op=True while rank 1 is held (a Dask Event
    rank 0 sets once it has looked at its works): none can have completed, since rank 1 has not
    joined any; then rank 1 joins and every work completes, in issue order."""
    from distributed import Event

    from flowreduce.torch import init_process_group

    init_process_group(comm)
    go = Event(name)
    r = dist.get_rank()
    if r == 1 and not go.wait(timeout=60):  # bound: without the overlap rank 0 never sets it
        raise AssertionError("rank 0 never let rank 1 go: its async all_reduce did not return")
    tensors = [_x(r) * (i + 1) for i in range(len(ops))]
    order: list[int] = []
    works = []
    for i, (t, op) in enumerate(zip(tensors, ops)):
        work = dist.all_reduce(t, op=getattr(dist.ReduceOp, op), async_op=True)
        work.get_future().then(lambda _, i=i: order.append(i))  # runs as each completes
        works.append(work)
    pending = [w.is_completed() for w in works]
    if r == 0:
        go.set()
    assert works[-1].wait() is True
    return {"pending": pending, "completed": [w.is_completed() for w in works], "order": order,
            "futures": [w.get_future().wait()[0] for w in works], "tensors": tensors}


def test_async_all_reduce_completes_after_a_held_peer_joins(client):
    """The works of rank 0 are not completed while rank 1 has not issued its all_reduces (it waits
    for rank 0 to have looked), and complete in order with torch's values once it has."""
    import uuid

    ops = ["SUM", "MAX", "SUM", "MIN", "PRODUCT"]
    futures = flowreduce.spmd(client, _held, ranks=2, name=f"hold-{uuid.uuid4().hex}", ops=ops, timeout=120)
    results = client.gather(futures)
    xs = torch.stack([_x(r) for r in range(2)])
    assert results[0]["pending"] == [False] * len(ops)  # rank 1 had joined none of them
    for r, out in enumerate(results):
        assert out["completed"] == [True] * len(ops)  # waiting on the last: every earlier one is done
        assert out["order"] == list(range(len(ops)))
        for i, op in enumerate(ops):
            want = OPS[op](xs * (i + 1), dim=0)
            assert torch.equal(out["tensors"][i], want), (r, i, op)
            assert torch.equal(out["futures"][i], want), (r, i, op)


def _pending_when_a_peer_fails(comm):
    """Rank 1 raises; rank 0's all_reduces issued with async_op=True fail at their wait()."""
    from flowreduce.torch import init_process_group
    from flowreduce.torch.backend import CollectiveError

    init_process_group(comm)
    if dist.get_rank() == 1:
        raise ValueError("rank one gives up")
    works = [dist.all_reduce(torch.ones(4), async_op=True) for _ in range(3)]
    caught = []
    for w in works:
        try:
            w.wait()
        except CollectiveError as e:
            caught.append(str(e))
        try:
            w.get_future().wait()
        except CollectiveError as e:
            caught.append(str(e))
    return caught, [w.is_completed() for w in works]


def test_an_error_in_a_collective_reaches_wait_naming_the_rank(client):
    futures = flowreduce.spmd(client, _pending_when_a_peer_fails, ranks=2, timeout=60)
    wait(futures, timeout=60)
    assert "rank one gives up" in str(futures[1].exception())
    caught, completed = futures[0].result()
    assert completed == [True, True, True] and len(caught) == 6, caught
    for i, why in enumerate(caught):
        assert f"all_reduce #{i // 2 + 1} on rank 0" in why, why
        assert "rank 1" in why and "rank one gives up" in why, why


def _lifecycle(comm):
    """Works left pending at destroy_process_group complete (it runs what was issued); the destroyed
    group refuses more; a subgroup's works too."""
    import flowreduce.torch
    from flowreduce.torch.backend import CollectiveError

    flowreduce.torch.init_process_group(comm)
    r, n = dist.get_rank(), dist.get_world_size()
    world = dist.group.WORLD
    sub = dist.new_group([0, n - 1])
    tensors = [_x(r) for _ in range(3)]
    works = [dist.all_reduce(tensors[0], async_op=True)]
    if sub != dist.GroupMember.NON_GROUP_MEMBER:
        works.append(dist.all_reduce(tensors[1], group=sub, async_op=True))
    works.append(dist.all_reduce(tensors[2], async_op=True))
    flowreduce.torch.backend.destroy_process_group()
    try:
        world.allreduce([torch.ones(2)])
        refused = ""
    except CollectiveError as e:
        refused = str(e)
    return [w.is_completed() for w in works], tensors, refused


def _lane_threads():
    import threading

    return sorted(t.name for t in threading.enumerate() if t.name.startswith("flowreduce-torch"))


def test_destroy_runs_what_was_issued_and_ends_the_threads(client):
    n = 3
    results = client.gather(flowreduce.spmd(client, _lifecycle, ranks=n, timeout=60))
    xs = torch.stack([_x(r) for r in range(n)])
    for r, (completed, tensors, refused) in enumerate(results):
        assert all(completed), (r, completed)
        assert torch.equal(tensors[0], xs.sum(0)) and torch.equal(tensors[2], xs.sum(0))
        assert torch.equal(tensors[1], xs[[0, n - 1]].sum(0) if r in (0, n - 1) else _x(r))
        assert f"rank {r}" in refused and "destroyed" in refused, refused
    assert client.run(_lane_threads) == {w: [] for w in client.scheduler_info()["workers"]}
