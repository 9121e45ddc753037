"""The ``flowreduce`` backend's group in processes that are not ranks of an SPMD job: collectives
through the c10d store ``torch.distributed.init_process_group`` gives the backend.

``dist.init_process_group("flowreduce", init_method=..., rank=r, world_size=n)`` from torchrun,
``torch.multiprocessing`` or a test harness has no flowreduce communicator to run on (its
peers, shared segments and mailboxes come from an SPMD job's layout). There the backend's
creator builds a :class:`StoreComm` on the group's store (a ``PrefixStore`` per group, so
``dist.new_group`` needs nothing more): each collective is one exchange of every rank's
bytes through the store, each rank combining all of them in rank order (the same bits on
every rank). It is a correct fallback, not a fast path: every byte goes through the store's
server (a ``TCPStore`` on rank 0 for ``tcp://`` and ``env://``). Inside an SPMD job,
:func:`flowreduce.torch.init_process_group` uses the job's communicator instead.
"""

from __future__ import annotations

import functools
import pickle
from typing import Any

import torch

#: reduce-op name (the communicator's) -> a function of two tensors
_COMBINE: dict[str, Any] = {"sum": torch.add, "mean": torch.add, "prod": torch.mul, "min": torch.minimum, "max": torch.maximum,
            "bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or, "bitwise_xor": torch.bitwise_xor}


def _dumps(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous()
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    return pickle.dumps((str(t.dtype).removeprefix("torch."), tuple(t.shape), raw.numpy().tobytes()),
                        protocol=pickle.HIGHEST_PROTOCOL)


def _loads(b: bytes) -> torch.Tensor:
    dtype_name, shape, raw = pickle.loads(b)
    dtype = getattr(torch, dtype_name)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    if dtype == torch.bool:
        return flat.to(torch.bool).reshape(shape)
    return flat.view(dtype).reshape(shape)


class StoreComm:
    """The communicator interface :class:`~flowreduce.torch.backend.FlowreduceProcessGroup` calls
    (``rank``, ``size``, ``allreduce``, ``broadcast``, ``allgather``, ``barrier``), over a c10d store.

    Collective ``k`` writes ``c{k}/{rank}``; every reader then adds 1 to ``c{k}/n``, and the
    last one deletes the collective's keys."""

    def __init__(self, store: Any, rank: int, size: int) -> None:
        self.store, self.rank, self.size = store, rank, size
        self.seq = 0

    def __repr__(self) -> str:
        return f"<flowreduce.torch.StoreComm rank {self.rank} of {self.size}>"

    def _exchange(self, payload: bytes | None, sources: list[int]) -> dict[int, bytes]:
        """Write ``payload`` (unless None), read the ``sources``' payloads, clean up once all have."""
        self.seq += 1
        prefix = f"c{self.seq}/"
        if payload is not None:
            self.store.set(f"{prefix}{self.rank}", payload)
        got = {r: self.store.get(f"{prefix}{r}") for r in sources}
        if self.store.add(f"{prefix}n", 1) == self.size:  # every rank has read: the last one cleans up
            for r in range(self.size):
                self._delete(f"{prefix}{r}")
            self._delete(f"{prefix}n")
        return got

    def _delete(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except Exception:  # noqa: BLE001  (a key never written, or a store without deletion: harmless)
            pass

    def allreduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        everyone = self._exchange(_dumps(x), list(range(self.size)))
        parts = [_loads(everyone[r]) for r in range(self.size)]
        out = functools.reduce(_COMBINE[op], parts)
        if op == "mean":
            out = out / self.size if out.is_floating_point() or out.is_complex() else out // self.size
        return out

    def broadcast(self, x: torch.Tensor, root: int = 0) -> torch.Tensor:
        got = self._exchange(_dumps(x) if self.rank == root else None, [root])
        return _loads(got[root])

    def allgather(self, x: torch.Tensor) -> list[torch.Tensor]:
        everyone = self._exchange(_dumps(x), list(range(self.size)))
        return [_loads(everyone[r]) for r in range(self.size)]

    def barrier(self) -> None:
        self._exchange(b"", list(range(self.size)))
