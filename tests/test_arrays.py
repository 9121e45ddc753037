"""Array conversion (flowreduce.arrays) and pytrees as users hold them, in
process: every torch dtype to numpy and back (zero-copy where the memory
allows), bfloat16 widened and rounded back, OrderedDict / dataclass /
namedtuple structures round-tripped, templates from tensors and
parameters, and a core that never imports torch."""

from __future__ import annotations

import collections
import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from flowreduce import arrays
from flowreduce.pytree import TensorSpec, flatten, leaves_as, paths, same_structure, spec_of, unflatten

torch = pytest.importorskip("torch", reason="torch tests need the extra: pip install -e '.[torch]'")

TORCH_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
                torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint16,
                torch.uint32, torch.uint64]


def _tensor(dtype, shape=(3, 4)):
    return torch.arange(int(np.prod(shape)), dtype=torch.float64).reshape(shape).remainder(7).to(dtype)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_round_trip_keeps_dtype_shape_and_values(dtype):
    t = _tensor(dtype)
    shape, wire, kind = arrays.describe(t)
    a = arrays.to_numpy(t)
    assert shape == (3, 4) and a.shape == (3, 4) and a.dtype.str == wire
    assert kind == arrays.ArrayKind("torch", str(dtype).removeprefix("torch."), "cpu")
    back = arrays.from_numpy(a, kind)
    assert isinstance(back, torch.Tensor) and back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


@pytest.mark.parametrize("dtype", [d for d in TORCH_DTYPES if d != torch.bfloat16], ids=str)
def test_dtypes_with_a_numpy_twin_convert_without_copying(dtype):
    t = _tensor(dtype)
    a = arrays.to_numpy(t)
    assert a.ctypes.data == t.data_ptr()  # a view of the tensor's memory
    back = arrays.from_numpy(a, arrays.describe(t)[2])
    assert back.data_ptr() == a.ctypes.data


def test_bfloat16_is_reduced_in_float32_and_rounded_to_nearest_even():
    t = torch.tensor([1.0, 3.0], dtype=torch.bfloat16)
    assert arrays.describe(t)[1] == np.dtype("float32").str
    kind = arrays.describe(t)[2]
    # 1 + 2**-8 lies halfway between two bfloat16 values (8 bits of mantissa): ties go to the even one, 1.0
    half_ulp = np.array([1 + 2.0**-8, 1 + 3 * 2.0**-8], dtype=np.float32)
    got = arrays.from_numpy(half_ulp, kind)
    assert got.dtype == torch.bfloat16
    assert got.tolist() == torch.from_numpy(half_ulp).to(torch.bfloat16).tolist() == [1.0, 1.015625]


def test_a_result_of_another_dtype_keeps_it():
    """An integer mean is a float64 (as numpy's): not truncated back to int."""
    kind = arrays.describe(torch.ones(2, dtype=torch.int32))[2]
    got = arrays.from_numpy(np.array([0.5, 1.5]), kind)
    assert got.dtype == torch.float64 and got.tolist() == [0.5, 1.5]


def test_tensors_that_need_grad_are_read_through_detach_and_read_only_results_copied():
    p = torch.nn.Parameter(torch.ones(2, 2))
    a = arrays.to_numpy(p)
    assert a.ctypes.data == p.data_ptr()
    ro = np.arange(4.0, dtype=np.float32)
    ro.flags.writeable = False
    back = arrays.from_numpy(ro, arrays.describe(p)[2])
    assert back.data_ptr() != ro.ctypes.data and back.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("bad,match", [
    (lambda: torch.zeros(2, dtype=torch.float8_e4m3fn), "float8_e4m3fn cannot be reduced"),
    (lambda: torch.zeros(2, 2).to_sparse(), "dense"),
], ids=["float8", "sparse"])
def test_tensors_that_cannot_be_reduced_are_named(bad, match):
    with pytest.raises(TypeError, match=match):
        arrays.describe(bad())


def test_numpy_is_never_converted():
    a = np.ones(3)
    assert arrays.converter_of(a) is None and arrays.to_numpy(a) is a and arrays.from_numpy(a, None) is a
    assert arrays.describe(np.float32(2)) == ((), "<f4", None)


def test_a_library_plugs_in_with_a_converter():
    """The registry is the one place that knows libraries: a new one is a Converter."""

    class Boxed:
        def __init__(self, a):
            self.a = a

    conv = arrays.Converter(
        "boxed", lambda x: isinstance(x, Boxed),
        lambda x: (x.a.shape, x.a.dtype.str, arrays.ArrayKind("boxed", x.a.dtype.name)),
        lambda x: x.a, lambda a, kind: Boxed(a))
    arrays.register(conv)
    try:
        b = Boxed(np.arange(3))
        assert arrays.is_foreign(b) and spec_of(b).native == arrays.ArrayKind("boxed", "int64")
        assert isinstance(arrays.from_numpy(arrays.to_numpy(b), spec_of(b).native), Boxed)
    finally:
        arrays.unregister("boxed")


def test_an_array_api_library_plugs_in_through_dlpack():
    """Any array with ``__array_namespace__`` and ``__dlpack__`` (cupy, jax;
    array-api-strict here) is read without a copy and rebuilt in its library."""
    xp = pytest.importorskip("array_api_strict", reason="in the test extra: pip install -e '.[test]'")
    a = xp.asarray([[1.0, 2.0], [3.0, 4.0]], dtype=xp.float32)
    shape, wire, kind = arrays.describe(a)
    assert (shape, wire) == ((2, 2), "<f4") and kind.library == "array-api:array_api_strict"
    n = arrays.to_numpy(a)
    assert isinstance(n, np.ndarray) and n.tolist() == [[1, 2], [3, 4]]
    back = arrays.from_numpy(n * 2, kind)
    assert type(back) is type(a) and back.dtype == xp.float32 and np.from_dlpack(back).tolist() == [[2, 4], [6, 8]]


def test_an_array_api_allreduce_comes_back_in_its_library(inproc_client):
    xp = pytest.importorskip("array_api_strict", reason="in the test extra: pip install -e '.[test]'")
    import flowreduce

    ws = sorted(inproc_client.nthreads())
    parts = [inproc_client.submit(_api_array, r, workers=[ws[r]], pure=False) for r in range(3)]
    got = inproc_client.gather(flowreduce.allreduce(inproc_client, parts, op="sum", algorithm="ring"))
    for g in got:
        assert type(g) is type(xp.asarray(0)) and np.from_dlpack(g).tolist() == [3.0, 6.0, 9.0]


def _api_array(r):
    import array_api_strict as xp

    return xp.asarray([1.0, 2.0, 3.0], dtype=xp.float64) * (r + 1) / 2


# -- pytrees as users hold them -------------------------------------------------------------------
Pair = collections.namedtuple("Pair", "w b")


@dataclasses.dataclass
class Grads:
    w: object
    b: object = None
    seen: int = dataclasses.field(default=0, init=False)  # derived: not part of the structure


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: object


@pytest.mark.parametrize("tree", [
    collections.OrderedDict([("z", 1), ("a", [2, 3])]),
    {"z": 1, "a": (2, 3)},
    [1, (2, {"k": 3})],
    Pair(1, collections.OrderedDict(b=2)),
    Grads(1, [2, 3]),
    Frozen(Grads(1, 2)),
], ids=["ordereddict", "dict", "list", "namedtuple", "dataclass", "frozen-dataclass"])
def test_structures_come_back_as_the_same_types_in_the_same_order(tree):
    leaves, treedef = flatten(tree)
    back = unflatten(treedef, [x * 10 for x in leaves])
    assert type(back) is type(tree)
    assert flatten(back)[1] == treedef and flatten(back)[0] == [x * 10 for x in leaves]
    assert len(paths(treedef)) == len(leaves)


def test_ordereddict_keeps_its_order_and_type_and_dataclass_fields_read_by_name():
    tree = collections.OrderedDict([("b", 1), ("a", Grads(2, 3))])
    leaves, treedef = flatten(tree)
    assert leaves == [1, 2, 3] and paths(treedef) == ["['b']", "['a'].w", "['a'].b"]
    back = unflatten(treedef, leaves)
    assert list(back) == ["b", "a"] and isinstance(back, collections.OrderedDict)
    assert same_structure(treedef, flatten(collections.OrderedDict([("a", Grads(2, 3)), ("b", 1)]))[1])
    assert not same_structure(treedef, flatten({"b": 1, "a": Grads(2, 3)})[1])  # the type is structure
    with pytest.raises(ValueError, match=r"expected a Grads at \['a'\]"):
        leaves_as({"a": Pair(2, 3), "b": 1}, treedef)


def test_a_tensor_spec_is_a_leaf_not_a_dataclass_node():
    s = TensorSpec((2,), "<f4")
    assert flatten({"w": s})[0] == [s]


def test_template_leaves_may_be_tensors_and_parameters():
    like = collections.OrderedDict(w=torch.nn.Parameter(torch.ones(2, 3)), h=torch.zeros(4, dtype=torch.bfloat16))
    specs = [spec_of(x) for x in flatten(like)[0]]
    assert specs == [TensorSpec((2, 3), "<f4", arrays.ArrayKind("torch", "float32")),
                     TensorSpec((4,), "<f4", arrays.ArrayKind("torch", "bfloat16"))]
    assert str(specs[1]) == "shape (4,), dtype torch.bfloat16"


def test_the_core_never_imports_torch():
    code = ("import sys, numpy as np, flowreduce, flowreduce.arrays, flowreduce.pytree, flowreduce.fusion, "
            "flowreduce.schedule.call, flowreduce.kernels.fusion as k\n"
            "assert not flowreduce.arrays.is_foreign(np.ones(2))\n"
            "assert k.unpack(flowreduce.pytree.LEAF, [np.ones(2)], ((0, 0, 2, (2,), None),)).shape == (2,)\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
