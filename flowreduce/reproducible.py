"""Reproducible sums: an exact, order-independent fixed-point codec, and the
reference results users can compute themselves (docs/reproducibility.md).

``deterministic="exact"`` sums float32 and float64 values through integers:

1. each element's shared exponent ``E`` is the max over the ranks of the
   values' binary exponents (:func:`exponents`, combined with op ``max``:
   exact in any order);
2. each rank writes its values as :data:`LIMBS` signed int64 limbs of
   :data:`BITS` bits, fixed-point below ``2**E`` (:func:`encode`);
3. the limbs are summed in int64 (op ``sum``): integer addition, exact in
   any order and grouping (wrap-around is modular, and the final sums fit:
   at most :data:`MAX_RANKS` ranks);
4. :func:`decode` normalises the carries and rounds the exact sum once,
   round-half-even, to the dtype: for float64 what :func:`math.fsum` over
   the ranks gives, for float32 the exact sum rounded once to float32.

Why these sizes: a limb holds ``BITS = 52`` bits and keeps ``63 - 52 = 11``
bits of headroom, so 2048 ranks' limbs add up in int64 exactly. ``K``
limbs give an exact window of ``52 K`` bits below ``2**E``: a float64
(53 bits) is exact when it lies within ``52 K - 53`` binades of the
element's largest value (K=3: 103 binades, ~31 decimal orders of
magnitude); a float32 (24 bits) within ``52 K - 24`` (K=2: 80 binades, ~24
orders). Bits of a value below the window are truncated toward zero (each
rank's value on its own, before the sum: still the same bits in any order,
grouping or rank count, but no longer the correctly rounded sum). Sums of
subnormals are exact (the window reaches below 2**-1074 when E is small).

Non-finite values: the shared exponent is :data:`SPECIAL` where any rank
holds inf or NaN, and limb 0 then counts the ranks' NaNs, +infs and -infs;
the result is NaN if any rank has NaN or both signs of inf appear, else that
inf (what IEEE addition gives, and ``math.fsum``, which raises on NaN and on
inf - inf, is replaced by this rule). A finite exact sum too large for the
dtype rounds to inf (round-half-even overflow). Zeros: -0.0 sums as 0.0, and
an exact sum of zero is +0.0 (as ``math.fsum``).

The module is pure numpy: :mod:`flowreduce.schedule.reproducible` composes it
with all-reduces.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

import numpy as np

#: Bits per limb; 63 - BITS bits of headroom for the int64 sum over ranks.
BITS = 52
#: Most ranks whose limbs sum exactly in int64: 2 ** (63 - BITS).
MAX_RANKS = 2 ** (63 - BITS)
#: Limbs per element, by dtype: the exact window is LIMBS * BITS bits below 2**E.
LIMBS = {np.dtype(np.float64): 3, np.dtype(np.float32): 2}
#: The dtype of the shared exponents (frexp's exponents of float64 lie in [-1073, 1024]).
EXPONENT_DTYPE = np.dtype(np.int16)
#: The exponent of a zero: below every nonzero value's, so zeros never raise E.
ZERO = -1100
#: The exponent of inf and NaN: above every finite value's.
SPECIAL = 2000
#: Fields of limb 0 counting non-finite values (counts < MAX_RANKS < 2**20).
_NAN, _POS, _NEG = 40, 20, 0
_COUNT = (1 << 20) - 1
_MANTISSA = np.int64((1 << 52) - 1)
_LIMB_MASK = np.int64((1 << BITS) - 1)
#: Elements encoded or decoded at a time: a block's temporaries (32 KiB each) stay in cache and in
#: the heap, where whole-array ones are fresh pages every time -- Dask's workers set
#: MALLOC_TRIM_THRESHOLD_=65536, so freed memory goes back to the OS at once and the page faults
#: cost more than the math (measured in a worker at 1e6 float64: 65 ms encode, 113 ms decode with
#: 4096-element blocks; 118/426 ms whole-array, 227/500 ms with 16384)
BLOCK = 1 << 12
#: Significand bits, by dtype.
_PRECISION = {np.dtype(np.float64): 53, np.dtype(np.float32): 24}


def supported(dtype: Any) -> bool:
    """Whether the codec sums this dtype (float32 and float64)."""
    return np.dtype(dtype) in LIMBS


def exponents(x: np.ndarray) -> np.ndarray:
    """Each element's binary exponent (``np.frexp``: ``|x| < 2**e``) as
    :data:`EXPONENT_DTYPE`; :data:`ZERO` for zeros, :data:`SPECIAL` for inf
    and NaN. The max over ranks is the shared exponent ``E``."""
    x = np.asarray(x)
    _check(x.dtype)
    with np.errstate(invalid="ignore"):
        e = np.asarray(np.frexp(x)[1]).astype(EXPONENT_DTYPE)
    e[x == 0] = ZERO
    e[~np.isfinite(x)] = SPECIAL
    return e


def encode(x: np.ndarray, E: np.ndarray) -> np.ndarray:
    """``x``'s limbs below the shared exponents ``E``: int64 of shape
    ``(K, *x.shape)``, limb ``k`` holding bits ``[E - (k+1) BITS, E - k BITS)``
    of ``x`` with ``x``'s sign (truncated toward zero below the window)."""
    x = np.asarray(x)
    _check(x.dtype)
    K = LIMBS[x.dtype]
    flat, exps = x.reshape(-1), np.broadcast_to(np.asarray(E), x.shape).reshape(-1)
    out = np.empty((K, flat.size), dtype=np.int64)
    for lo in range(0, flat.size, BLOCK):
        out[:, lo:lo + BLOCK] = _encode(flat[lo:lo + BLOCK], exps[lo:lo + BLOCK], K)
    return out.reshape((K, *x.shape))


def _encode(x: np.ndarray, E: np.ndarray, K: int) -> np.ndarray:
    # integer operations only (no branches on the data): x = +-m 2**(ex - 1075), m < 2**53
    bits = np.asarray(x, dtype=np.float64).view(np.int64)  # float32 -> float64 is exact
    sign = bits >> 63  # 0, or -1 where x is negative
    ex = (bits >> 52) & 0x7FF
    m = (bits & _MANTISSA) | ((ex != 0).astype(np.int64) << 52)  # subnormals have no implicit bit
    # x's bit i sits at bit i + shift of the window, whose bit 0 is worth 2**(E - K BITS)
    shift = np.maximum(ex, 1) - 1075 + K * BITS - np.broadcast_to(np.asarray(E), x.shape).astype(np.int64)
    out = np.empty((K, *x.shape), dtype=np.int64)
    for k in range(K):
        t = shift - (K - 1 - k) * BITS  # m's shift into limb k; |t| >= 64 leaves nothing (clipped, then masked)
        limb = ((m << np.clip(t, 0, 63)) >> np.clip(-t, 0, 63)) & _LIMB_MASK
        out[k] = (limb ^ sign) - sign
    special = ex == 0x7FF  # inf and NaN: their elements' E is SPECIAL, so every limb above is 0
    if special.any():
        nan = special & (m != 1 << 52)
        out[0] += (nan.astype(np.int64) << _NAN) | ((special & ~nan & (sign == 0)).astype(np.int64) << _POS) \
            | ((special & ~nan & (sign != 0)).astype(np.int64) << _NEG)
    return out


def decode(limbs: np.ndarray, E: np.ndarray, dtype: Any) -> np.ndarray:
    """The sum the (summed) ``limbs`` hold, rounded once, round-half-even,
    to ``dtype``."""
    dtype = np.dtype(dtype)
    _check(dtype)
    limbs = np.asarray(limbs, dtype=np.int64)
    K = LIMBS[dtype]
    if limbs.shape[0] != K:
        raise ValueError(f"{dtype} takes {K} limbs, got {limbs.shape[0]}")
    shape = limbs.shape[1:]
    flat, exps = limbs.reshape(K, -1), np.broadcast_to(np.asarray(E), shape).reshape(-1)
    out = np.empty(flat.shape[1], dtype=dtype)
    for lo in range(0, out.size, BLOCK):
        out[lo:lo + BLOCK] = _decode(flat[:, lo:lo + BLOCK], exps[lo:lo + BLOCK], dtype, K)
    return out.reshape(shape)


def _decode(limbs: np.ndarray, E: np.ndarray, dtype: np.dtype, K: int) -> np.ndarray:
    shape = limbs.shape[1:]
    E = E.astype(np.int64)
    a = [limbs[k] for k in range(K)]
    _carry(a)  # new arrays for every limb: the caller's are not written to
    # magnitude: where negative, negate the whole number (lower limbs are in [0, 2**BITS)), without branches
    neg = (a[0] < 0).astype(np.int64)
    for k in range(1, K):
        a[k] ^= _LIMB_MASK * neg
    a[0] ^= -neg  # -a - 1
    a[K - 1] += neg
    _carry(a)
    # the top bits into w (at most 62 of them), the rest into a sticky bit
    w, sticky = a[0], np.zeros(shape, dtype=bool)
    unit = np.full(shape, (K - 1) * BITS, dtype=np.int64)  # w's last bit is worth 2**(unit + E - K BITS)
    for k in range(1, K):
        s = np.clip(62 - _bit_length(w), 0, BITS)
        rest = BITS - s
        w = (w << s) | (a[k] >> rest)
        sticky |= (a[k] & ((np.int64(1) << rest) - 1)) != 0
        unit -= s
    # round w to the dtype's precision, half to even (sticky breaks ties upward)
    drop = np.maximum(_bit_length(w) - _PRECISION[dtype], 0)
    q = w >> drop
    rem = w & ((np.int64(1) << drop) - 1)
    half = np.int64(1) << np.maximum(drop - 1, 0)  # drop 0: rem is 0, never above or at 1
    q += (rem > half) | ((rem == half) & (sticky | ((q & 1) == 1)))
    with np.errstate(over="ignore"):
        mag = np.ldexp(q.astype(np.float64), (unit + drop + E - K * BITS).clip(-2000, 2000).astype(np.int32))
        # exact: mag has at most the dtype's bits (or overflows to inf); a negative sum is never 0
        out = np.copysign(mag, 0.5 - neg).astype(dtype)
    special = E == SPECIAL
    if special.any():
        c = limbs[0]
        nan = ((c >> _NAN) & _COUNT) > 0
        pos = ((c >> _POS) & _COUNT) > 0
        ng = ((c >> _NEG) & _COUNT) > 0
        value = np.where(nan | (pos & ng), np.nan, np.where(pos, np.inf, -np.inf)).astype(dtype)
        out = np.where(special, value, out)
    return out


def exact_sum(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """The ranks' arrays summed through the codec in one process (what
    ``deterministic="exact"`` computes across ranks)."""
    xs = [np.asarray(a) for a in arrays]
    E = np.max([exponents(x) for x in xs], axis=0)
    total = np.asarray(np.sum([encode(x, E) for x in xs], axis=0, dtype=np.int64))
    return decode(total, E, xs[0].dtype)


#: Elements per block of :func:`exact_fold`: its 6 float64 scratch rows and the ranks' blocks about fill
#: L2 (measured: 4096 elements cost 2.6x, 8192 1.7x this, in numpy calls; 65536 no better)
FOLD_BLOCK = 1 << 15
_U = 2.0 ** -53  # float64's unit roundoff


def exact_fold(arrays: Sequence[Any], out: np.ndarray) -> np.ndarray:
    """:func:`exact_sum` of ``arrays`` (all one rank's values each) into
    ``out`` (C-contiguous, their size and dtype; it may be one of them), the
    same bits, in a few float passes instead of the codec's integer ones.

    Where every rank's values are at hand (a plan that gathers them), the
    codec's limbs are not needed: per element, the ranks' values are added
    in float64 with the rounding error of every addition kept (``TwoSum``),
    then ``r``, the rounded sum of the sum and the errors, is *certified*:
    the true sum ``S`` lies within ``|d| + bound`` of ``r``, where ``d`` is
    the last rounding's error and ``bound`` covers the errors' own float
    sum and the codec's truncation below its window. When that distance is
    under half the gap to ``r``'s nearest neighbour, both ``S`` and the sum
    the codec holds round to ``r``: the codec's bits. The few elements not
    certified (heavy cancellation, exact ties, inf, NaN, overflow) go
    through :func:`_exact_few` (once for the whole fold), then the codec.
    One fold costs ~30 float passes over the data against the codec's ~100
    integer ones.

    Most blocks need none of that: where the block's magnitudes span less
    than ``2**52 / n**2`` (float64; :func:`_errors_add_exactly`) the errors'
    float sum is exact, so ``fl(s + e)`` is the exact sum rounded once, ties
    included (~20 passes); where float32 values span less than ``2**29 / n``
    (:func:`_float64_sum_is_exact`) their float64 sum is exact and is rounded
    once to float32 (~n passes)."""
    flat = out.reshape(-1)
    dtype = flat.dtype
    _check(dtype)
    xs = [np.asarray(x).reshape(-1) for x in arrays]
    n = len(xs)
    if n == 1:
        np.copyto(flat, xs[0])
        np.add(flat, 0.0, out=flat, where=flat == 0)  # -0.0 -> +0.0, as the codec
        bad = ~np.isfinite(flat)
        if bad.any():
            flat[bad] = exact_sum([x[bad] for x in xs])
        return out
    # |S - r| <= |d| + M k: the errors' own float sum (n - 2 additions of terms below u n M each) and the
    # codec's truncation (below 2**(E - K BITS) per value, E <= log2(2M)), with a factor 2 to spare; M is
    # the largest magnitude in the block (a few reductions, not a pass per rank)
    k = (4.0 * n ** 3 * _U * _U if n > 2 else 0.0) + 4.0 * n * 2.0 ** -(LIMBS[dtype] * BITS)
    single = dtype == np.float32
    step = min(FOLD_BLOCK, max(flat.size, 1))
    scratch = np.empty((6, step))
    closer: list[tuple[np.ndarray, list[np.ndarray]]] = []  # elements left to the closer check, and their values
    for lo in range(0, flat.size, step):
        w = min(step, flat.size - lo)
        rows = [row[:w] for row in scratch]
        blocks = [x[lo:lo + w] for x in xs]
        big, exact = _exact_in_floats(blocks, scratch[5, :w], single)
        if single and exact:  # the plain float64 sum is the exact sum
            o = flat[lo:lo + w]
            s = np.add(blocks[0], 0.0, out=scratch[0, :w], dtype=np.float64)  # -0.0 -> +0.0, as the codec
            for x in blocks[1:]:
                np.add(s, x, out=s)
            with np.errstate(over="ignore"):  # beyond float32's range: inf, as the codec rounds
                np.copyto(o, s, casting="same_kind")  # rounded once, half to even
            continue
        if single:  # float32 values are exact in float64; the sums are made there
            s = np.asarray(blocks[0], dtype=np.float64)
            wide = [np.asarray(x, dtype=np.float64) for x in blocks[1:]]
        else:
            s, wide = blocks[0], blocks[1:]
        e, t, u, v, d, spare = rows
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are told apart below
            for i, x in enumerate(wide):
                _two_sum(s, x, t, u, v, error=e if i == 0 else u)  # t: the new sum
                if i:
                    np.add(e, u, out=e)
                s, t = t, (spare if s is blocks[0] else s)  # the old sum's row is free, unless it is an input
            if exact:  # (float64 here) S = s + e exactly: one addition rounds it
                np.add(s, e, out=s)  # s is a scratch row here: the inputs are read, ``out`` may be one of them
                np.add(s, 0.0, out=flat[lo:lo + w])  # an exact zero sum is +0.0, as the codec's
                continue
            if single:  # r's float32 half gap can exceed M k where the sum cancelled: d must be exact
                _two_sum(s, e, t, u, v, error=d)
            else:  # r, d by FastTwoSum (3 operations), exact where |s| >= |e|; where not, the sum cancelled
                # below its errors and r's half gap (< 2 (n-1) n u**2 M) is under M k: the test fails whatever d is
                np.add(s, e, out=t)
                np.subtract(e, np.subtract(t, s, out=d), out=d)
            r = t
            # inf and NaN: d is NaN where r is not finite (TwoSum's inf - inf), so the test fails there;
            # where M is not finite, it fails for the whole block, which is then checked the closer way
            if single:  # S - r32 = (r - r32) + d: the first difference is exact (Sterbenz)
                r32 = r.astype(np.float32)
                np.add(np.subtract(r, r32, out=u), d, out=d)
                np.multiply(np.abs(d, out=d), 1.0 + 4 * _U, out=d)
                h = _half_gap(r32, v.view(np.int32)[:w], np.int32(0x7F800000), 2.0 ** -24)
                np.add(d, big * k, out=d)
                ok = np.less_equal(d, h)
            else:  # the bound |d| + M k, rounded up, taken from r toward zero (the side of the smaller gap,
                # below a power of two) must round back to r: every sum within it does (2 passes fewer
                # than comparing with the half gap)
                np.multiply(np.add(np.abs(d, out=d), big * k, out=d), 1.0 + 4 * _U, out=d)
                ok = np.equal(np.subtract(r, np.copysign(d, r, out=d), out=d), r)
        if not ok.all():  # their values taken before the block is written: ``out`` may be one of the arrays
            bad = np.flatnonzero(~ok)
            closer.append((bad + lo, [x[bad] for x in blocks]))
        np.add(r32 if single else r, 0.0, out=flat[lo:lo + w])  # an exact zero sum is +0.0, as the codec's
    if closer:  # checked all at once: a few elements per block, each check dozens of numpy calls
        flat[np.concatenate([at for at, _ in closer])] = _exact_few(
            [np.concatenate([vs[i] for _, vs in closer]) for i in range(n)], dtype)
    return out


def _exact_in_floats(blocks: Sequence[np.ndarray], scratch: np.ndarray, single: bool) -> tuple[float, bool]:
    """The largest magnitude among ``blocks`` (inf or NaN if they hold one),
    and whether their magnitudes span little enough for a float sum to be
    exact: float32 values summed in float64 (:func:`_float64_sum_is_exact`),
    float64 values summed with their TwoSum errors (:func:`_errors_add_exactly`).
    A few values of each block are looked at first: wide data fails there,
    without the pass over every value that the smallest magnitude takes."""
    n = len(blocks)
    big = float(np.max([max(x.max(), -x.min()) for x in blocks]))  # numpy's max keeps a NaN, Python's may not
    exact = _float64_sum_is_exact if single else _errors_add_exactly
    for least in (_least(x[:_SAMPLE], scratch[:_SAMPLE]) for x in blocks):
        if not exact(n, big, least):
            return big, False
    return big, exact(n, big, min(_least(x, scratch) for x in blocks))


_SAMPLE = 64


def _least(x: np.ndarray, scratch: np.ndarray) -> float:
    """The smallest nonzero magnitude in ``x`` (inf if none)."""
    a = np.abs(x, out=scratch[:x.size])
    least = a.min(initial=np.inf)
    return float(least if least > 0 else a.min(where=a > 0, initial=np.inf))


def _float64_sum_is_exact(n: int, big: float, small: float) -> bool:
    """Whether any float64 sum of ``n`` float32 values, each zero or of
    magnitude within [``small``, ``big``], is exact: they and their sums are
    multiples of ``q = 2**(floor(log2 small) - 23)`` > ``small 2**-24``
    (float32 normals), so sums below ``2**53 q`` are floats; ``n big`` is
    that bound when ``big <= small 2**29 / n``."""
    return bool(np.isfinite(big)) and small >= 2.0 ** -126 and big * n <= small * 2.0 ** 29


def _errors_add_exactly(n: int, big: float, small: float) -> bool:
    """Whether the float sum of the ``TwoSum`` errors of ``n`` float64
    values (magnitudes within [``small``, ``big``], or zero) is exact, so the
    sum ``s`` and the errors' sum ``e`` hold the exact sum ``S = s + e``: the
    values, the rounded sums and their errors are multiples of ``q =
    2**(floor(log2 small) - 52)`` (normals), the errors are each below
    ``2**-53 n big`` and add up to below ``n**2 big 2**-53``, which is under
    ``2**53 q`` (so every partial sum is a float) when ``big <= small
    2**52 / n**2``. That also keeps every value inside the codec's window
    (``2**102`` binades), so ``fl(s + e)`` is the codec's result; ``n big``
    far below the largest float rules out an overflow on the way."""
    return (bool(np.isfinite(big)) and small >= 2.0 ** -1022 and big * n * n <= small * 2.0 ** 52
            and big * n <= 2.0 ** 1020)


def _half_gap(r: np.ndarray, bits: np.ndarray, exponent: Any, half_ulp: float) -> np.ndarray:
    """Just under half the gap from ``|r|`` to its nearer neighbour (0 where
    ``r`` is 0 or subnormal, so only an exact ``r`` passes there), written
    over ``bits`` (integer scratch the width of ``r``'s dtype): the binade of
    ``|r|``'s predecessor (bits minus one, exponent kept) times half an ulp,
    which halves the gap at powers of two, where the one below is smaller."""
    np.bitwise_and(r.view(bits.dtype), np.iinfo(bits.dtype).max, out=bits)  # |r|'s bits: the sign cleared
    np.maximum(bits, 1, out=bits)
    np.subtract(bits, 1, out=bits)
    np.bitwise_and(bits, exponent, out=bits)
    return np.multiply(bits.view(r.dtype), half_ulp * (1 - 4 * _U), dtype=np.float64)


def _two_sum(s: np.ndarray, x: np.ndarray, t: np.ndarray, u: np.ndarray, v: np.ndarray,
             error: np.ndarray) -> None:
    """``t, error = fl(s + x), (s + x) - fl(s + x)`` exactly (Knuth's TwoSum,
    six float operations, no branch); ``s`` and ``x`` are only read, ``u``
    and ``v`` are scratch, ``error`` may be ``u``."""
    np.add(s, x, out=t)          # t = s' = fl(s + x)
    np.subtract(t, s, out=u)     # u = b' = s' - s
    np.subtract(t, u, out=v)     # v = s' - b'
    np.subtract(s, v, out=v)     # v = s - (s' - b')
    np.subtract(x, u, out=u)     # u = x - b'
    np.add(v, u, out=error)


def _exact_few(xs: Sequence[np.ndarray], dtype: np.dtype) -> np.ndarray:
    """:func:`exact_sum` of the elements :func:`exact_fold` could not
    certify (ties above all: a sum one bit too long for the dtype), checked
    more closely: where the errors add up without rounding (kept by a second
    ``TwoSum``) the sum is a float and its errors, so one IEEE addition
    rounds it correctly, and where every value lies within the codec's exact
    window that is the codec's result. What is left goes through the codec."""
    X = [np.asarray(x, dtype=np.float64) for x in xs]
    c = 2.0 ** (LIMBS[dtype] * BITS - _PRECISION[dtype] - 1)  # max|x| <= min|x| c: no bit below the window
    with np.errstate(over="ignore", invalid="ignore"):
        s, e, big = X[0].copy(), np.zeros_like(X[0]), np.abs(X[0])
        small = np.where(big > 0, big, np.inf)
        rounded = np.zeros(s.shape, dtype=bool)
        for x in X[1:]:
            s, t = _two_sum_fresh(s, x)
            e, f = _two_sum_fresh(e, t)
            rounded |= f != 0
            ax = np.abs(x)
            big = np.maximum(big, ax)
            small = np.fmin(small, np.where(ax > 0, ax, np.inf))
        r, d = _two_sum_fresh(s, e)
        ok = ~rounded & np.isfinite(r) & (big <= small * c)
        out = r.astype(dtype)
        if dtype == np.float32:  # r rounded once more: wrong only from a float32 midpoint, where d decides
            twice = 2 * r - out
            ok &= ~((r != out) & (twice.astype(np.float32) == twice) & (d != 0))
    out[out == 0] = 0.0  # an exact zero sum is +0.0, as the codec's
    if not ok.all():
        rest = np.flatnonzero(~ok)
        out[rest] = exact_sum([x[rest] for x in xs])
    return out


def _two_sum_fresh(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``fl(a + b)`` and its rounding error (:func:`_two_sum`), in new arrays."""
    s, error, scratch = np.empty_like(a), np.empty_like(a), np.empty_like(a)
    _two_sum(a, b, s, error, scratch, error=error)
    return s, error


def _carry(a: list[np.ndarray]) -> None:
    """Bring limbs 1.. into [0, 2**BITS), carrying (floor) into the limb above."""
    for k in range(len(a) - 1, 0, -1):
        c = a[k] >> BITS
        a[k] = a[k] - (c << BITS)
        a[k - 1] = a[k - 1] + c


def _bit_length(w: np.ndarray) -> np.ndarray:
    """``int.bit_length`` of non-negative int64s below 2**63: frexp of the
    float, corrected where the conversion rounded up to a power of two."""
    e = np.frexp(w.astype(np.float64))[1].astype(np.int64)
    return e - ((w >> np.maximum(e - 1, 0)) == 0) * (e > 0)


def _check(dtype: Any) -> None:
    if not supported(dtype):
        raise ValueError(f"the exact codec sums float32 and float64, not {np.dtype(dtype)}")


# ---- references --------------------------------------------------------------------------------

#: A node of the reference tree of ``deterministic=True`` (:func:`reference_reduce`'s ``order="tree"``):
#: ``(level, index)``. Level -1: rank ``index`` where it is folded into a partner (``c + i`` into
#: ``i``); level 0: ``y_i = x_i + x_{c+i}`` (or ``x_i`` alone when rank ``c + i`` does not exist);
#: level ``l``: the sum of ``y`` over ``[index * 2**l, (index + 1) * 2**l)``.
TreeNode = tuple[int, int]


#: Ops whose result does not depend on the order, in any dtype.
ORDERLESS = ("min", "max", "minimum", "maximum", "fmin", "fmax", "bitwise_and", "bitwise_or", "bitwise_xor",
             "logical_and", "logical_or", "logical_xor", "gcd", "lcm")


def tree_ordered(op_name: str, dtype: Any) -> bool:
    """Whether ``deterministic=True`` changes a reduction with this op on
    this dtype: floating-point (and complex) values and an op whose result
    depends on the order (sum, mean, prod, other ufuncs, callables);
    integers, booleans, min and max are exact in any order."""
    return np.dtype(dtype).kind in "fc" and op_name not in ORDERLESS


def _fold(p: int) -> int:
    """``c``: the largest power of two at most ``p``."""
    return 1 << (p.bit_length() - 1)


def tree_root(p: int) -> TreeNode:
    """The node that sums all ``p`` ranks."""
    return (_fold(p).bit_length() - 1, 0)


def tree_leaf(p: int, rank: int) -> TreeNode:
    """Rank ``rank``'s own value in the reference tree of ``p`` ranks."""
    c = _fold(p)
    return (0, rank) if rank < c and rank + c >= p else (-1, rank)


def _up(p: int, node: TreeNode) -> tuple[TreeNode, TreeNode, bool]:
    """``(sibling, parent, node is the left child)``."""
    level, i = node
    if level < 0:
        c = _fold(p)
        return ((-1, i + c), (0, i), True) if i < c else ((-1, i - c), (0, i - c), False)
    return (level, i ^ 1), (level + 1, i >> 1), i % 2 == 0


def tree_parent(p: int, node: TreeNode) -> TreeNode:
    """The node that adds ``node`` and its sibling."""
    return _up(p, node)[1]


def tree_merge(p: int, parts: dict[TreeNode, Any], add: Callable[[Any, Any], Any]) -> dict[TreeNode, Any]:
    """Partial sums (one per node of the reference tree, covering disjoint
    sets of ranks) merged: two are added, ``add(left, right)``, only when
    they are siblings, into their parent, until no two are. The nodes left
    are the maximal ones covering the same ranks, and each value is the
    reference tree's at that node: the same additions in the same order,
    whatever order and grouping the parts came in."""
    out = dict(parts)
    root = tree_root(p)
    todo = sorted(out)
    while todo:
        node = todo.pop(0)
        if node not in out or node == root:
            continue
        sib, parent, left = _up(p, node)
        if sib in out:
            a, b = (out.pop(node), out.pop(sib)) if left else (out.pop(sib), out.pop(node))
            out[parent] = add(a, b)
            todo.append(parent)
            todo.sort()
    return dict(sorted(out.items()))


def tree_cover(p: int, ranks: Any) -> tuple[TreeNode, ...]:
    """The maximal nodes of the reference tree whose ranks all lie in
    ``ranks`` (and cover them): the partial sums a value summing ``ranks``
    carries under ``deterministic=True``, in a fixed order."""
    return tuple(tree_merge(p, {tree_leaf(p, r): None for r in ranks}, lambda a, b: None))


_UFUNCS = {"sum": np.add, "mean": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


def reference_reduce(arrays: Sequence[Any], op: Any = "sum", order: str = "exact") -> np.ndarray:
    """The documented result of reducing ``arrays`` (one per rank, in rank order).

    ``order="exact"`` (``deterministic="exact"``): float sums are the exact
    sum rounded once to the dtype, element by element (float64:
    :func:`math.fsum`; float32: the exact rational sum rounded half-even
    once); ``"mean"`` is that sum divided by the rank count in the dtype
    (a second rounding; +0.0 where it underflows to zero). Non-finite values follow the module's rule (any
    NaN, or +inf with -inf: NaN). Other dtypes and ops: the tree order
    (their results do not depend on the order).

    ``order="tree"``: the fixed order planned for ``deterministic=True``:
    with ``c`` the largest power of two at most ``p``, rank ``c + i`` is
    first combined into rank ``i`` (``x[i] op x[c+i]``); then neighbours
    pair up level by level, ``(0 op 1) op (2 op 3)``... -- the pairs
    radix-2 butterfly's recursive halving combines first (its extra ranks
    fold into their partners the same way). ``"mean"`` divides the tree sum
    by ``p`` in the dtype (+0.0 where it underflows to zero). Every algorithm follows it
    with ``deterministic=True`` (:func:`tree_merge`).

    Slow (a Python loop per element for ``"exact"``): a reference for tests.
    """
    xs = [np.asarray(a) for a in arrays]
    if not xs:
        raise ValueError("reference_reduce needs at least one array")
    name = op if isinstance(op, str) else getattr(op, "__name__", None)
    ufunc = _UFUNCS.get(name) if isinstance(name, str) else None
    if ufunc is None:
        ufunc = getattr(np, name, None) if isinstance(name, str) else None
    if not isinstance(ufunc, np.ufunc):
        raise ValueError(f"unknown op {op!r}: a name ('sum', 'mean', 'min', ...) or a binary numpy ufunc")
    if order not in ("exact", "tree"):
        raise ValueError(f"order must be 'exact' or 'tree', got {order!r}")
    p = len(xs)
    dtype = xs[0].dtype
    if order == "exact" and name in ("sum", "mean") and supported(dtype):
        flat = np.stack([x.reshape(-1) for x in xs])
        total = np.array([_exact_element(flat[:, i], dtype) for i in range(flat.shape[1])], dtype=dtype)
        total = total.reshape(xs[0].shape)
    else:
        total = _tree(xs, ufunc)
    if name == "mean":
        if dtype.kind in "iub":
            return np.true_divide(total, p)
        return np.asarray(np.add(np.true_divide(total, p), 0, dtype=dtype))  # a mean that underflows to zero is +0.0
    return total


def _tree(xs: list[np.ndarray], ufunc: Callable[..., Any]) -> np.ndarray:
    c = 1 << (len(xs).bit_length() - 1)
    level = [ufunc(xs[i], xs[c + i]) if c + i < len(xs) else xs[i] for i in range(c)]
    while len(level) > 1:
        level = [ufunc(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return np.asarray(level[0])


def _exact_element(values: np.ndarray, dtype: np.dtype) -> Any:
    """One element's exact sum over ranks, rounded once to ``dtype``."""
    nan = np.isnan(values).any() or ((values == np.inf).any() and (values == -np.inf).any())
    if nan:
        return np.nan
    if np.isinf(values).any():
        return values[np.isinf(values)][0]
    exact = sum((Fraction(float(v)) for v in values), Fraction(0))
    if dtype == np.float64:
        try:
            return math.fsum(values.tolist())
        except OverflowError:  # the exact sum rounds to inf (fsum raises instead)
            return math.inf if exact > 0 else -math.inf
    return _round_float32(exact)


def _round_float32(q: Fraction) -> np.float32:
    """``q`` rounded half-even to float32, through float64 rounded to odd
    (53 >= 24 + 2 bits: rounding to odd first, then to float32, rounds once)."""
    t = float(q)  # round-half-even to float64: within float32's range this never overflows
    if Fraction(t) != q:
        if abs(Fraction(t)) > abs(q):  # toward zero, then set the last bit if it is even
            t = float(np.nextafter(t, 0.0))
        if int(np.float64(t).view(np.int64)) & 1 == 0:
            t = float(np.nextafter(t, math.copysign(math.inf, t)))
    with np.errstate(over="ignore"):
        return np.float32(t)
