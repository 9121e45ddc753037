"""Lowering: a plan from :mod:`flowreduce.algorithms` becomes a Dask graph
(:mod:`~flowreduce.build.graph`; pytrees and fusion buckets in
:mod:`~flowreduce.build.buckets`, sparse plans in :mod:`~flowreduce.build.sparse`)
whose tasks run the kernels of :mod:`~flowreduce.build.kernels`. This layer
imports dask, never distributed: :mod:`flowreduce.schedule` submits the graphs."""
