"""Key names, made in one place.

``("flowreduce-<algorithm>-<phase>-<token>", step, rank, chunk, node)`` (tensor
fusion: ``(..-pack-<token>, rank)`` and ``(..-unpack-<token>, rank, leaf)``; method="p2p":
``(..-hand-in-<token>, rank)`` (a worker hands all its ranks in, named by the first),
``(..-barrier-<token>, 0)`` and the outputs): no
digits in the name part, so the dashboard and the task stream group keys by
algorithm and phase (``dask.utils.key_split`` drops the hex token).
"""

from __future__ import annotations

import uuid

from flowreduce.phases import ARRIVE, BARRIER, HAND_IN, KEY_PHASES, OUTPUT, PACK, UNPACK

#: Longest first, so no phase is mistaken for the tail of a longer one.
_BY_LENGTH = sorted(KEY_PHASES, key=len, reverse=True)


def new_token() -> str:
    return uuid.uuid4().hex


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
