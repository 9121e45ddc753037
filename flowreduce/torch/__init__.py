"""Data-parallel PyTorch training on Dask with flowreduce's all-reduce.

>>> trainer = flowreduce.torch.Trainer(client, model=make_model, optimizer=make_sgd,     # doctest: +SKIP
...                                    loss=torch.nn.functional.cross_entropy, data=shard)
>>> trainer.train(100)                                                                    # doctest: +SKIP

* :class:`~flowreduce.torch.trainer.Trainer`: the trainer (client side);
* :class:`~flowreduce.torch.elastic.ElasticTrainer`: the same, surviving
  lost workers and growing when workers join (``--elastic``);
* :mod:`flowreduce.torch.replica`: what runs on each rank's worker;
* :mod:`flowreduce.torch.direct`: the gradients' average through shared
  memory when every rank shares one host (lowered into the step graph);
* :func:`~flowreduce.torch.backend.init_process_group`: inside a rank of
  :func:`flowreduce.spmd`, make its communicator the default
  ``torch.distributed`` group on the ``flowreduce`` backend (unmodified DDP);
* :mod:`flowreduce.torch.digits`: a small CNN on scikit-learn's digits
  (``flowreduce train --framework torch``, :mod:`flowreduce.cli.train_torch`).

Needs PyTorch (``pip install 'flowreduce[torch]'``). Plain ``allreduce`` of
tensors does not: :mod:`flowreduce.arrays` converts them without importing
torch. This package is named ``flowreduce.torch``; its modules import the
real ``torch`` by its absolute name.
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401  (the real torch: absolute import)
except ImportError as e:  # pragma: no cover - exercised without the extra
    raise ImportError("flowreduce.torch needs PyTorch: pip install 'flowreduce[torch]'") from e

from flowreduce.torch.backend import CollectiveError, FlowreduceProcessGroup, init_process_group
from flowreduce.torch.elastic import ElasticTrainer
from flowreduce.torch.trainer import StepRecord, StepTiming, Trainer

__all__ = ["CollectiveError", "ElasticTrainer", "FlowreduceProcessGroup", "StepRecord", "StepTiming", "Trainer", "init_process_group"]
