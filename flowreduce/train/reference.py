"""Single-process training on the global batch: what data-parallel training
on N ranks must reproduce (same seed, same initial weights, same batches),
up to floating-point rounding."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from flowreduce.train import data, mlp
from flowreduce.train.config import TrainConfig

INPUTS, CLASSES = 64, 10


def schedule(config: TrainConfig, n_train: int) -> Iterator[tuple[int, int]]:
    """``(epoch, step in epoch)`` of every step of the run."""
    spe = data.steps_per_epoch(data.shard_size(n_train, config.ranks), config.batch)
    for epoch in range(config.epochs):
        for i in range(spe):
            yield epoch, i


def train_reference(config: TrainConfig, steps: int | None = None) -> dict:
    """Train in this process on the global batch of every step.

    Parameters
    ----------
    config : TrainConfig
        The same settings the data-parallel run uses (ranks decide the
        shards and so the batches).
    steps : int, optional
        Stop after that many steps in total (default: ``config.epochs`` epochs).

    Returns
    -------
    dict
        ``{"params": [...], "velocity": [...]}``, one ``{"W", "b"}`` per layer.

    Raises
    ------
    ImportError
        scikit-learn is missing.
    """
    X, y, _, _ = data.load_digits(config.seed, dtype=config.dtype)
    m = data.shard_size(len(y), config.ranks)
    shards = [(X[r * m:(r + 1) * m], y[r * m:(r + 1) * m]) for r in range(config.ranks)]
    state = mlp.init_state(mlp.layer_sizes(INPUTS, config.hidden, CLASSES), config.seed, config.dtype)
    for n, (epoch, i) in enumerate(schedule(config, len(y))):
        if steps is not None and n >= steps:
            break
        idx = [data.batch_indices(config.seed, epoch, r, i, m, config.batch) for r in range(config.ranks)]
        Xb = np.concatenate([shards[r][0][idx[r]] for r in range(config.ranks)])
        yb = np.concatenate([shards[r][1][idx[r]] for r in range(config.ranks)])
        cache = mlp.forward(state["params"], Xb, yb)
        state = mlp.sgd_momentum(state, mlp.backward(cache, state["params"]), config.lr, config.momentum)
    return state
