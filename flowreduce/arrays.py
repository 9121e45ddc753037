"""Arrays of other libraries (torch, and any DLPack / array-API array) in
and out of an all-reduce.

The reduction itself runs on numpy arrays. An input that is not one is
converted on the worker that holds it, by the first task of its rank that
reads it (:mod:`flowreduce.kernels.fusion`), and the rank's result is
converted back by its last task, so nothing but numpy travels between ranks
and the client never sees a tensor. What an input was is an
:class:`ArrayKind` (library, dtype, device type) kept in its
:class:`~flowreduce.pytree.TensorSpec`; ranks must agree on it.

A library plugs in with a :class:`Converter` passed to :func:`register`.
Two are built in:

* ``torch`` (imported only once a tensor shows up). CPU tensors become numpy
  views (``Tensor.numpy()``, no copy) and results become tensors sharing the
  result's memory (``torch.from_numpy``). The dtype mapping is explicit
  (:data:`TORCH_WIRE_DTYPES`): every dtype with a numpy twin maps to it;
  ``bfloat16``, which numpy lacks, is widened to float32 (one copy in, one
  rounding to nearest-even back out): the reduction adds in float32, so a
  sum rounds once instead of once per step, and the wire carries 4 bytes
  per element instead of 2. Tensors on another device (``cuda``) are copied
  to the host first and the result is copied to that device type (the
  worker's current device) at the end.
* ``array-api``: any array with ``__array_namespace__`` and ``__dlpack__``
  (jax, cupy, array-api-strict). A CPU array is read through
  ``np.from_dlpack`` (no copy) and the result is handed back through its
  namespace's ``from_dlpack``; an array on another device is copied to the
  host with ``np.asarray`` first (untested here: no GPU on CI).

Pure: no library is imported here until one of its arrays is seen.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ArrayKind:
    """What a non-numpy input was: its library (a converter's name), its
    dtype in that library's words and its device type."""

    library: str
    dtype: str
    device: str = "cpu"

    def __str__(self) -> str:
        where = "" if self.device == "cpu" else f" on {self.device}"
        return f"{self.library}.{self.dtype}{where}"


@dataclass(frozen=True)
class Converter:
    """How one library's arrays are read as numpy and rebuilt.

    ``claims(x)`` says whether ``x`` is one of its arrays (cheaply, without
    importing anything); ``describe(x)`` gives its shape, the numpy dtype it
    is reduced in and its :class:`ArrayKind` (raising TypeError for an array
    it cannot reduce); ``to_numpy(x)`` and ``from_numpy(a, kind)`` convert
    (without copying where the memory allows)."""

    name: str
    claims: Callable[[Any], bool]
    describe: Callable[[Any], tuple[tuple[int, ...], str, ArrayKind]]
    to_numpy: Callable[[Any], np.ndarray]
    from_numpy: Callable[[np.ndarray, ArrayKind], Any]


_CONVERTERS: dict[str, Converter] = {}


def register(converter: Converter) -> None:
    """Add (or replace) a converter; converters registered later are asked
    first, so a library's own converter can take over from ``array-api``."""
    _CONVERTERS.pop(converter.name, None)
    _CONVERTERS[converter.name] = converter


def unregister(name: str) -> None:
    """Remove the converter called ``name`` (no error if there is none)."""
    _CONVERTERS.pop(name, None)


def converter_of(x: Any) -> Converter | None:
    """The converter of ``x``; None for numpy arrays and scalars, and for
    anything no converter claims."""
    if isinstance(x, (np.ndarray, np.generic)):
        return None
    for c in reversed(_CONVERTERS.values()):
        if c.claims(x):
            return c
    return None


def is_foreign(x: Any) -> bool:
    """``x`` is an array of another library that a converter reads."""
    return converter_of(x) is not None


def describe(x: Any) -> tuple[tuple[int, ...], str, ArrayKind | None]:
    """Shape, numpy dtype (``.str``) of the reduction and kind (None for numpy) of an array.

    Raises
    ------
    TypeError
        ``x`` is not an array, or has a dtype no numpy dtype can reduce.
    """
    c = converter_of(x)
    if c is not None:
        return c.describe(x)
    if isinstance(x, (np.ndarray, np.generic)):
        return tuple(np.shape(x)), x.dtype.str, None
    raise TypeError(f"a {type(x).__name__} is not an array")


def to_numpy(x: Any) -> np.ndarray:
    """``x`` as a numpy array (a view of it when its memory allows)."""
    c = converter_of(x)
    return np.asarray(x) if c is None else c.to_numpy(x)


def from_numpy(a: np.ndarray, kind: ArrayKind | None) -> Any:
    """The array of ``kind`` holding ``a`` (``a`` itself for numpy).

    A result whose dtype is not the kind's reduction dtype (an integer mean
    is a float64) keeps its own dtype in the target library."""
    if kind is None:
        return a
    try:
        c = _CONVERTERS[kind.library.split(":")[0]]
    except KeyError:
        raise TypeError(f"no converter for {kind.library} arrays on this worker; "
                        f"registered: {sorted(_CONVERTERS)}") from None
    return c.from_numpy(a, kind)


# -- torch -------------------------------------------------------------------------------
#: torch dtype name -> numpy dtype the values are reduced (and sent) in.
#: bfloat16 has no numpy twin: it is widened to float32 and rounded back.
TORCH_WIRE_DTYPES = {
    "float16": "float16", "bfloat16": "float32", "float32": "float32", "float64": "float64",
    "complex64": "complex64", "complex128": "complex128", "bool": "bool",
    "uint8": "uint8", "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
    "uint16": "uint16", "uint32": "uint32", "uint64": "uint64",
}


def _torch_claims(x: Any) -> bool:
    torch = sys.modules.get("torch")  # a tensor exists only once torch is imported
    return torch is not None and isinstance(x, torch.Tensor)


def _torch_describe(x: Any) -> tuple[tuple[int, ...], str, ArrayKind]:
    name = str(x.dtype).removeprefix("torch.")
    if x.layout is not sys.modules["torch"].strided:
        raise TypeError(f"torch tensors must be dense (strided), got layout {x.layout}")
    if name not in TORCH_WIRE_DTYPES:
        raise TypeError(f"torch dtype {x.dtype} cannot be reduced; supported: {', '.join(TORCH_WIRE_DTYPES)}")
    return tuple(x.shape), np.dtype(TORCH_WIRE_DTYPES[name]).str, ArrayKind("torch", name, x.device.type)


def _torch_to_numpy(x: Any) -> np.ndarray:
    import torch

    x = x.detach()
    if x.device.type != "cpu":
        x = x.cpu()
    if x.dtype == torch.bfloat16:
        x = x.float()
    return x.resolve_conj().resolve_neg().numpy()  # both no-ops (no copy) unless the tensor carries those bits


def _torch_from_numpy(a: np.ndarray, kind: ArrayKind) -> Any:
    import torch

    a = np.asarray(a)
    if not a.flags.writeable:  # torch has no read-only tensors: own the memory rather than alias it
        a = a.copy()
    t = torch.from_numpy(a)
    if a.dtype == np.dtype(TORCH_WIRE_DTYPES[kind.dtype]):
        t = t.to(getattr(torch, kind.dtype))  # no-op unless the kind was widened (bfloat16)
    return t if kind.device == "cpu" else t.to(kind.device)


# -- any array-API / DLPack array -----------------------------------------------------------
_DLPACK_CPU = 1  # DLDeviceType kDLCPU


def _api_claims(x: Any) -> bool:
    return hasattr(x, "__array_namespace__") and hasattr(x, "__dlpack__")


def _api_describe(x: Any) -> tuple[tuple[int, ...], str, ArrayKind]:
    dev, _ = x.__dlpack_device__()
    a = _api_to_numpy(x)
    device = "cpu" if dev == _DLPACK_CPU else str(getattr(x, "device", dev))
    return tuple(a.shape), a.dtype.str, ArrayKind(f"array-api:{x.__array_namespace__().__name__}", a.dtype.name,
                                                  device)


def _api_to_numpy(x: Any) -> np.ndarray:
    dev, _ = x.__dlpack_device__()
    return np.from_dlpack(x) if dev == _DLPACK_CPU else np.asarray(x)


def _api_from_numpy(a: np.ndarray, kind: ArrayKind) -> Any:
    xp = importlib.import_module(kind.library.removeprefix("array-api:"))
    return xp.from_dlpack(np.ascontiguousarray(a)) if kind.device == "cpu" else xp.asarray(a)


register(Converter("array-api", _api_claims, _api_describe, _api_to_numpy, _api_from_numpy))
register(Converter("torch", _torch_claims, _torch_describe, _torch_to_numpy, _torch_from_numpy))
