"""Lowering: a plan from :mod:`flowreduce.algorithms` becomes a Dask graph.

``method="tasks"``: a task per plan node and chunk (:mod:`~flowreduce.lower.graph`;
pytrees and fusion buckets in :mod:`~flowreduce.lower.buckets`, sparse plans in
:mod:`~flowreduce.lower.sparse`, the same-host routes in ``shm_*`` and
:mod:`~flowreduce.lower.direct`). ``method="p2p"``: a few tasks per rank that hand
the plan to the workers' engine (:mod:`~flowreduce.lower.p2p`). The tasks run the
kernels of :mod:`flowreduce.kernels`. This layer imports dask, never distributed:
:mod:`flowreduce.schedule` submits the graphs."""
