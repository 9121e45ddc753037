"""``deterministic=True`` in :class:`flowreduce.torch.Trainer`: every
gradient-averaging route (the one-host shared-memory step, fused or not,
with or without its reduce level, and ``flowreduce.allreduce`` with any
algorithm) averages each element as ``reference_reduce(..., "mean",
order="tree")``, so training gives the same parameters bit for bit
(docs/reproducibility.md, "Bit-identical training with flowreduce.torch")."""

from __future__ import annotations

import dask
import numpy as np
import pytest
from utils import workers_of

import flowreduce

torch = pytest.importorskip("torch", reason="torch tests need the extra: pip install -e '.[torch]'")

from test_torch import assert_trainer_gone, shm_for_small_values  # noqa: E402, F401  (shm_for_small_values: a fixture)

from flowreduce.errors import OptionError  # noqa: E402
from flowreduce.torch import Trainer  # noqa: E402

RANKS, STEPS = 4, 3
#: Each rank's data on its own scale: gradients of very different magnitudes and signs, whose float
#: sum depends on the order of the additions (the default routes add in different orders)
SCALES = (1.0, 1e-3, 1e2, 3e-1)
#: route -> (algorithm, steps_per_task, every bucket through a reduce level)
ROUTES = {"shm-fused": ("auto", None, False), "shm-reduce-level": ("auto", 1, True), "ring": ("ring", None, False)}


def tiny():
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def scaled_shard(rank, ranks):
    g = torch.Generator().manual_seed(300 + rank)
    s = SCALES[rank % len(SCALES)]
    return [(torch.randn(5, 6, generator=g) * s, torch.randn(5, 2, generator=g) * s) for _ in range(STEPS)]


class Recording(torch.optim.SGD):
    """SGD keeping a copy of every averaged gradient it is given (``param.seen``)."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.__dict__.setdefault("seen", []).append(p.grad.detach().clone())
        return super().step(closure)


def recording_sgd(params):
    return Recording(params, lr=1e-2, momentum=0.9)


def _seen(model):
    return [[g.numpy() for g in p.__dict__.get("seen", [])] for p in model.parameters()]


def _local_grads(rank, ranks, seed=0):
    """Rank ``rank``'s gradients of the first step, computed as its replica does (on its worker)."""
    torch.manual_seed(seed)
    model = tiny()
    x, y = scaled_shard(rank, ranks)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.numpy().copy() for p in model.parameters()]


def train(client, route, deterministic, steps=STEPS, options=False):
    """Parameters after ``steps`` steps on ``route``, and the averaged gradients rank 0 applied
    (``deterministic`` from the dask config, read when the trainer is made; ``options``: the trainer's option)."""
    from flowreduce.torch import direct

    algorithm, per_task, levelled = ROUTES[route]
    with pytest.MonkeyPatch.context() as m, dask.config.set({"flowreduce.deterministic": not options and deterministic}):
        if levelled:  # every bucket through a reduce level: decided on the client, in the trainer's layout
            m.setattr(direct, "READ_ALL_BYTES", 0)
        trainer = Trainer(client, model=tiny, optimizer=recording_sgd, loss=torch.nn.functional.mse_loss,
                          data=scaled_shard, workers=workers_of(client)[:RANKS], algorithm=algorithm,
                          bucket_bytes=128, threads=1, steps_per_task=per_task,
                          options={"deterministic": deterministic} if options else {})
    with trainer:
        graph = trainer.step_graph
        if algorithm == "auto":
            assert graph["all-reduce"] == "shared memory"
            assert set(graph["levels"]) == ({2} if levelled else {1}) and len(graph["levels"]) > 1
            assert graph["steps_per_task"] == (1 if levelled else 10)
        else:
            assert graph["all-reduce"] == "flowreduce.allreduce"
        trainer.train(steps)
        params = [trainer.parameters(r) for r in range(RANKS)]
        seen = trainer.evaluate(_seen)
    for r in range(1, RANKS):  # every rank holds the very same bits, on every route
        for n in params[0]:
            assert torch.equal(params[r][n], params[0][n]), (route, r, n)
    assert_trainer_gone(client)
    return params[0], seen


def _bits(params) -> dict:
    return {n: p.numpy().tobytes() for n, p in params.items()}


@pytest.mark.usefixtures("shm_for_small_values")
def test_deterministic_training_is_the_same_bits_on_every_route(proc_client):
    """The default routes add in different orders (so this test can fail);
    with deterministic=True all three end with the very same parameters."""
    default = {r: _bits(train(proc_client, r, False)[0]) for r in ("shm-fused", "ring")}
    assert default["shm-fused"] != default["ring"], "the data should make the default orders differ"
    ordered = {r: _bits(train(proc_client, r, True)[0]) for r in ROUTES}
    for r in ROUTES:
        assert ordered[r] == ordered["shm-fused"], r


@pytest.mark.usefixtures("shm_for_small_values")
@pytest.mark.parametrize("route", list(ROUTES))
def test_averaged_gradient_is_the_reference_trees(proc_client, route):
    """A step's averaged gradient, as the optimizer is given it, is
    ``reference_reduce(per-rank gradients, "mean", order="tree")`` bit for bit."""
    ws = workers_of(proc_client)
    local = proc_client.gather([proc_client.submit(_local_grads, r, RANKS, workers=[ws[r]], pure=False)
                                for r in range(RANKS)])
    _, seen = train(proc_client, route, True, steps=1, options=True)  # the trainer's option, not the config
    assert [len(s) for s in seen] == [1] * len(local[0])
    for i, (got,) in enumerate(seen):
        want = flowreduce.reference_reduce([g[i] for g in local], "mean", order="tree")
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), (route, i, np.abs(got - want).max())


def test_exact_is_refused():
    with pytest.raises(OptionError, match="exact"):
        Trainer(None, model=tiny, optimizer=recording_sgd, loss=torch.nn.functional.mse_loss, data=scaled_shard,
                options={"deterministic": "exact"})
    with pytest.raises(OptionError, match="deterministic must be"):
        Trainer(None, model=tiny, optimizer=recording_sgd, loss=torch.nn.functional.mse_loss, data=scaled_shard,
                options={"deterministic": "yes"})
