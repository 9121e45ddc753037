"""Settings of a training run, shared by the data-parallel trainer, the
single-process reference and the command line."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from flowreduce.fusion import DEFAULT_BUCKET_BYTES


@dataclass(frozen=True)
class TrainConfig:
    """One training run.

    ``batch`` is per rank: the global batch of a step is ``batch × ranks``
    (every rank's gradient is the mean over its batch, and the all-reduce
    takes the mean over ranks, which is the mean over the global batch
    because all ranks' batches have the same size).
    """

    ranks: int = 4
    hidden: tuple[int, ...] = (128, 64)
    batch: int = 16
    lr: float = 0.1
    momentum: float = 0.9
    epochs: int = 20
    seed: int = 0
    dtype: str = "float32"
    algorithm: str = "auto"
    chunks: int | None = None
    bucket_bytes: int | None = DEFAULT_BUCKET_BYTES
    overlap: bool = True
    straggler: tuple[int, float] | None = None  # (rank, seconds added to its backward, every step)
    #: keyword options of the algorithm, passed to every all-reduce call
    #: (e.g. ``{"group_size": 2}``: hierarchical over "hosts" of 2 ranks)
    options: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {self.ranks}")
        if self.batch < 1:
            raise ValueError(f"batch must be >= 1, got {self.batch}")
        if self.straggler is not None:
            r, s = self.straggler
            if not 0 <= r < self.ranks:
                raise ValueError(f"straggler rank {r} is not one of the {self.ranks} ranks")
            if s < 0:
                raise ValueError(f"straggler delay must be >= 0 seconds, got {s}")


def parse_straggler(text: str | None) -> tuple[int, float] | None:
    """``"RANK:SECONDS"`` -> ``(rank, seconds)``.

    Raises
    ------
    ValueError
        Not of that form.
    """
    if not text:
        return None
    rank, sep, seconds = text.partition(":")
    try:
        return int(rank), float(seconds) if sep else 0.1
    except ValueError:
        raise ValueError(f"--straggler takes RANK:SECONDS, e.g. 2:0.05; got {text!r}") from None
