"""Calibration: measure α and β of each link class on a running cluster and
fit them (the ``flowreduce calibrate`` command writes the result to a cost
model file, :mod:`flowreduce.cli.calibrate`).

Two link classes come from where the workers run (the same grouping
``allreduce`` uses): *intra* between two workers of one host, *inter*
between workers of different hosts; a third, *shm*, is the intra pair with
each hop's array published through shared memory (the same-host data plane:
Dask moves a handle, the receiver copies the array out of the segment). For
each class that the cluster has, a
pair of workers plays ping-pong: a chain of ``hops`` dependent tasks,
alternately pinned to the two workers, each taking the previous one's
array, so every hop is one dependent task level plus one transfer of the
array, exactly the unit a plan is built of. Small arrays (the ping-pong)
give the latency α, large ones (the bandwidth run) the seconds per byte β;
one weighted least-squares line ``hop = α + β·bytes`` per class fits both
(:func:`fit_link`, relative errors, α and β kept non-negative).

Measuring needs a client (distributed is imported when it runs); fitting
is numbers only.

Example::

    model, measured = calibrate(client)
    model.to_file("cost-model.json", measured=measured)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from flowreduce.cost import CostModel, Link

#: Ping-pong sizes (latency) and bandwidth-run sizes, in bytes.
SMALL = (8, 1_000, 10_000)
LARGE = (1_000_000, 4_000_000, 16_000_000)


def fit_link(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[Link, float]:
    """Least-squares fit of ``seconds = α + β·nbytes`` with relative errors
    (each row divided by its time, so the small messages that fix α count
    as much as the large ones that fix β), α ≥ 0 and β > 0.

    Returns
    -------
    (Link, float)
        The fitted link and the root-mean-square relative error of the fit.

    Raises
    ------
    ValueError
        Fewer than two distinct sizes, non-positive times, or lengths that differ.
    """
    from scipy.optimize import nnls

    x = np.asarray(nbytes, dtype=float)
    y = np.asarray(seconds, dtype=float)
    if x.shape != y.shape or x.ndim != 1:
        raise ValueError(f"need as many sizes as times, got {x.shape} and {y.shape}")
    if len(np.unique(x)) < 2:
        raise ValueError(f"fitting α and β needs at least two distinct sizes, got {sorted(set(x.tolist()))}")
    if not np.all(y > 0) or not np.all(np.isfinite(y)):
        raise ValueError("times must be positive and finite")
    w = 1.0 / y
    (alpha, beta), _ = nnls(np.column_stack([w, x * w]), np.ones_like(y))
    beta = max(beta, 1e-15)  # a link with no measurable cost per byte still has one
    rel = (alpha + beta * x - y) / y
    return Link(float(alpha), float(beta)), float(np.sqrt(np.mean(rel ** 2)))


def _payload(nbytes: int, seed: int) -> np.ndarray:
    # random bytes: nothing on the way (compression) can shrink them
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def _hop(x: np.ndarray, hop: int) -> np.ndarray:
    return x


def _hop_pieces(x: Any, hop: int) -> tuple[np.ndarray, ...]:
    """A hop whose value is a tuple of pieces, as plan nodes' are (so it can be published)."""
    return (x,) if isinstance(x, np.ndarray) else tuple(x)


def ping_pong(client: Any, a: str, b: str, nbytes: int, hops: int, seed: int = 0, shm: bool = False) -> float:
    """Seconds per hop of a chain of ``hops`` dependent tasks alternating
    between workers ``a`` and ``b``, each moving an ``nbytes`` array
    (``shm``: through shared memory)."""
    from distributed import wait

    from flowreduce.kernels.shm import Publish

    hop = Publish(_hop_pieces) if shm else _hop
    x = client.submit(_payload, nbytes, seed, workers=[a], allow_other_workers=False, pure=False)
    wait([x])
    t0 = time.perf_counter()
    y = x
    for h in range(hops):
        y = client.submit(hop, y, h, workers=[b if h % 2 == 0 else a], allow_other_workers=False, pure=False)
    wait([y])
    elapsed = time.perf_counter() - t0
    del x, y
    return elapsed / hops


def worker_pairs(client: Any) -> dict[str, tuple[str, str]]:
    """One pair of workers per link class the cluster has: ``intra`` (two
    workers of one host), ``inter`` (workers of two hosts)."""
    from flowreduce.launch import ranked_workers
    from flowreduce.schedule.hosts import host_groups, worker_places

    workers = ranked_workers(client)
    groups = [[workers[r] for r in g] for g in host_groups(workers, worker_places(client, workers, fresh=True))]
    pairs = {}
    shared = next((g for g in groups if len(g) > 1), None)
    if shared:
        pairs["intra"] = (shared[0], shared[1])
    if len(groups) > 1:
        pairs["inter"] = (groups[0][0], groups[1][0])
    return pairs


def calibrate(client: Any, *, small: Sequence[int] = SMALL, large: Sequence[int] = LARGE, hops: int = 8,
              repeat: int = 3, base: CostModel | None = None, progress=None) -> tuple[CostModel, dict]:
    """Measure every link class of the cluster and fit it.

    Returns
    -------
    (CostModel, dict)
        ``base`` (default: the built-in constants) with the fitted ``intra``
        and ``inter`` links, and what was measured: the pairs, every
        sample (class, bytes, seconds per hop) and each fit's error.

    Raises
    ------
    ValueError
        A cluster with a single worker (nothing to measure).
    """
    pairs = worker_pairs(client)
    if not pairs:
        raise ValueError("calibrating needs at least two workers (one pair per link class)")
    samples: list[dict] = []
    fits: dict[str, dict] = {}
    links: dict[str, Any] = {}  # CostModel fields: intra, inter
    if "intra" in pairs and not pairs["intra"][0].startswith("inproc://"):  # in-process: nothing to share
        from flowreduce.schedule.extension import ensure_extension

        ensure_extension(client)
        pairs["shm"] = pairs["intra"]
    for cls, (a, b) in pairs.items():
        ping_pong(client, a, b, 8, 2)  # warm up the connection
        for size in [*small, *large]:
            times = [ping_pong(client, a, b, int(size), hops, seed=k, shm=cls == "shm") for k in range(repeat)]
            med = statistics.median(times)
            samples.append({"link": cls, "bytes": int(size), "seconds": med, "runs": times})
            if progress:
                progress(cls, int(size), med)
        rows = [s for s in samples if s["link"] == cls]
        link, err = fit_link([s["bytes"] for s in rows], [s["seconds"] for s in rows])
        links[cls] = link
        fits[cls] = {"alpha": link.alpha, "beta": link.beta, "bandwidth": link.bandwidth, "rms_rel_error": err}
    model = base or CostModel()
    from dataclasses import replace

    model = replace(model, **links)
    return model, {"pairs": {k: list(v) for k, v in pairs.items()}, "hops": hops, "repeat": repeat,
                   "fits": fits, "samples": samples}
