"""The example of ``flowreduce train --framework torch``: a small CNN on
scikit-learn's 8x8 digits, sharded over ranks like the numpy study
(:mod:`flowreduce.train.data`: the same seeded train/test split, one equal
shard per rank, a seeded new order every epoch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from flowreduce.train import data as _data


class DigitsCNN(torch.nn.Module):
    """conv 3x3 (16) - conv 3x3 (32) - max-pool 2 - dense 64 - dense 10: 39k parameters."""

    def __init__(self, channels: tuple[int, int] = (16, 32), hidden: int = 64) -> None:
        super().__init__()
        c1, c2 = channels
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(1, c1, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(c1, c2, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2))
        self.classifier = torch.nn.Sequential(
            torch.nn.Flatten(), torch.nn.Linear(c2 * 4 * 4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def _images(X: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(X.reshape(-1, 1, 8, 8).astype(np.float32))


@dataclass
class DigitsShard:
    """Rank ``rank``'s shard of the training set, iterated in batches of
    ``batch``, in a new seeded order every pass (like a ``DataLoader`` with
    ``shuffle=True`` and a seeded generator)."""

    rank: int
    ranks: int
    batch: int = 16
    seed: int = 0
    epoch: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        X, y = _data.load_shard(self.seed, self.ranks, self.rank)
        self.X, self.y = _images(X), torch.from_numpy(y)

    def __len__(self) -> int:
        return len(self.y) // self.batch

    def __iter__(self) -> Any:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch * 1009 + self.rank)
        self.epoch += 1
        order = torch.randperm(len(self.y), generator=g)
        for i in range(len(self)):
            idx = order[i * self.batch:(i + 1) * self.batch]
            yield self.X[idx], self.y[idx]


@dataclass(frozen=True)
class Shards:
    """``data=`` of the trainer: ``Shards(batch, seed)(rank, ranks)``."""

    batch: int = 16
    seed: int = 0

    def __call__(self, rank: int, ranks: int) -> DigitsShard:
        return DigitsShard(rank, ranks, self.batch, self.seed)


@dataclass(frozen=True)
class ElasticShards:
    """``data=`` of :class:`flowreduce.torch.elastic.ElasticTrainer`: every
    rank's worker holds the whole (small) training set (:meth:`load`), and
    the global batch of a step is the next ``ranks × batch`` samples of the
    epoch's seeded order, rank r taking the r-th ``batch`` of them
    (:func:`flowreduce.train.data.elastic_batch`, as the numpy trainer's
    elastic runs): a change of the rank set re-cuts the rest of the epoch."""

    batch: int = 16
    seed: int = 0

    def size(self) -> int:
        """Samples in the training set (an epoch ends when fewer than a global batch are left)."""
        return len(_data.load_digits(self.seed)[1])

    def load(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The training set as images and labels (run on every rank's worker)."""
        X, y = _data.load_train(self.seed)
        return _images(X), torch.from_numpy(y)

    def take(self, dataset: tuple[torch.Tensor, torch.Tensor], epoch: int, offset: int,
             rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank ``rank``'s batch of the step starting at ``offset`` of ``epoch``."""
        X, y = dataset
        idx = torch.from_numpy(_data.elastic_batch(self.seed, epoch, offset, rank, self.batch, len(y)))
        return X[idx], y[idx]


def steps_per_epoch(ranks: int, batch: int, seed: int = 0) -> int:
    n_train = len(_data.load_digits(seed)[1])
    return _data.shard_size(n_train, ranks) // batch


@dataclass(frozen=True)
class Accuracy:
    """``evaluate=`` of the trainer: loss and accuracy on the test and training sets."""

    seed: int = 0

    def __call__(self, model: torch.nn.Module) -> dict[str, float]:
        X, y, Xt, yt = _data.load_digits(self.seed)
        out = {}
        for name, (a, b) in {"train": (X, y), "test": (Xt, yt)}.items():
            logits = model(_images(a))
            target = torch.from_numpy(b)
            out[f"{name}_loss"] = float(torch.nn.functional.cross_entropy(logits, target))
            out[f"{name}_acc"] = float((logits.argmax(1) == target).float().mean())
        return out


@dataclass(frozen=True)
class SGD:
    """``optimizer=`` of the trainer: SGD with momentum."""

    lr: float = 0.05
    momentum: float = 0.9

    def __call__(self, params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum)
