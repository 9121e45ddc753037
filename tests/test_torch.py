"""PyTorch on a real cluster: tensors of every dtype in and out of
``allreduce`` (against numpy references), pytree types kept, ``like=`` from
tensors and parameters, errors naming ranks; and ``flowreduce.torch.Trainer``
against real DistributedDataParallel over gloo (4 processes on 127.0.0.1),
with an unused parameter and gradient accumulation."""

from __future__ import annotations

import collections
import dataclasses
import gc
import os
import re

import dask
import numpy as np
import pytest
from utils import assert_clean, error_of, wait_until, workers_of

import flowreduce

torch = pytest.importorskip("torch", reason="torch tests need the extra: pip install -e '.[torch]'")

from ddp_reference import (  # noqa: E402,E501
    MODELS,
    RANKS,
    STEPS,
    HalfNet,
    Net,
    half_shard,
    make_optimizer,
    shard,
    shard_accumulating,
)

from flowreduce.torch import Trainer  # noqa: E402

# -- tensors in and out ------------------------------------------------------------------------
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
          "float64": torch.float64, "complex64": torch.complex64, "uint8": torch.uint8, "int8": torch.int8,
          "int16": torch.int16, "int32": torch.int32, "int64": torch.int64, "uint16": torch.uint16,
          "uint32": torch.uint32, "uint64": torch.uint64, "bool": torch.bool}
#: ops per dtype family: small integers in, so every sum is exact in every dtype
OPS = {"f": ["sum", "mean", "max"], "c": ["sum", "mean"], "i": ["sum", "max", "min"], "b": ["sum", "max", "min"]}


def _family(name):
    return "b" if name == "bool" else "c" if name.startswith("complex") else "f" if name[0] in "fb" else "i"


def rank_tensor(name, r, shape=(3, 5)):
    vals = torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape)
    return ((vals * (r + 1)) % 5).to(DTYPES[name])


def reference(name, op, p, shape=(3, 5)):
    """numpy on the same values (bfloat16: float32, then rounded as torch rounds)."""
    xs = [rank_tensor(name, r, shape) for r in range(p)]
    a = np.stack([(x.float() if x.dtype == torch.bfloat16 else x).numpy() for x in xs])
    ufunc = {"sum": np.add, "mean": np.add, "max": np.maximum, "min": np.minimum}[op]
    # no upcast (a sum of int8 is an int8), but bools are counted, as np.sum over the ranks does
    out = ufunc.reduce(a, axis=0, dtype=np.int64 if a.dtype == np.bool_ and op == "sum" else a.dtype)
    if op == "mean":
        out = out / p
    return torch.from_numpy(np.asarray(out)).to(DTYPES[name]) if out.dtype == a.dtype else torch.from_numpy(out)


def _same(x):
    return x


def put(client, value, worker):
    return client.submit(_same, value, workers=[worker], pure=False)


CASES = [(name, op) for name in DTYPES for op in OPS[_family(name)]]


@pytest.mark.parametrize("name,op", CASES, ids=[f"{n}-{o}" for n, o in CASES])
def test_tensors_in_tensors_out(inproc_client, name, op):
    """Made on the workers: torch 2.13 cannot pickle uint16/32/64 tensors, so
    they cannot travel between processes (between ranks they travel as numpy)."""
    ws = workers_of(inproc_client)
    parts = [inproc_client.submit(rank_tensor, name, r, workers=[ws[r]], pure=False) for r in range(4)]
    got = inproc_client.gather(flowreduce.allreduce(inproc_client, parts, op=op, algorithm="ring"))
    want = reference(name, op, 4)
    for r, t in enumerate(got):
        assert isinstance(t, torch.Tensor) and t.device.type == "cpu", type(t)
        assert t.dtype == want.dtype and t.shape == want.shape, (r, t.dtype, t.shape)
        assert torch.equal(t, want), (r, t, want)


@pytest.mark.parametrize("algorithm", ["butterfly", "ring", "auto"])
def test_bfloat16_and_float16_between_processes(proc_client, algorithm):
    """Real transfers (pickled numpy between processes), a pytree mixing
    dtypes in one call, template or not."""
    ws = workers_of(proc_client)
    trees = [collections.OrderedDict(h=rank_tensor("float16", r, (4, 33)), b=rank_tensor("bfloat16", r, (65,)),
                                     f=rank_tensor("float32", r, (2,))) for r in range(4)]
    parts = [put(proc_client, t, ws[r]) for r, t in enumerate(trees)]
    for like in (None, trees[0]):
        got = proc_client.gather(flowreduce.allreduce(proc_client, parts, op="sum", algorithm=algorithm, like=like,
                                                      bucket_bytes=256))
        for t in got:
            assert type(t) is collections.OrderedDict and list(t) == ["h", "b", "f"]
            assert torch.equal(t["h"], reference("float16", "sum", 4, (4, 33)))
            assert torch.equal(t["b"], reference("bfloat16", "sum", 4, (65,)))
            assert torch.equal(t["f"], reference("float32", "sum", 4, (2,)))
    del parts
    assert_clean(proc_client)


Pair = collections.namedtuple("Pair", "w b")


@dataclasses.dataclass
class Grads:
    w: object
    rest: object


STRUCTURES = {
    "ordereddict": lambda r: collections.OrderedDict([("z", rank_tensor("float32", r)), ("a", rank_tensor("int32", r))]),
    "dict": lambda r: {"z": rank_tensor("float64", r), "a": [rank_tensor("int64", r)]},
    "list": lambda r: [rank_tensor("float32", r), (rank_tensor("int16", r),)],
    "namedtuple": lambda r: Pair(rank_tensor("float32", r), collections.OrderedDict(x=rank_tensor("uint8", r))),
    "dataclass": lambda r: Grads(rank_tensor("float32", r), Pair(rank_tensor("int8", r), rank_tensor("bfloat16", r))),
}


def _leaves_sum(trees):
    from flowreduce.pytree import flatten, unflatten

    leaves = [flatten(t)[0] for t in trees]
    out = []
    for i, x in enumerate(leaves[0]):
        xs = [ls[i] for ls in leaves]
        acc = torch.stack([t.float() if t.dtype == torch.bfloat16 else t for t in xs]).sum(0)
        out.append(acc.to(x.dtype))
    return unflatten(flatten(trees[0])[1], out)


@pytest.mark.parametrize("with_like", [False, True], ids=["in-memory", "like"])
@pytest.mark.parametrize("kind", list(STRUCTURES))
def test_pytree_types_come_back(inproc_client, kind, with_like):
    from flowreduce.pytree import flatten

    ws = workers_of(inproc_client)
    trees = [STRUCTURES[kind](r) for r in range(3)]
    parts = [put(inproc_client, t, ws[r]) for r, t in enumerate(trees)]
    got = inproc_client.gather(flowreduce.allreduce(inproc_client, parts, algorithm="butterfly",
                                                    like=trees[0] if with_like else None))
    want = _leaves_sum(trees)
    for t in got:
        assert type(t) is type(want)
        (gl, gd), (wl, wd) = flatten(t), flatten(want)
        assert gd == wd
        for a, b in zip(gl, wl):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_like_takes_parameters_and_per_layer_futures(inproc_client):
    """A pytree of futures (one per layer) with a template of nn.Parameters:
    the call does not wait, results are tensors where the inputs were."""
    ws = workers_of(inproc_client)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2, bias=False))
    like = [collections.OrderedDict(m.named_parameters()) for m in model]
    parts = []
    for r in range(4):
        layers = [collections.OrderedDict((n, torch.full_like(p, float(r + i))) for n, p in m.named_parameters())
                  for i, m in enumerate(model)]
        parts.append([put(inproc_client, layer, ws[r]) for layer in layers])
    out = flowreduce.allreduce(inproc_client, parts, op="mean", like=like)
    for r in range(4):
        layers = inproc_client.gather(out[r])
        for i, (layer, m) in enumerate(zip(layers, model)):
            assert list(layer) == [n for n, _ in m.named_parameters()]
            for n, p in m.named_parameters():
                assert layer[n].dtype == torch.float32 and layer[n].shape == p.shape
                assert torch.equal(layer[n], torch.full_like(p, 1.5 + i))


def test_ranks_disagreeing_on_dtype_or_device_are_named(inproc_client):
    ws = workers_of(inproc_client)
    ones = [torch.ones(3), torch.ones(3), torch.ones(3, dtype=torch.float64), np.ones(3, np.float32)]
    e = error_of(lambda: flowreduce.allreduce(inproc_client, [put(inproc_client, x, ws[r]) for r, x in enumerate(ones)]))
    assert isinstance(e, ValueError) and re.search(
        r"ranks disagree on dtypes.*ranks \[0, 1\]: shape \(3,\), dtype torch.float32.*ranks \[2\]: shape \(3,\), "
        r"dtype torch.float64.*ranks \[3\]: shape \(3,\), dtype float32", str(e)), repr(e)
    devices = [torch.ones(3), torch.ones(3, device="meta")]
    e = error_of(lambda: flowreduce.allreduce(inproc_client, [put(inproc_client, x, ws[r])
                                                              for r, x in enumerate(devices)]))
    assert isinstance(e, ValueError) and re.search(r"ranks \[1\]: shape \(3,\), dtype torch.float32 on meta",
                                                   str(e)), repr(e)
    del e
    # with a template the first task of the rank at fault says so
    parts = [put(inproc_client, x, ws[r]) for r, x in enumerate([torch.ones(3), np.ones(3, np.float32)])]
    out = flowreduce.allreduce(inproc_client, parts, like=torch.ones(3))
    for f in out:
        with pytest.raises(TypeError, match="rank 1: input .* is a ndarray, not a torch array as like= says") as caught:
            f.result()
        caught.value.__traceback__ = None  # the future keeps the error; our frames in its traceback would keep `out`
    e = error_of(lambda: flowreduce.allreduce(
        inproc_client, [put(inproc_client, torch.ones(2, dtype=torch.bool), w) for w in ws], op="mean"))
    assert isinstance(e, TypeError) and "op='mean' of boolean arrays" in str(e), repr(e)
    out = parts = f = caught = e = None
    gc.collect()
    assert_clean(inproc_client)


# -- the trainer against DistributedDataParallel -------------------------------------------
@pytest.fixture(scope="module")
def ddp_results(gloo_ddp_results):
    """Final parameters and buffers of real DDP over gloo: 4 processes on
    127.0.0.1, one run per model and micro-batch count (the processes import
    only torch and ddp_reference; run once a session, tests/conftest.py)."""
    return gloo_ddp_results


def _init_params():
    torch.manual_seed(0)
    return collections.OrderedDict((n, p.detach().clone()) for n, p in Net().named_parameters())


#: (model, algorithm, micro-batches, steps per train() call[, steps per task]): by default train()
#: fuses 10 steps to a task, an SPMD job whose communicator averages each step (and broadcasts rank
#: 0's BatchNorm buffers); with one step per task "auto" on one host is the trainer's shared-memory
#: step (every bucket averaged in the step tasks for these small gradients; with "auto-mixed" the
#: 24 kB bucket gets a reduce level), the others go through flowreduce.allreduce; steps in several
#: train() calls cross finish() between them
CASES_DDP = {"butterfly": ("net", "butterfly", 1, STEPS), "ring": ("net", "ring", 1, STEPS, 1),
             "auto": ("net", "auto", 1, STEPS), "auto-mixed-levels": ("net", "auto-mixed", 1, 7, 1),
             "ring-accumulate3": ("net", "ring", 3, STEPS), "auto-accumulate3": ("net", "auto", 3, 6),
             "batchnorm-auto": ("bn", "auto", 1, STEPS, 1), "batchnorm-auto-fused": ("bn", "auto", 1, STEPS),
             "batchnorm-ring": ("bn", "ring", 1, 9, 1), "batchnorm-ring-fused": ("bn", "ring", 1, 9),
             # 4 and 3 steps to a task, blocks cut short at each train() call's end
             "auto-fused4": ("net", "auto", 1, 7, 4), "auto-accumulate3-fused3": ("net", "auto", 3, 5, 3),
             # float32 and float64 gradients: fused, one collective per dtype and step; one step per task,
             # a pytree flowreduce.allreduce
             "mixed-dtypes-fused": ("mixed", "auto", 1, STEPS), "mixed-dtypes": ("mixed", "auto", 1, 9, 1)}


def _set_min_bytes(n):
    """The worker's shared-memory pool takes values of ``n`` bytes and up (returns the old bound)."""
    from flowreduce.shm.pool import pool

    old, pool().min_bytes = pool().min_bytes, n
    return old


@pytest.fixture
def shm_for_small_values(proc_client):
    """Put the test model's few kB of gradients through shared memory, as a real model's are."""
    old = proc_client.run(_set_min_bytes, 0)
    yield
    for w, n in old.items():
        proc_client.run(_set_min_bytes, n, workers=[w])


@pytest.mark.parametrize("case", list(CASES_DDP))
def test_trainer_matches_ddp(proc_client, ddp_results, shm_for_small_values, monkeypatch, case):
    name, algorithm, micro, per_call, *fused = CASES_DDP[case]
    if algorithm == "auto-mixed":  # buckets of 4 kB averaged in the step tasks, larger ones by a reduce level
        from flowreduce.torch import direct

        monkeypatch.setattr(direct, "READ_ALL_BYTES", (RANKS - 1) * 4096)
        algorithm = "auto"
    ws = workers_of(proc_client)
    trainer = Trainer(proc_client, model=MODELS[name], optimizer=make_optimizer,
                      loss=torch.nn.functional.cross_entropy, data=shard if micro == 1 else shard_accumulating,
                      workers=ws[:RANKS], accumulate=micro, algorithm=algorithm, bucket_bytes=4096, threads=1,
                      steps_per_task=fused[0] if fused else None)
    graph = trainer.step_graph
    if algorithm == "auto" and name != "mixed":
        assert graph["all-reduce"] == "shared memory" and len(graph["levels"]) > 1
        assert set(graph["levels"]) == ({1, 2} if case == "auto-mixed-levels" else {1})
    else:
        assert graph["all-reduce"] == "flowreduce.allreduce" and graph["levels"] is None
    assert graph["steps_per_task"] == (fused[0] if fused else 10)  # float32 and float64 gradients fuse alike
    timings = []
    while len(timings) < STEPS:
        timings += trainer.train(min(per_call, STEPS - len(timings)))
    ours = [trainer.parameters(r) for r in range(RANKS)]
    for r in range(1, RANKS):  # every rank holds the very same bits
        for n in ours[0]:
            assert torch.equal(ours[r][n], ours[0][n]), (r, n)
    ddp = ddp_results[name, micro]
    for r in range(1, RANKS):
        for n in ours[0]:
            assert torch.equal(ddp[r][n], ddp[0][n]), ("ddp", r, n)
    assert list(ours[0]) == [n for n in ddp[0] if n in ours[0]]
    for n in ours[0]:
        np.testing.assert_allclose(ours[0][n].numpy(), ddp[0][n].numpy(), rtol=1e-5, atol=1e-7, err_msg=n)
    # module buffers (BatchNorm's running statistics): each rank's are rank 0's of the step before,
    # updated by its own last forward, as in DDP
    for r in range(RANKS):
        bufs = trainer.buffers(r)
        assert set(ours[0]) | set(bufs) == set(ddp[r])
        for n, b in bufs.items():
            np.testing.assert_allclose(b.numpy(), ddp[r][n].numpy(), rtol=1e-5, atol=1e-7, err_msg=(r, n))
    init = _init_params()
    assert torch.equal(ours[0]["never.weight"], init["never.weight"])  # no grad ever: weight decay skipped it
    assert not torch.equal(ours[0]["sometimes.weight"], init["sometimes.weight"])
    trainer.close()
    del trainer
    assert_clean(proc_client)
    assert_trainer_gone(proc_client)


def _half_reference(steps):
    """:class:`HalfNet` trained data parallel in one process: each step every
    rank's gradients, averaged in float32 (bfloat16 ones widened) and rounded
    back to the parameter's dtype, then one optimizer step."""
    torch.manual_seed(0)
    model = HalfNet()
    optimizer = make_optimizer(model.parameters())
    data = [half_shard(r, RANKS) for r in range(RANKS)]
    for step in range(steps):
        grads = []
        for r in range(RANKS):
            model.zero_grad(set_to_none=True)
            x, y = data[r][step]
            torch.nn.functional.cross_entropy(model(x), y).backward()
            grads.append([p.grad.float() for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = (torch.stack(gs).sum(0) / RANKS).to(p.dtype)
        optimizer.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("algorithm, fused, route", [("auto", None, "shared memory"), ("auto", 1, "shared memory"),
                                                     ("ring", 1, "flowreduce.allreduce")],
                         ids=["fused", "shared-memory-step", "allreduce-step"])
def test_bfloat16_layers_train_in_each_step_graph(proc_client, algorithm, fused, route):
    """A model with bfloat16 and float32 layers trains on every step graph
    (10 steps to a task, the shared-memory step, a pytree all-reduce per
    step): its gradients are averaged in float32 and rounded back, so the
    parameters stay bfloat16, every rank holds the same bits, and they match
    data parallelism in one process (to bfloat16 rounding: the order of the
    float32 additions differs)."""
    steps = 8
    with Trainer(proc_client, model=HalfNet, optimizer=make_optimizer, loss=torch.nn.functional.cross_entropy,
                 data=half_shard, workers=workers_of(proc_client)[:RANKS], algorithm=algorithm, threads=1,
                 steps_per_task=fused) as trainer:
        assert trainer.step_graph["all-reduce"] == route
        assert trainer.step_graph["steps_per_task"] == (fused or 10)
        trainer.train(steps)
        ours = [trainer.parameters(r) for r in range(RANKS)]
    expected = _half_reference(steps)
    assert {n: t.dtype for n, t in ours[0].items()} == {n: t.dtype for n, t in expected.items()} == {
        "body.weight": torch.bfloat16, "body.bias": torch.bfloat16, "head.weight": torch.float32,
        "head.bias": torch.float32}
    for r in range(1, RANKS):
        for n in ours[0]:
            assert torch.equal(ours[r][n], ours[0][n]), (r, n)
    for n, t in expected.items():
        torch.testing.assert_close(ours[0][n].float(), t.float(), rtol=2e-2, atol=2e-3, msg=n)
    assert_trainer_gone(proc_client)


def _steps_tasks(dask_scheduler):
    """The trainer's fused-step tasks the scheduler has seen (its task stream's keys)."""
    ext = dask_scheduler.plugins.get("task-stream") or dask_scheduler.extensions.get("task-stream")
    return [m["key"] for m in ext.buffer if "torch-steps-" in str(m["key"])] if ext else []


@pytest.mark.parametrize("name", ["net", "bn"])
def test_fused_steps_are_the_same_bits_in_fewer_tasks(proc_client, name):
    """``steps_per_task``: 10 steps as blocks of 4, 4 and 1 tasks per rank
    (across two train() calls, a step() graph step between them and one
    after) end with every rank holding the very bits of 10 steps one task
    each; with BatchNorm, a step() after a fused block broadcasts rank 0's
    buffers as the block left them, and every rank's buffers end the same."""
    ws = workers_of(proc_client)
    out, bufs = {}, {}
    with flowreduce.trace(proc_client) as tr:
        for fused in (1, 4):
            with Trainer(proc_client, model=MODELS[name], optimizer=make_optimizer,
                         loss=torch.nn.functional.cross_entropy,
                         data=shard, workers=ws, bucket_bytes=4096, threads=1, steps_per_task=fused) as trainer:
                assert trainer.step_graph["steps_per_task"] == fused
                timings = trainer.train(5)
                trainer.step()  # one step of its own in between: its update is applied by the next block
                timings += trainer.train(3)
                trainer.step()  # after a block: rank 0's buffers as the block left them reach every rank
                trainer.finish()
                out[fused] = [trainer.parameters(r) for r in range(4)]
                bufs[fused] = [trainer.buffers(r) for r in range(4)]
                assert [t.step for t in timings] == [0, 1, 2, 3, 4, 6, 7, 8]
                assert all(t.seconds > 0 and t.compute > 0 for t in timings)
                token, buckets = trainer.token, len(trainer.step_graph["levels"])
    for r in range(4):
        for n in out[1][0]:
            assert torch.equal(out[4][r][n], out[1][0][n]), (r, n)
        assert set(bufs[4][r]) == set(bufs[1][r]) == ({"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}
                                                      if name == "bn" else set())
        for n in bufs[1][r]:
            assert torch.equal(bufs[4][r][n], bufs[1][r][n]), (r, n)
    steps = {e.key for e in tr.events if f"torch-steps-{token}" in str(e.key)}
    assert len(steps) == 4 * 3, sorted(steps)  # blocks of 4 and 1, then 3: three tasks per rank for 8 steps
    # each fused step's buckets (several at 4 kB) averaged in one all-reduce of the ranks' SPMD communicator,
    # inside their block's task
    collectives = [e for e in tr.events if e.phase == "allreduce" and f"torch-steps-{token}" in str(e.key)]
    assert buckets > 1 and len(collectives) == 4 * 8, (buckets, len(collectives))
    assert_clean(proc_client)
    assert_trainer_gone(proc_client)


def _pid():
    return os.getpid()


def _shard_failing_on_rank_2(rank, ranks):
    """``shard``, except that rank 2's data runs dry with an error after 3 batches."""
    batches = list(shard(rank, ranks))
    for i in range(3 if rank == 2 else 10**9):
        yield batches[i % len(batches)]
    raise LookupError("rank 2's data source failed")


def test_a_rank_failing_in_fused_steps_stops_the_others(proc_client):
    """Rank 2's task fails in the middle of a block of fused steps (its data
    source raises at its fourth step): the SPMD job fails, the other ranks'
    pending collective raises (a FlowreduceError naming rank 2's error) instead
    of waiting for it, and train() raises rank 2's error; nothing keeps running."""
    import re

    from flowreduce.errors import FlowreduceError

    ws = workers_of(proc_client)
    with Trainer(proc_client, model=Net, optimizer=make_optimizer, loss=torch.nn.functional.cross_entropy,
                 data=_shard_failing_on_rank_2, workers=ws, threads=1, steps_per_task=50) as trainer:
        with pytest.raises(LookupError, match="rank 2's data source failed") as caught:  # the failure, not its echoes
            trainer.train(50)
        caught.value.__traceback__ = None
        del caught
        assert wait_until(lambda: not any(proc_client.processing().values()), 30), proc_client.processing()
        errors = [f.exception() for f in trainer.latest_tasks]
        assert isinstance(errors[2], LookupError)
        buckets = trainer.step_graph["levels"]
        # the others stopped in step 4's all-reduces at the latest, naming rank 2's error
        for r, e in enumerate(errors):
            if r != 2:
                assert isinstance(e, FlowreduceError) and not isinstance(e, LookupError), (r, e)
                assert re.search(r"rank 2 (raised|failed).*LookupError", str(e)), (r, e)
                seq = re.search(r"allreduce #(\d+)", str(e))
                assert seq and int(seq.group(1)) <= 4 * len(buckets), (r, e)


def _wait_for(name):
    from distributed import Event

    return Event(name).wait(120)


def _set(name):
    from distributed import Event

    Event(name).set()
    return True


def test_fused_steps_leave_the_slot_a_queued_task_needs(proc_client):
    """Rank 0's worker is busy with a task that waits for one queued on rank
    1's worker behind rank 1's fused task, which waits for rank 0's. A
    fused task, a rank of an SPMD job, leaves its worker's thread slot
    (distributed.secede), so the queued task runs and everything finishes
    (without it: a deadlock, ended here by the timeout with an error)."""
    import uuid

    ws = workers_of(proc_client)
    name = f"go-{uuid.uuid4().hex}"
    with dask.config.set({"flowreduce.timeout": 60}), \
            Trainer(proc_client, model=Net, optimizer=make_optimizer, loss=torch.nn.functional.cross_entropy,
                    data=shard, workers=ws, threads=1, steps_per_task=6) as trainer:
        trainer.train(1)
        blocker = proc_client.submit(_wait_for, name, workers=[ws[0]], pure=False)  # holds rank 0's only thread
        assert wait_until(lambda: ws[0] in proc_client.processing() and proc_client.processing()[ws[0]], 30)
        trainer.steps_fused(6)
        assert wait_until(lambda: any("torch-steps" in str(k) for k in proc_client.processing()[ws[1]]), 30)
        setter = proc_client.submit(_set, name, workers=[ws[1]], pure=False)  # queued behind rank 1's block
        assert setter.result(timeout=90) and blocker.result(timeout=90)
        trainer.finish()
        assert len(trainer.timings()) == 7
    assert_clean(proc_client)


def test_fused_steps_fail_when_a_rank_dies():
    """A rank's worker killed in the middle of a block of fused steps: the
    other ranks' collectives fail (the scheduler's SPMD watch tells them)
    and the trainer raises WorkerLostError naming the rank, instead of hanging."""
    import signal

    from distributed import Client, LocalCluster

    from flowreduce import WorkerLostError

    with LocalCluster(n_workers=4, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        ws = workers_of(client)
        pids = client.run(_pid)
        trainer = Trainer(client, model=Net, optimizer=make_optimizer, loss=torch.nn.functional.cross_entropy,
                          data=shard, workers=ws, threads=1, steps_per_task=100_000)
        trainer.train(2)
        trainer.steps_fused(100_000)  # submitted, running on every rank for minutes
        assert wait_until(lambda: len(client.processing()[ws[3]]) and all(client.processing().values()), 30)
        os.kill(pids[ws[3]], signal.SIGKILL)
        with pytest.raises(WorkerLostError, match="rank 3 of the trainer died"):
            trainer.finish()
        trainer.close()


def _shard_waiting_on_rank_1(rank, ranks):
    """``shard``, except that rank 1 first waits for an event nobody sets (its replica is never built)."""
    if rank == 1:
        from distributed import Event

        Event("rank-1-never").wait()
    return shard(rank, ranks)


def _processing(client, worker, prefix):
    return any(prefix in str(k) for k in client.processing().get(worker, ()))


def test_making_a_trainer_raises_when_a_rank_worker_leaves():
    """A rank's worker killed while the trainer builds its replica: making the trainer raises
    WorkerLostError naming that worker, rather than waiting forever for a task pinned to a worker that is gone
    (Dask keeps it in no-worker; a fresh-clone CI hung there once, 2026-11-29)."""
    import signal
    from concurrent.futures import ThreadPoolExecutor

    from distributed import Client, LocalCluster

    from flowreduce import WorkerLostError

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client, ThreadPoolExecutor(1) as pool:
        ws = workers_of(client)
        pids = client.run(_pid)
        making = pool.submit(Trainer, client, model=Net, optimizer=make_optimizer,
                             loss=torch.nn.functional.cross_entropy, data=_shard_waiting_on_rank_1, workers=ws,
                             threads=1)
        assert wait_until(lambda: _processing(client, ws[1], "torch-build"), 60)
        os.kill(pids[ws[1]], signal.SIGKILL)
        with pytest.raises(WorkerLostError, match=re.escape(f"worker {ws[1]} left the cluster")):
            making.result(timeout=120)


def test_steps_raise_when_a_rank_worker_leaves():
    """One task per step (no fused block whose peers notice): a rank's worker killed while a step runs makes
    finish() raise WorkerLostError naming the rank and its worker, not wait for the rank's pinned update."""
    import signal

    from distributed import Client, LocalCluster

    from flowreduce import WorkerLostError

    with LocalCluster(n_workers=3, threads_per_worker=1, processes=True, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        ws = workers_of(client)
        pids = client.run(_pid)
        with Trainer(client, model=Net, optimizer=make_optimizer, loss=torch.nn.functional.cross_entropy,
                     data=shard, workers=ws, threads=1, steps_per_task=1) as trainer:
            trainer.train(1)
            os.kill(pids[ws[2]], signal.SIGKILL)
            with pytest.raises(WorkerLostError, match=re.escape(f"rank 2 of the trainer died during its steps "
                                                                f"(worker {ws[2]} left the cluster)")):
                trainer.train(2)


def _torch_keys(dask_scheduler):
    return [k for k in dask_scheduler.tasks if "torch-" in str(k)]


def assert_trainer_gone(client):
    """No trainer task left on the scheduler, no shared-memory segment still
    leased on any worker (the pools keep free ones for reuse)."""
    from flowreduce.schedule.shm_plugin import usage

    def gone():
        return not client.run_on_scheduler(_torch_keys) and all(
            u.get("leased", 0) == 0 for u in usage(client).values())

    wait_until(gone, 10.0)
    assert not client.run_on_scheduler(_torch_keys)
    assert {w: u["leased"] for w, u in usage(client).items() if u.get("leased")} == {}


def _sum_of_head(model):
    return float(model.head.weight.sum())


def test_save_load_and_evaluate(proc_client, tmp_path):
    ws = workers_of(proc_client)
    with Trainer(proc_client, model=Net, optimizer=make_optimizer, loss=torch.nn.functional.cross_entropy,
                 data=shard, workers=ws[:2], threads=1) as trainer:
        trainer.train(3)
        path = trainer.save(str(tmp_path / "ckpt.pt"))
        saved = trainer.parameters(0)
        assert trainer.evaluate(_sum_of_head) == pytest.approx(float(saved["head.weight"].sum()))
        trainer.train(2)
        assert not torch.equal(trainer.parameters(1)["head.weight"], saved["head.weight"])
        trainer.load(path)
        for r in range(2):
            back = trainer.parameters(r)
            assert all(torch.equal(back[n], saved[n]) for n in saved)
        on_disk = torch.load(path, weights_only=True)
        assert set(on_disk) == {"model", "optimizer", "step", "epoch"} and on_disk["step"] == 3
        assert on_disk["optimizer"]["state"]  # momentum buffers saved
    assert_clean(proc_client)


def test_a_trace_holds_backward_update_and_every_buckets_allreduce(proc_client):
    """flowreduce.trace puts the trainer's own tasks and each bucket's
    all-reduce of a step on one timeline, rank by rank; fused steps, each rank's
    task of the SPMD job and one all-reduce per step inside it."""
    ws = workers_of(proc_client)[:2]
    with Trainer(proc_client, model=Net, optimizer=make_optimizer, loss=torch.nn.functional.cross_entropy,
                 data=shard, workers=ws, bucket_bytes=4096, algorithm="ring", threads=1,
                 steps_per_task=1) as trainer:
        trainer.train(1)
        with flowreduce.trace(proc_client) as tr:
            trainer.train(1)
        tokens = set(trainer.steps[-1].tokens)
    assert len(tokens) > 1  # several buckets at 4 kB
    for w in ws:
        mine = [e for e in tr.events if e.worker == w]
        user = {e.key.split(",", 1)[0].strip("('").rsplit("-", 1)[0] for e in mine if e.phase == "user-compute"}
        assert {"torch-backward", "torch-update"} <= user, user
        assert tokens <= {e.token for e in mine if e.phase in ("reduce", "copy", "split", "fusion")}
    with Trainer(proc_client, model=Net, optimizer=make_optimizer, loss=torch.nn.functional.cross_entropy,
                 data=shard, workers=ws, bucket_bytes=4096, algorithm="ring", threads=1) as trainer:
        assert trainer.step_graph["steps_per_task"] > 3
        with flowreduce.trace(proc_client) as tr:
            trainer.train(3)
    fused = [e for e in tr.events if str(e.job).startswith("torch-steps-")]
    for r in range(2):
        assert len([e for e in fused if e.rank == r and e.phase == "user-compute"]) == 1, r  # one task: 3 steps
        assert [e.phase for e in fused if e.rank == r and e.phase != "user-compute"] == ["allreduce"] * 3, r
    assert_clean(proc_client)


# -- the command ------------------------------------------------------------------------------
def test_flowreduce_train_framework_torch_end_to_end(tmp_path):
    """``flowreduce train --framework torch`` run as a user runs it (its own
    embedded LocalCluster): the model it saves, evaluated here with plain
    torch on the digits test split made here from scikit-learn, has the test
    accuracy the command printed and wrote, after the steps it says it ran."""
    import json
    import re
    import subprocess
    import sys

    from sklearn.datasets import load_digits

    from flowreduce.torch.digits import DigitsCNN

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    ckpt, report = tmp_path / "digits.pt", tmp_path / "report.json"
    out = subprocess.run([sys.executable, "-m", "flowreduce", "train", "--framework", "torch", "--ranks", "2",
                          "--epochs", "2", "--json", str(report), "--save", str(ckpt), "--steps-per-task", "8"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "8 steps per task" in out.stdout  # fused: 8 optimizer steps per task and rank
    printed = float(re.search(r"final test accuracy ([\d.]+)%", out.stdout).group(1)) / 100
    final = json.loads(report.read_text())["final"]
    saved = torch.load(ckpt, weights_only=True)
    assert saved["step"] == final["steps"] > 0 and saved["optimizer"]["state"]

    digits = load_digits()  # the split the command documents: a seed-0 permutation, the first 20% for testing
    order = np.random.default_rng(0).permutation(len(digits.target))
    test = order[:int(round(len(order) * 0.2))]
    model = DigitsCNN()
    model.load_state_dict(saved["model"])
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy((digits.data[test] / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)))
    accuracy = float((logits.argmax(1) == torch.from_numpy(digits.target[test])).float().mean())
    assert accuracy == pytest.approx(final["test_acc"], abs=1e-6)
    assert printed == pytest.approx(accuracy, abs=5e-5)  # printed with two decimals of a percent
    assert accuracy > 0.5  # it learnt: 10% is chance
    assert set(tmp_path.iterdir()) == {ckpt, report}  # nothing else left behind
