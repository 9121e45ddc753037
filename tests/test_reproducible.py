"""The exact codec of ``deterministic="exact"`` (flowreduce.reproducible), in
one process: against math.fsum (float64) and exact rationals (float32),
over any permutation and grouping of the ranks' limbs."""

from __future__ import annotations

import math
import warnings
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flowreduce import reproducible as rp

RANKS = [1, 2, 3, 5, 8, 16]


def fsum(values: list[float]) -> float:
    """math.fsum; where an intermediate sum overflows (fsum raises), the exact
    sum rounded once (Python's int division rounds correctly), inf past the
    largest float (1e308 + 1e308 - 1e308 is 1e308, 1e308 + 1e308 is inf)."""
    try:
        return math.fsum(values)
    except OverflowError:
        exact = sum(map(Fraction, values), Fraction(0))
        try:
            return float(exact)
        except OverflowError:
            return math.inf if exact > 0 else -math.inf


def fsum64(xs: list[np.ndarray]) -> np.ndarray:
    """math.fsum over the ranks, element by element (finite values)."""
    return np.array([fsum(list(v)) for v in zip(*(x.reshape(-1).tolist() for x in xs))],
                    dtype=np.float64).reshape(xs[0].shape)


def is_rounded32(got: np.float32, exact: Fraction) -> bool:
    """Whether ``got`` is ``exact`` rounded half-even to float32: no float32
    neighbour is closer, and at a tie ``got``'s significand is even; past
    the largest float32 by half its ulp or more (a tie goes to the even
    2**128), +-inf, as IEEE 754 rounds to nearest (and numpy adds)."""
    overflows = abs(exact) >= Fraction(2) ** 128 - Fraction(2) ** 103
    if overflows or not np.isfinite(got):
        return bool(overflows and np.isinf(got) and (got > 0) == (exact > 0))
    here = abs(Fraction(float(got)) - exact)
    with np.errstate(over="ignore"):
        neighbours = (np.nextafter(got, np.float32(np.inf)), np.nextafter(got, np.float32(-np.inf)))
    for n in neighbours:
        if not np.isfinite(n):
            continue
        there = abs(Fraction(float(n)) - exact)
        if there < here or (there == here and int(np.float32(got).view(np.int32)) & 1):
            return False
    return True


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def codec_sum(xs: list[np.ndarray], groups: list[list[int]] | None = None) -> np.ndarray:
    """The ranks' sum through the codec; ``groups``: sum the limbs per
    group first, then the groups' sums (the grouping an all-reduce makes)."""
    E = np.max([rp.exponents(x) for x in xs], axis=0)
    limbs = [rp.encode(x, E) for x in xs]
    groups = groups or [list(range(len(xs)))]
    parts = [np.sum([limbs[i] for i in g], axis=0, dtype=np.int64) for g in groups]
    return rp.decode(np.sum(parts, axis=0, dtype=np.int64), E, xs[0].dtype)


# floats over 16+ orders of magnitude, either sign, with subnormals and cancellation partners
magnitudes = st.floats(min_value=-20, max_value=20).map(lambda e: 10.0 ** e)
wide = st.one_of(
    st.builds(lambda m, s: s * m, magnitudes, st.sampled_from([-1.0, 1.0])),
    st.sampled_from([0.0, -0.0, 1e16, -1e16, 1.0, -1.0, 5e-324, -5e-324, 2.2e-308, 1e308, -1e308]),
    st.floats(allow_nan=False, allow_infinity=False),
)


@st.composite
def ranks_of(draw, dtype, size_max=8):
    p = draw(st.sampled_from(RANKS))
    size = draw(st.integers(0, size_max))
    with np.errstate(over="ignore"):
        xs = [np.array(draw(st.lists(wide, min_size=size, max_size=size)), dtype=np.float64).astype(dtype)
              for _ in range(p)]
    xs = [np.where(np.isfinite(x), x, 0).astype(dtype) for x in xs]  # float32 overflow of a float64 draw
    order = draw(st.permutations(range(p)))
    cuts = sorted(draw(st.sets(st.integers(1, max(p - 1, 1)), max_size=p)) if p > 1 else [])
    bounds = [0, *[c for c in cuts if c < p], p]
    groups = [list(order[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a]
    return xs, order, groups


def within_window(xs: list[np.ndarray]) -> np.ndarray:
    """Elements whose every nonzero value lies inside the exact window below the largest."""
    k = rp.LIMBS[xs[0].dtype] * rp.BITS - {np.float64: 53, np.float32: 24}[xs[0].dtype.type]
    e = np.stack([rp.exponents(x).astype(int) for x in xs])
    nonzero = e != rp.ZERO
    top = e.max(axis=0)
    return np.all(~nonzero | (e >= top - k), axis=0)


@settings(max_examples=300, deadline=None)
@given(ranks_of(np.float64))
def test_float64_is_fsum_in_any_order_and_grouping(case):
    xs, order, groups = case
    ok = within_window(xs)
    want = fsum64(xs)
    got = codec_sum(xs)
    assert np.array_equal(got[ok], want[ok])
    with np.errstate(over="ignore"):
        assert np.array_equal(got.view(np.int64), codec_sum([xs[i] for i in order], groups).view(np.int64))


@settings(max_examples=300, deadline=None)
@given(ranks_of(np.float32))
def test_float32_is_the_exact_sum_rounded_once(case):
    xs, order, groups = case
    ok = within_window(xs)
    got = codec_sum(xs)
    for i in np.flatnonzero(ok.reshape(-1)):
        exact = sum((Fraction(float(x.reshape(-1)[i])) for x in xs), Fraction(0))
        assert is_rounded32(got.reshape(-1)[i], exact), (i, [x.reshape(-1)[i] for x in xs], got.reshape(-1)[i])
    assert same_bits(got, codec_sum([xs[i] for i in order], groups))


@pytest.mark.parametrize("p", RANKS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_sixteen_orders_and_cancellation(p, dtype):
    rng = np.random.default_rng(p)
    xs = [(rng.standard_normal(64) * 10.0 ** rng.integers(-8, 9, 64)).astype(dtype) for _ in range(p)]
    for r in range(p):  # 1e16 + 1 - 1e16 (+ 1e16 + 1 ...) across the ranks
        xs[r][:2] = [1e16, 1.0, -1e16][r % 3], [1.0, -1e16, 1e16][r % 3]
    got = codec_sum(xs)
    assert same_bits(got, rp.reference_reduce(xs, "sum"))
    if dtype == np.float64:
        assert np.array_equal(got, fsum64(xs))
        if p == 3:
            assert got[:2].tolist() == [1.0, 1.0]


def test_reference_float32_is_rounded_once():
    # 1 + 2**-24 + 2**-60: float64 rounding first gives a tie at float32, which half-even rounds down
    xs = [np.array([1.0], np.float32), np.array([2.0 ** -24], np.float32), np.array([2.0 ** -60], np.float32)]
    assert np.float32(np.float64(1.0) + 2.0 ** -24 + 2.0 ** -60) == np.float32(1.0)  # the double rounding
    want = np.nextafter(np.float32(1.0), np.float32(2.0))
    assert rp.reference_reduce(xs, "sum")[0] == want
    assert codec_sum(xs)[0] == want


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_subnormals_are_exact(dtype):
    tiny = np.finfo(dtype).smallest_subnormal
    xs = [np.array([tiny, -tiny, 3 * tiny, np.finfo(dtype).smallest_normal], dtype) for _ in range(5)]
    got = codec_sum(xs)
    assert np.array_equal(got, np.array([5 * tiny, -5 * tiny, 15 * tiny, 5 * np.finfo(dtype).smallest_normal],
                                        dtype))


def test_ties_round_half_even():
    # 2**53 + 1 and 2**53 + 3 are ties between float64 neighbours: half-even picks 2**53 and 2**53 + 4
    big = 2.0 ** 53
    for low, want in [(1.0, big), (3.0, big + 4), (-1.0, big - 1), (-3.0, big - 3), (1.0 + 2.0 ** -40, big + 2)]:
        xs = [np.array([big]), np.array([low])]
        assert codec_sum(xs)[0] == want == math.fsum([big, low])


def test_signed_zeros_sum_to_positive_zero():
    xs = [np.array([-0.0, -0.0, 1.0]), np.array([-0.0, 0.0, -1.0])]
    got = codec_sum(xs)
    assert np.array_equal(np.signbit(got), [False, False, False]) and np.all(got == 0)
    assert [math.copysign(1, math.fsum(v)) for v in zip(*(x.tolist() for x in xs))] == [1, 1, 1]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_inf_and_nan(dtype):
    inf, nan = np.inf, np.nan
    cols = [([inf, 1.0], inf), ([-inf, 1.0], -inf), ([inf, inf], inf), ([inf, -inf], nan), ([nan, 1.0], nan),
            ([nan, inf], nan), ([1e308, 1e308], inf if dtype == np.float64 else 2e308)]
    with np.errstate(over="ignore"):
        xs = [np.array([c[0][r] for c in cols], dtype) for r in range(2)]
        want = np.array([c[1] for c in cols], dtype)
    got = codec_sum(xs)
    assert np.array_equal(got, want, equal_nan=True)
    assert np.array_equal(rp.reference_reduce(xs, "sum"), want, equal_nan=True)


def test_overflowing_finite_sum_rounds_to_inf():
    big = np.finfo(np.float64).max
    assert codec_sum([np.array([big, -big]), np.array([big, -big])]).tolist() == [math.inf, -math.inf]
    assert rp.reference_reduce([np.array([big]), np.array([big])], "sum")[0] == math.inf


def test_values_below_the_window_are_truncated_toward_zero():
    # the window of float64 is 3 * 52 bits below 2**E (E = 1 for 1.0): 2**-155 is its last bit
    for tiny, kept in [(2.0 ** -155, 2.0 ** -155), (2.0 ** -156, 0.0), (3 * 2.0 ** -156, 2.0 ** -155)]:
        for sign in (1, -1):
            limbs = rp.encode(np.array([sign * (1.0 + 0 * tiny), sign * tiny]), np.array([1, 1]))
            assert rp.decode(limbs[:, 1:], np.array([1]), np.float64)[0] == sign * kept
    # 1 + 2**-156 - 1: lost below 1.0's window, 0 where fsum gives 2**-156
    assert codec_sum([np.array([1.0]), np.array([2.0 ** -156]), np.array([-1.0])])[0] == 0.0


@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (2, 3)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_shapes(shape, dtype):
    xs = [np.full(shape, 0.1 * (r + 1), dtype) for r in range(3)]
    got = codec_sum(xs)
    assert got.shape == shape and got.dtype == dtype
    assert same_bits(got, rp.reference_reduce(xs, "sum"))
    assert rp.encode(xs[0], rp.exponents(xs[0])).shape == (rp.LIMBS[np.dtype(dtype)], *shape)
    assert rp.exponents(xs[0]).dtype == rp.EXPONENT_DTYPE


def test_the_most_ranks_fit_the_headroom():
    # MAX_RANKS copies of the largest limbs: the int64 sum must not wrap
    x = np.array([np.nextafter(2.0, 0), -np.nextafter(2.0, 0), 1.0 - 2.0 ** -53])
    E = rp.exponents(x)
    total = rp.encode(x, E) * rp.MAX_RANKS
    assert np.array_equal(rp.decode(total, E, np.float64), x * rp.MAX_RANKS)


def test_mean_reference_divides_the_rounded_sum():
    xs = [np.array([0.1, 1e16], np.float64), np.array([0.2, 1.0], np.float64), np.array([0.3, -1e16])]
    want = np.array([math.fsum([0.1, 0.2, 0.3]), 1.0]) / 3
    assert same_bits(rp.reference_reduce(xs, "mean"), want)


@pytest.mark.parametrize("p", [1, 2, 3, 5, 6, 8])
def test_tree_order_is_the_butterflys_pairing(p):
    # symbols instead of numbers: the tree's shape, written out
    xs = [np.array([f"r{r}"], dtype=object) for r in range(p)]
    got = rp.reference_reduce(xs, np.add, order="tree")[0]
    want = {1: "r0", 2: "r0r1", 3: "r0r2r1", 5: "r0r4r1r2r3", 6: "r0r4r1r5r2r3", 8: "r0r1r2r3r4r5r6r7"}[p]
    assert got == want


def test_tree_order_is_not_the_exact_one():
    xs = [np.array([1e16]), np.array([1.0]), np.array([-1e16]), np.array([1.0])]
    assert rp.reference_reduce(xs, "sum", order="tree")[0] == (1e16 + 1.0) + (-1e16 + 1.0)
    assert rp.reference_reduce(xs, "sum")[0] == 2.0


def test_integers_and_min_max_are_passed_to_the_tree():
    xs = [np.array([3, -1]), np.array([5, 7])]
    assert rp.reference_reduce(xs, "sum").tolist() == [8, 6]
    assert rp.reference_reduce(xs, "max").tolist() == [5, 7]


def test_codec_refuses_other_dtypes():
    with pytest.raises(ValueError, match="float32 and float64"):
        rp.encode(np.arange(3), np.zeros(3))
    with pytest.raises(ValueError, match="unknown op"):
        rp.reference_reduce([np.zeros(1)], "nope")


def test_overflow_edges_round_as_ieee():
    # a float32 sum exactly half an ulp past the largest float32 ties to the even 2**128: inf, as numpy adds
    xs32 = [np.array([1.7014117e38], dtype=np.float32), np.array([1.7014118e38], dtype=np.float32)]
    with np.errstate(over="ignore"):
        assert codec_sum(xs32)[0] == xs32[0][0] + xs32[1][0] == np.inf
    # an intermediate overflow that the exact sum does not have (math.fsum raises on it)
    xs64 = [np.array([1e308]), np.array([1e308]), np.array([-1e308])]
    assert codec_sum(xs64)[0] == 1e308 and codec_sum(xs64[:2])[0] == np.inf


# ---- exact_fold: the codec's bits from the gathered values, in float passes -------------------

def fold(xs: list[np.ndarray]) -> np.ndarray:
    out = np.empty_like(xs[0])
    return rp.exact_fold(xs, out)


@settings(max_examples=300, deadline=None)
@given(ranks_of(np.float64, size_max=40))
def test_exact_fold_is_the_codecs_bits_float64(case):
    xs, _, _ = case
    assert same_bits(fold(xs), codec_sum(xs))


@settings(max_examples=300, deadline=None)
@given(ranks_of(np.float32, size_max=40))
def test_exact_fold_is_the_codecs_bits_float32(case):
    xs, _, _ = case
    assert same_bits(fold(xs), codec_sum(xs))


def hard_cases(p: int, dtype, size: int = 20_000, seed: int = 0) -> dict[str, list[np.ndarray]]:
    """Blocks of values where a float sum's rounding is hardest to certify."""
    rng = np.random.default_rng(seed + p)
    half = np.finfo(dtype).eps / 2
    one = [np.ones(size, dtype)] + [np.zeros(size, dtype)] * (p - 1)
    scale = dtype(2.0) ** rng.integers(-20, 20, size).astype(dtype)
    nudged = [np.full(size, 1 + 2 * half, dtype) if r == 0 else np.full(size, half, dtype) if r == 1 else
              (-half * dtype(2.0) ** -rng.integers(1, 81, size)).astype(dtype) if r == 2 else np.zeros(size, dtype)
              for r in range(p)]
    with np.errstate(over="ignore"):
        return {
            "normal": [rng.standard_normal(size).astype(dtype) for _ in range(p)],
            # 1 + half an ulp, spread over the ranks: exact ties, rounded half to even
            "ties": [np.where(np.arange(size) % 2, 1, 3).astype(dtype) if r == 0 else
                     (half * rng.integers(0, 2, size)).astype(dtype) if r == 1 else np.zeros(size, dtype)
                     for r in range(p)],
            # just below a midpoint: 1 + an odd ulp, half an ulp, minus a tiny nudge that a float64 sum of
            # float32 values loses when the nudge is 2**-29 of the half ulp or smaller (then rounded twice)
            "nudged midpoints": [np.full(size, 1 + 2 * half, dtype) if r == 0 else np.full(size, half, dtype)
                                 if r == 1 else (-half * dtype(2.0) ** -rng.integers(1, 31, size)).astype(dtype)
                                 if r == 2 else np.zeros(size, dtype) for r in range(p)],
            # ordinary values first, then midpoints nudged by as little as 2**-80 of the half ulp: a block
            # is only as narrow as all of it (a float sum of the nudged ones is rounded twice)
            "narrow, then nudged": [np.where(np.arange(size) < 100, rng.standard_normal(size).astype(dtype),
                                             nudged[r]) for r in range(p)],
            # a power of two minus a quarter ulp and a little more: the nearer neighbour is the one below,
            # and a float sum of the errors loses the "little more" (certify toward zero, not away)
            "below a power of two": [(scale * [1, -half / 2, -half / 2 * dtype(2.0) ** -54][r]).astype(dtype)
                                     if r < 3 else np.zeros(size, dtype) for r in range(p)],
            "small integers": [rng.integers(-3, 4, size).astype(dtype) * dtype(2.0) ** rng.integers(-60, 60, size)
                               .astype(dtype) for _ in range(p)],
            "cancelling": [(rng.standard_normal(size) * (-1) ** r + (rng.standard_normal(size) * 1e-9 if r == 1
                                                                      else 0)).astype(dtype) for r in range(p)],
            "wide exponents": [(rng.standard_normal(size) * 10.0 ** rng.integers(-300 if dtype == np.float64 else -40,
                                                                                   300 if dtype == np.float64 else 38,
                                                                                   size)).astype(dtype)
                               for _ in range(p)],
            "specials": [rng.choice(np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e308, -1e308, 3e38, -3e38,
                                              5e-324, 1e-45, 1.0, -1.0, 2.0 ** -24, 2.0 ** -53]), size).astype(dtype)
                         for _ in range(p)],
            "one and zeros": one,
        }


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 7, 16])
def test_exact_fold_on_hard_cases(p, dtype):
    for name, xs in hard_cases(p, dtype).items():
        with np.errstate(all="ignore"):
            want = codec_sum(xs)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # inf and NaN are values here, not numpy's warnings for the user
            got = fold(xs)
        assert same_bits(got, want), (name, np.flatnonzero(got.view(np.uint8) != want.view(np.uint8))[:5])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_exact_fold_into_one_of_its_inputs(dtype):
    # the shared-memory lowering folds into the rank's own slice, which is one of the values
    for xs in hard_cases(4, dtype, seed=7).values():
        with np.errstate(all="ignore"):
            want = codec_sum(xs)
            mine = [x.copy() for x in xs]
            rp.exact_fold(mine, mine[2])
        assert same_bits(mine[2], want)


def test_exact_fold_certifies_ordinary_values_without_the_codec(monkeypatch):
    # the float path must carry the common case; the codec is for what it cannot certify
    seen = []
    codec = rp.exact_sum
    monkeypatch.setattr(rp, "exact_sum", lambda xs: seen.append(xs[0].size) or codec(xs))
    xs = hard_cases(4, np.float64)["normal"]
    assert same_bits(fold(xs), codec_sum(xs))
    assert sum(seen) < xs[0].size // 1000
