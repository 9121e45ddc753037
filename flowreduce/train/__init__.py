"""Data-parallel training with flowreduce: a numpy MLP on scikit-learn's
digits (no download), sharded over ranks, one gradient all-reduce per step.

* :class:`~flowreduce.train.loop.DataParallel`: the trainer on a Dask cluster;
* :func:`~flowreduce.train.reference.train_reference`: the same training in
  one process on the global batch (what data-parallel training must equal);
* ``flowreduce train``: the command (:mod:`flowreduce.cli.train`).

Needs scikit-learn for the data (``pip install 'flowreduce[train]'``),
imported only when the data is loaded.
"""

from __future__ import annotations

from flowreduce.train.config import TrainConfig
from flowreduce.train.loop import DataParallel
from flowreduce.train.reference import train_reference

__all__ = ["DataParallel", "TrainConfig", "train_reference"]
