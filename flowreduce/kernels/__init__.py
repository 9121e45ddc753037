"""What a task or the engine runs on the data: the dense reductions and
slicing (:mod:`~flowreduce.kernels.dense`), fusion buckets
(:mod:`~flowreduce.kernels.fusion`), sparse and block-sparse values
(:mod:`~flowreduce.kernels.sparse`, :mod:`~flowreduce.kernels.blocks`,
:mod:`~flowreduce.kernels.sparse_payload`) and the same-host ones over shared
segments (:mod:`~flowreduce.kernels.shm`). No graphs here and no distributed."""
