"""The same-host data plane: shared-memory segments (:mod:`~flowreduce.shm.pool`),
the posts ranks read each other's values from (:mod:`~flowreduce.shm.posts`) and
the warm result buffers (:mod:`~flowreduce.shm.result_buffers`)."""
