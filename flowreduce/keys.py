"""Key names, made in one place.

``("flowreduce-<algorithm>-<phase>-<token>", step, rank, chunk, node)`` (tensor
fusion: ``(..-pack-<token>, rank)`` and ``(..-unpack-<token>, rank, leaf)``; method="p2p":
``(..-hand-in-<token>, rank)`` (a worker hands all its ranks in, named by the first),
``(..-barrier-<token>, 0)`` and the outputs): no
digits in the name part, so the dashboard and the task stream group keys by
algorithm and phase (``dask.utils.key_split`` drops the hex token).
"""

from __future__ import annotations

import itertools
import os
import uuid

from flowreduce.phases import ARRIVE, BARRIER, HAND_IN, KEY_PHASES, OUTPUT, PACK, UNPACK

#: Longest first, so no phase is mistaken for the tail of a longer one.
_BY_LENGTH = sorted(KEY_PHASES, key=len, reverse=True)


def _reseed() -> None:
    global _seed, _process, _count
    seed = uuid.uuid4().int
    _seed, _process, _count = seed >> 64, f"{seed & _MASK:016x}", itertools.count()


_MASK = (1 << 64) - 1
_MIX = 0x9E3779B97F4A7C15  # odd: n -> n * _MIX + seed is a bijection of 64-bit words
_seed, _process, _count = 0, "", itertools.count()
_reseed()
os.register_at_fork(after_in_child=_reseed)  # a forked child names its calls apart from its parent's


def new_token() -> str:
    """32 hex digits, unique to the call: its count in this process, mixed so that no two of its calls
    share the first digits (the dashboard shows 8), then this process's random half (a uuid4 per call
    read os.urandom each time: 0.18 ms of a 1.3 ms call on futures still computing)."""
    return f"{(next(_count) * _MIX + _seed) & _MASK:016x}{_process}"


def name(algorithm: str, phase: str, token: str) -> str:
    return f"flowreduce-{algorithm}-{phase}-{token}"


def node_key(algorithm: str, phase: str, token: str, step: int, rank: int, chunk: int, node: int):
    return (name(algorithm, phase, token), step, rank, chunk, node)


def output_key(algorithm: str, token: str, rank: int):
    return (name(algorithm, OUTPUT, token), rank)


def pack_key(algorithm: str, token: str, rank: int):
    """A rank's copy of a bucket's tensors into one buffer (tensor fusion)."""
    return (name(algorithm, PACK, token), rank)


def unpack_key(algorithm: str, token: str, rank: int, leaf: int):
    """A rank's result for its ``leaf``-th input future, cut from reduced buckets."""
    return (name(algorithm, UNPACK, token), rank, leaf)


def hand_in_key(algorithm: str, token: str, rank: int):
    """method="p2p": the task handing the ranks of one worker to its engine (step 0), named by the first."""
    return (name(algorithm, HAND_IN, token), rank)


def arrive_key(algorithm: str, token: str, rank: int):
    """method="p2p" placed by Dask: the task keeping a rank's input in its worker's engine (step 0)."""
    return (name(algorithm, ARRIVE, token), rank)


def barrier_key(algorithm: str, token: str):
    """method="p2p": the task that runs once every rank has handed its input in."""
    return (name(algorithm, BARRIER, token), 0)


def parse(key) -> dict | None:
    """The parts of a flowreduce key, or None for anybody else's key."""
    if not (isinstance(key, tuple) and isinstance(key[0], str) and key[0].startswith("flowreduce-")):
        return None
    head, _, token = key[0].rpartition("-")
    rest = head[len("flowreduce-"):]
    for phase in _BY_LENGTH:
        if rest.endswith("-" + phase):
            algorithm = rest[: -len(phase) - 1]
            break
    else:
        return None
    if phase == OUTPUT:
        return {"algorithm": algorithm, "phase": phase, "token": token, "rank": key[1]}
    if phase in (HAND_IN, ARRIVE, BARRIER):  # the barrier runs on rank 0's worker, after every hand-in (step 0)
        return {"algorithm": algorithm, "phase": phase, "token": token, "rank": key[1],
                "step": 1 if phase == BARRIER else 0, "chunk": None, "node": None}
    if phase in (PACK, UNPACK):
        return {"algorithm": algorithm, "phase": phase, "token": token, "rank": key[1],
                "leaf": key[2] if phase == UNPACK else None, "step": None, "chunk": None, "node": None}
    step, rank, chunk, node = key[1:]
    return {"algorithm": algorithm, "phase": phase, "token": token,
            "step": step, "rank": rank, "chunk": chunk, "node": node}
