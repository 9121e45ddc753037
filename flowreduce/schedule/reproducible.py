"""``deterministic="exact"``: the correctly rounded sum, composed from
ordinary all-reduces (docs/reproducibility.md).

Every step is exact, so no plan, chunking, transport or placement can
change the bits, and the lowerings stay as they are:

1. per rank, a task takes its values' binary exponents
   (:func:`flowreduce.reproducible.exponents`);
2. an all-reduce with op ``max`` of those: the shared exponents;
3. per rank, a task writes its values as int64 limbs below them
   (:func:`~flowreduce.reproducible.encode`);
4. an all-reduce with op ``sum`` of the limbs (integer addition: exact in
   any order and grouping);
5. per rank, a task rounds the exact sum once to the dtype
   (:func:`~flowreduce.reproducible.decode`) and, for ``mean``, divides
   it by the rank count in the dtype. From :data:`SPLIT_DECODE` elements,
   each rank decodes its 1/p share (zeros elsewhere) and a third, ordinary
   all-reduce sums the shares: exact, as each element is one value plus zeros.

Integer and boolean inputs, and ``min``/``max`` of any dtype, are exact
already: they pass through to the ordinary call.

Pytrees, several futures per rank and tensors of other libraries (torch):
per rank, a ``pack`` task per dtype copies the rank's tensors of that dtype
into one flat buffer (:func:`flowreduce.kernels.fusion.pack`, the tensor
fusion's, reading tensors as numpy through :mod:`flowreduce.arrays`); each
float32/float64 buffer takes the steps above, each integer or boolean buffer
the ordinary all-reduce (exact already); per rank and input future, an
``unpack`` task cuts the results back into the rank's structure and kinds
(:func:`flowreduce.kernels.fusion.unpack`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import Any

import numpy as np
from distributed import Client, Future

from flowreduce import reproducible
from flowreduce.errors import OptionError
from flowreduce.fusion import Layout, make_buckets
from flowreduce.kernels import fusion as _fusion_kernels
from flowreduce.keys import new_token, pack_key, parse, unpack_key
from flowreduce.lower.buckets import pack_sources, unpack_cuts
from flowreduce.ops import Op
from flowreduce.pytree import paths, spec, unflatten
from flowreduce.reproducible import ORDERLESS
from flowreduce.schedule import records
from flowreduce.schedule.inputs import ArrayMeta
from flowreduce.schedule.records import CallRecord, PytreeRecord

#: The values of ``deterministic`` (and of the dask config key ``flowreduce.deterministic``).
MODES = (False, True, "exact")
#: From this many elements, each rank decodes only its 1/p of them and an ordinary float all-reduce
#: puts the shares together (exact: each element is one rank's value plus zeros), instead of every
#: rank decoding every element (the decode is the costliest step: ~0.11 s per 1e6 float64).
SPLIT_DECODE = 1 << 16
#: Key names of the helper tasks (``flowreduce-<algorithm>-<phase>-<token>``: keys.py).
EXPONENTS, LIMBS, NAME = "exact-exponents", "exact-limbs", "exact"


def mode(value: Any) -> str | bool:
    """``deterministic`` checked: False, True (one fixed order of float
    additions over ranks: :func:`flowreduce.reproducible.tree_merge`) or
    ``"exact"``."""
    if value is None or value is False:
        return False
    if value is True:
        return True
    if isinstance(value, str) and value == "exact":
        return "exact"
    raise OptionError(f"deterministic must be False, True or 'exact', got {value!r}")


def applies(held: Any, op: Op) -> bool:
    """Whether a call holding ``held`` needs the exact path: float32/float64
    sums and means. False where the result is exact already (integers,
    booleans, min, max...); an :class:`~flowreduce.errors.OptionError` for
    float ops it cannot make exact (prod, callables) and for inputs it does
    not take (other float dtypes, bfloat16 tensors, sparse)."""
    dtypes = _dtypes(held)
    floats = [d for d in dtypes if d.kind in "fc"]
    if not floats or op.name in ORDERLESS:
        return False
    exact_op(op, floats[0])
    refused = _refused(held)
    if refused is not None:
        raise OptionError(f"deterministic='exact' takes numpy arrays and torch tensors of float32 or float64 (and "
                          f"integers, booleans), one per rank or in pytrees; got {refused} (pass "
                          "deterministic=False)")
    return True


def exact_op(op: Op, dtype: Any) -> None:
    """An :class:`~flowreduce.errors.OptionError` for a float op ``deterministic="exact"``
    cannot make exact: all but sums and means (prod, other ufuncs, callables)."""
    if op.name not in ("sum", "mean"):
        raise OptionError(f"deterministic='exact' makes float sums and means exact; op {op.name!r} on {dtype} "
                          "has no exact form (pass deterministic=True or False)")


def _refused(held: Any) -> str | None:
    """What of ``held`` the exact path does not take, or None."""
    if isinstance(held, ArrayMeta):
        return None if reproducible.supported(held.dtype) and held.native is None else _describe(held)
    if not isinstance(held, Layout):
        return _describe(held)
    for t in held.tensors:
        dtype = np.dtype(t.spec.dtype)
        if dtype.kind not in "fc":
            continue
        native = t.spec.native
        # a float reduced in another dtype than its own (torch bfloat16 as float32) would be rounded twice
        if not reproducible.supported(dtype) or (native is not None and native.dtype != dtype.name):
            return f"{t.spec} at {t.path or 'the input'}"
    return None


def allreduce(client: Client, futures: Sequence[Sequence[Future]], workers: Sequence[str], held: Any, op: Op,
              run: Callable[[list[Future], str, Any], list[Any]], check: bool = False) -> list[Any]:
    """The exact sum (or mean) of the ranks' inputs (rank ``r``'s futures
    ``futures[r]`` on ``workers[r]``, all ``held``: one array, or the
    tensors of a :class:`~flowreduce.fusion.Layout`), through
    ``run(futures, op, like)``: the ordinary all-reduce with the call's
    other options. ``check``: the ranks' inputs were not seen (a template):
    the pack tasks check them against ``held``, naming the rank. Nothing is
    waited for: the helper tasks are pinned, and each all-reduce is given
    the template of what they return (``like``)."""
    p = len(futures)
    if p > reproducible.MAX_RANKS:
        raise OptionError(f"deterministic='exact' sums at most {reproducible.MAX_RANKS} ranks exactly (int64 "
                          f"headroom of its limbs); got {p}")
    if _single_numpy(held):
        return _exact(client, [fs[0] for fs in futures], workers, _shape(held), _dtypes(held)[0], op, run)
    return _tensors(client, futures, workers, held, op, run, check)


def _exact(client: Client, inputs: Sequence[Future], workers: Sequence[str], shape: tuple[int, ...],
           dtype: np.dtype, op: Op, run: Callable[[list[Future], str, Any], list[Any]]) -> list[Future]:
    """Steps 1-5 for one float32/float64 array per rank (``inputs``)."""
    p = len(inputs)
    token = new_token()

    def per_rank(func: Callable[..., Any], key: Callable[[int], Any], *args: Sequence[Any]) -> list[Future]:
        return [client.submit(func, *(a[r] for a in args), key=key(r), workers=[workers[r]],
                              allow_other_workers=False, pure=False) for r in range(p)]

    exps = per_rank(reproducible.exponents, lambda r: pack_key(EXPONENTS, token, r), inputs)
    shared = run(exps, "max", spec(shape, reproducible.EXPONENT_DTYPE))
    limbs = per_rank(reproducible.encode, lambda r: pack_key(LIMBS, token, r), inputs, shared)
    sums = run(limbs, "sum", spec((reproducible.LIMBS[dtype], *shape), np.int64))
    mean_of = p if op.mean else 0
    if p == 1 or math.prod(shape) < SPLIT_DECODE:
        decode = partial(_decode, dtype=dtype, mean_of=mean_of)
        out = per_rank(decode, lambda r: unpack_key(NAME, token, r, 0), sums, shared)
    else:
        share = partial(_decode_share, dtype=dtype, mean_of=mean_of, ranks=p)
        shares = per_rank(share, lambda r: unpack_key(NAME, token, r, 0), sums, shared, range(p))
        out = run(shares, "sum", spec(shape, dtype))
    _describe_as_one(token, inputs, sums, out, shape, dtype)
    return out


def _tensors(client: Client, futures: Sequence[Sequence[Future]], workers: Sequence[str], layout: Layout, op: Op,
             run: Callable[[list[Future], str, Any], list[Any]], check: bool) -> list[Any]:
    """The tensors of ``layout`` (pytrees, several futures per rank, torch
    tensors) reduced one dtype at a time: per rank, each dtype's tensors
    packed into one flat buffer; float buffers summed exactly
    (:func:`_exact`), the others by the ordinary all-reduce (exact already);
    per rank and input future, the results cut back into its structure."""
    p = len(futures)
    token = new_token()
    specs = [t.spec for t in layout.tensors]
    # one buffer per dtype: fusion's buckets, none ever full
    buckets = make_buckets(specs, max(sum(s.nbytes for s in specs), 1))
    opaths = paths(layout.outer)
    specs_of = [tuple(specs[i] for i in layout.tensors_of(j)) for j in range(len(layout.inner))]
    reduced: list[list[Any]] = []  # per bucket, per rank: the reduced buffer
    parts: list[CallRecord] = []
    for bucket in buckets:
        btoken = new_token()
        outers, picks, sources = pack_sources(layout, bucket, specs_of, opaths, check)
        packed = [client.submit(_fusion_kernels.pack, bucket.dtype, bucket.size, [futures[r][j] for j in outers],
                                picks, sources, r, key=pack_key(NAME, btoken, r), workers=[workers[r]],
                                allow_other_workers=False, pure=False) for r in range(p)]
        dtype = np.dtype(bucket.dtype)
        if dtype.kind == "f":  # float32 or float64: applies() refused the others
            out = _exact(client, packed, workers, (bucket.size,), dtype, op, run)
        else:
            out = run(packed, op.name, spec((bucket.size,), dtype))
        reduced.append(out)
        part = _record_of(out[0])
        if part is not None:
            parts.append(part)
    located = {i: (b, off) for b, bucket in enumerate(buckets) for i, off in zip(bucket.tensors, bucket.offsets)}
    results = []
    for r in range(p):
        outs = []
        for j, structure in enumerate(layout.inner):
            used, cuts = unpack_cuts(layout, located, j)
            outs.append(client.submit(_fusion_kernels.unpack, structure, [reduced[b][r] for b in used], cuts,
                                      key=unpack_key(NAME, token, r, j), workers=[workers[r]],
                                      allow_other_workers=False, pure=False))
        results.append(unflatten(layout.outer, outs))
    if len(parts) == len(buckets):  # else forgotten already: nothing to describe
        records.describe_as((token,), PytreeRecord.of(layout, buckets, tuple(parts), None, tuple(workers)))
    return results


def _record_of(future: Any) -> CallRecord | None:
    """The record describe() answers for a bucket's reduced buffer."""
    info = parse(future.key)
    found = records.find(info["token"]) if info is not None else None
    return found if isinstance(found, CallRecord) else None


def _describe_as_one(token: str, inputs: Sequence[Future], sums: Sequence[Future], out: Sequence[Future],
                     shape: tuple[int, ...], dtype: np.dtype) -> None:
    """describe() of the call's results answers one record: the limbs' all-reduce
    (its plan, bytes and links: what moved the data), with the user's shape and dtype."""
    sums_key, out_key = parse(sums[0].key), parse(out[0].key)  # flowreduce's own keys: never None
    limbs = records.find_call(sums_key["token"]) if sums_key is not None else None
    if limbs is None or out_key is None:  # forgotten already: nothing to describe
        return
    record = replace(limbs, token=token, shape=shape, dtype=dtype.str, input_keys=tuple(f.key for f in inputs),
                     deterministic="exact")
    records.describe_as((token, out_key["token"]), record)


def _decode(limbs: np.ndarray, exps: np.ndarray, dtype: np.dtype, mean_of: int) -> np.ndarray:
    total = reproducible.decode(limbs, exps, dtype)
    # a mean that underflows to zero is +0.0 (as a sum of zero is)
    return np.asarray(np.add(np.true_divide(total, mean_of), 0, dtype=dtype)) if mean_of else total


def _decode_share(limbs: np.ndarray, exps: np.ndarray, rank: int, dtype: np.dtype, mean_of: int,
                  ranks: int) -> np.ndarray:
    """Rank ``rank``'s share of the elements decoded, zeros elsewhere: summed over
    the ranks (any order: one value and zeros), the whole result."""
    K, size = limbs.shape[0], exps.size
    lo, hi = rank * size // ranks, (rank + 1) * size // ranks
    out = np.zeros(size, dtype=dtype)
    out[lo:hi] = _decode(limbs.reshape(K, -1)[:, lo:hi], exps.reshape(-1)[lo:hi], dtype, mean_of)
    return out.reshape(exps.shape)


def _dtypes(held: Any) -> list[np.dtype]:
    if isinstance(held, Layout):
        return [np.dtype(t.spec.dtype) for t in held.tensors]
    dtype = getattr(held, "dtype", None)
    return [np.dtype(dtype)] if dtype is not None else []


def _shape(held: Any) -> tuple[int, ...]:
    return tuple(held.tensors[0].spec.shape) if isinstance(held, Layout) else tuple(held.shape)


def _single_numpy(held: Any) -> bool:
    if isinstance(held, Layout):
        return held.single_array and held.tensors[0].spec.native is None
    return isinstance(held, ArrayMeta)


def _describe(held: Any) -> str:
    if isinstance(held, ArrayMeta):
        return f"an array of {np.dtype(held.dtype)}"
    return type(held).__name__
