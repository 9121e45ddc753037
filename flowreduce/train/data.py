"""The data: scikit-learn's 8x8 handwritten digits (1,797 images, 10
classes), which ship inside the scikit-learn package (no download).

The images are split once into train and test sets (seeded); the training
set is cut into one equal shard per rank (the remainder is dropped, so every
rank has the same number of samples), and each epoch every rank walks its
own shard in a seeded random order, ``batch`` samples per step. The global
batch of a step is the union of the ranks' batches, which is what the
single-process reference trains on.
"""

from __future__ import annotations

import numpy as np


def load_digits(seed: int = 0, test_fraction: float = 0.2, dtype: str = "float32"):
    """``(X_train, y_train, X_test, y_test)``, pixels scaled to [0, 1].

    Raises
    ------
    ImportError
        scikit-learn is missing (with the command that installs it).
    """
    try:
        from sklearn.datasets import load_digits as _load
    except ImportError as e:
        raise ImportError("flowreduce train needs scikit-learn for its data set: "
                          "pip install 'flowreduce[train]'") from e
    d = _load()
    X = (d.data / 16.0).astype(dtype)
    y = d.target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(y))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return X[train], y[train], X[test], y[test]


def shard_size(n_train: int, ranks: int) -> int:
    return n_train // ranks


def load_shard(seed: int, ranks: int, rank: int, dtype: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    """Rank ``rank``'s shard of the training set (run on the rank's worker)."""
    X, y, _, _ = load_digits(seed, dtype=dtype)
    m = shard_size(len(y), ranks)
    return X[rank * m:(rank + 1) * m].copy(), y[rank * m:(rank + 1) * m].copy()


def load_eval(seed: int, dtype: str = "float32") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    X, y, Xt, yt = load_digits(seed, dtype=dtype)
    return {"train": (X, y), "test": (Xt, yt)}


def steps_per_epoch(shard: int, batch: int) -> int:
    return shard // batch


def batch_indices(seed: int, epoch: int, rank: int, step: int, shard: int, batch: int) -> np.ndarray:
    """Indices into rank ``rank``'s shard for step ``step`` of ``epoch``."""
    perm = np.random.default_rng([seed, epoch, rank]).permutation(shard)
    return perm[step * batch:(step + 1) * batch]


# -- elastic runs: the rank set changes, so batches are cut from one global order -----------------------


def load_train(seed: int, dtype: str = "float32") -> tuple[np.ndarray, np.ndarray]:
    """The whole training set (every rank of an elastic run holds it: its
    share of each step depends on how many ranks there are then)."""
    X, y, _, _ = load_digits(seed, dtype=dtype)
    return X, y


def elastic_batch(seed: int, epoch: int, offset: int, rank: int, batch: int, n: int) -> np.ndarray:
    """Rank ``rank``'s samples of the step that starts at position ``offset``
    of ``epoch``'s seeded order of the ``n`` training samples: the global
    batch is the next ``ranks × batch`` samples, rank r takes the r-th
    ``batch`` of them (Horovod's ``ElasticSampler`` the same way re-shards
    what is left of an epoch over whoever is there)."""
    perm = np.random.default_rng([seed, epoch]).permutation(n)
    return perm[offset + rank * batch:offset + (rank + 1) * batch]
