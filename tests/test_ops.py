"""``Op.fold``: the n-ary combine the shared-memory kernels sum with, one
cache-sized block at a time, gives the bits of combining one part at a
time (what every other kernel does), in the op's accumulating dtype."""

from __future__ import annotations

import numpy as np
import pytest

from flowreduce import ops
from flowreduce.ops import resolve_op


def sequential(op, parts, dtype):
    acc = np.asarray(parts[0]).astype(dtype, copy=True)
    for x in parts[1:]:
        acc = op.combine(acc, x, out=acc)
    return acc


@pytest.mark.parametrize("n", [0, 1, 7, ops.FOLD_BLOCK_BYTES // 8 - 1, ops.FOLD_BLOCK_BYTES // 8 * 3 + 5])
@pytest.mark.parametrize("name,dtype", [("sum", "float64"), ("sum", "float32"), ("prod", "float64"),
                                        ("max", "int16"), ("mean", "int32"), ("sum", "bool"),
                                        ("logaddexp", "float64")])
def test_fold_gives_the_bits_of_one_part_at_a_time(n, name, dtype):
    op = resolve_op(name)
    rng = np.random.default_rng(n)
    if dtype == "bool":
        parts = [rng.integers(0, 2, n).astype(bool) for _ in range(5)]
    elif np.dtype(dtype).kind == "i":
        parts = [rng.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, n, dtype=dtype) for _ in range(5)]
    else:
        parts = [rng.standard_normal(n).astype(dtype) for _ in range(5)]
    acc = op.accumulator(np.dtype(dtype)) or np.dtype(dtype)
    out = op.fold(parts, np.empty(n, acc))
    expected = sequential(op, parts, acc)
    assert out.dtype == expected.dtype
    np.testing.assert_array_equal(out.view(np.uint8), expected.view(np.uint8))  # bit for bit


def test_fold_into_its_first_part_and_any_shape():
    parts = [np.arange(24.0).reshape(4, 6) * (k + 1) for k in range(3)]
    expected = sum(parts)
    own = parts[0].copy()
    got = resolve_op("sum").fold([own, *parts[1:]], own)
    assert got is own
    np.testing.assert_array_equal(own, expected)


def test_fold_needs_a_ufunc():
    with pytest.raises(TypeError, match="ufunc"):
        resolve_op(lambda a, b: a + b).fold([np.ones(3)], np.empty(3))


def test_fold_refuses_an_output_it_would_not_write_through():
    out = np.zeros((4, 5))[:, :4]  # not contiguous: a flat view of it would be a copy
    with pytest.raises(ValueError, match="contiguous"):
        resolve_op("sum").fold([np.ones((4, 4))], out)
