"""The same-host data plane: shared-memory segments (:mod:`~flowreduce.shm.pool`),
the posts ranks read each other's values from (:mod:`~flowreduce.shm.posts`), a
host's ranks exchanging step by step in shared memory (:mod:`~flowreduce.shm.host_group`:
SPMD communicators and the p2p engine's one-host runs) and the warm result buffers
(:mod:`~flowreduce.shm.result_buffers`)."""
