"""What every adapter shares: layer selection and array arithmetic without importing a framework.

Adapters receive the engine's own arrays (torch, CuPy or numpy) and must derive new arrays on the
same device without a host round trip. The helpers here dispatch on the array's module, looked up
in ``sys.modules`` (a framework that is not already imported cannot have produced the array), so
importing kvcanary never imports torch or CuPy.
"""

from __future__ import annotations

import sys
import warnings
from collections import OrderedDict
from typing import Sequence

import numpy as np

from .. import abi
from ..config import CanaryConfig
from ..errors import ValidationError, ValidationTypeError
from ..interop.arrays import as_view
from ..ops.sources import resolved
from ..validate import fail, integer, is_int

_LAYERS = "None, 'first', 'all', an int or a list of ints"


def check_layers(layers):
    """``layers`` normalised without a layer count: None, "first", "all" or a list of ints
    (their range is :func:`select_layers`' to check)."""
    if layers is None or (isinstance(layers, str) and layers.lower() == "first"):
        return None
    if isinstance(layers, str):
        if layers.lower() == "all":
            return "all"
        fail("layers", _LAYERS, layers, "pass layers='first' (the default), 'all' or e.g. layers=[0, 3]")
    if is_int(layers):
        return [int(layers)]
    if isinstance(layers, (bytes, dict, set)) or not hasattr(layers, "__iter__"):
        fail("layers", _LAYERS, layers, "pass e.g. layers=[0, 3]", kind=ValidationTypeError)
    picked = list(layers)
    if not all(is_int(i) for i in picked):
        fail("layers", "a list of int layer indices", picked, "pass e.g. layers=[0, 3]", kind=ValidationTypeError)
    return [int(i) for i in picked]


def select_layers(num_layers: int, layers=None, *, sources_per_layer: int = 1, what: str = "pool") -> list[int]:
    """Indices of the layers to fingerprint: ``None``/``"first"`` -> ``[0]``; ``"all"`` -> every layer,
    truncated (with a warning) so that ``len * sources_per_layer <= MAX_REAL_KV_SOURCES``; an int or
    a sequence of ints -> those layers (checked, order kept, no duplicates)."""
    cap = abi.MAX_REAL_KV_SOURCES // max(1, sources_per_layer)
    num_layers = integer(f"the {what}'s number of layers", num_layers, lo=1,
                         fix=f"pass a {what} with at least one layer")
    spec = check_layers(layers)
    if spec is None:
        return [0]
    if spec == "all":
        if num_layers > cap:
            warnings.warn(f"kv-canary: fingerprinting the first {cap} of {num_layers} layers of the {what}: "
                          f"the CUDA ABI takes at most {abi.MAX_REAL_KV_SOURCES} sources "
                          f"({sources_per_layer} per layer); pass a list to choose others", RuntimeWarning,
                          stacklevel=3)
        return list(range(min(num_layers, cap)))
    bad = [i for i in spec if not 0 <= i < num_layers]
    if bad or len(set(spec)) != len(spec) or not spec:
        raise ValidationError(f"kv-canary: layers must be distinct indices in [0, {num_layers}) of the "
                              f"{what}, got {spec}. Fix: pass e.g. layers=[0] or layers='all'")
    if len(spec) > cap:
        raise ValidationError(f"kv-canary: {len(spec)} layers x {sources_per_layer} source(s) exceed the "
                              f"{abi.MAX_REAL_KV_SOURCES} real-KV sources of the CUDA ABI, got {len(spec)} layers; "
                              f"fix: pass at most {cap} layers")
    return spec


def canary_kwargs(kwargs: dict, where: str, taken: tuple[str, ...] = ("device",)) -> dict:
    """``kwargs`` if every name is a :class:`~kvcanary.KvCanary` keyword argument that ``where``
    does not set itself (``taken``)."""
    known = set(CanaryConfig.names()) - set(taken)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValidationTypeError(f"kv-canary: {where} passes keyword arguments to KvCanary, got unknown "
                                  f"{unknown}. Fix: use KvCanary's names: {', '.join(sorted(known))}")
    return kwargs


_MISSING = object()


def require_attr(obj, name: str, what: str, fix: str):
    """``obj.name``, or a :class:`ValidationError` naming the attribute that is missing: the engine
    object is not of the layout this adapter was written against (errors say what was expected, what was got and the fix)."""
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        public = sorted(a for a in dir(obj) if not a.startswith("__"))[:24]
        raise ValidationError(f"kv-canary: expected {what} ({type(obj).__name__}) to have attribute {name!r}, "
                              f"got an object without it (attributes: {public}); fix: {fix}")
    return value


def layer_list(buffers, what: str) -> list:
    """A per-layer list from a list/tuple of arrays or one stacked ``[layers, ...]`` array."""
    if buffers is None:
        raise ValidationError(f"kv-canary: {what} must be a per-layer list of arrays, got None. Fix: pass the "
                              f"pool object the engine allocated (its buffers are set at init)")
    if isinstance(buffers, (list, tuple)):
        return list(buffers)
    try:
        layers = int(buffers.shape[0])
    except Exception:  # noqa: BLE001 - no shape, or a 0-d array: not a stack of layers
        fail(what, "a list of per-layer arrays or one stacked [layers, ...] array", buffers,
             "pass the engine's own buffers", kind=ValidationTypeError)
    return [buffers[i] for i in range(layers)]


# ---- framework-neutral array arithmetic ------------------------------------------------------------
_KINDS: dict = {}  # array type -> "torch" / "cupy" / "numpy", once seen


def framework(x) -> str:
    """``"torch"``, ``"cupy"`` or ``"numpy"``: the module family of array ``x``."""
    kind = _KINDS.get(type(x))
    if kind is not None:
        return kind
    root = type(x).__module__.split(".")[0]
    if root in ("torch", "cupy") and root in sys.modules:
        kind = root
    elif isinstance(x, np.ndarray):
        kind = "numpy"
    else:
        raise ValidationTypeError(f"kv-canary: expected a torch tensor, a CuPy array or a numpy array, got "
                                  f"{type(x).__module__}.{type(x).__qualname__}; fix: pass the engine's tensor")
    _KINDS[type(x)] = kind
    return kind


_INT_NAMES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


def is_plain_int_tensor(x, ndim: int, dtype: str | None = None) -> bool:
    """Whether ``x`` is a plain torch tensor that :func:`kvcanary.as_view` accepts as an integer
    array (``dtype``: that one) of ``ndim`` dimensions: strided, on CUDA or the CPU, no lazy neg bit.
    False means "not shown here", never "bad": the caller then checks it the long way."""
    kind = type(x)
    if kind.__name__ != "Tensor" or kind.__module__ != "torch":
        return False
    name = str(x.dtype)[6:]
    if (name != dtype if dtype is not None else name not in _INT_NAMES) or x.dim() != ndim:
        return False
    torch = sys.modules["torch"]
    return x.layout is torch.strided and x.device.type in ("cuda", "cpu") and not x.is_neg()


def module_of(x):
    kind = framework(x)
    return np if kind == "numpy" else sys.modules[kind]


def astype(x, dtype: str):
    """``x`` as ``dtype`` ("int32" / "int64") on its own device; no copy when it already is."""
    if framework(x) == "torch":
        want = getattr(sys.modules["torch"], dtype)
        return x if x.dtype is want else x.to(want)
    return x if x.dtype == np.dtype(dtype) else x.astype(dtype)


_KEPT: OrderedDict = OrderedDict()
KEPT = 8  # constant tensors kept (least recently used dropped first)


def kept_tensors(device, what: tuple, make):
    """``make()``'s constant torch tensors on torch ``device``, kept for the :data:`KEPT`
    most recent (device, current stream, ``what``): used in the stream order of the kernels that
    filled them, and freed into it. Never under graph capture: a graph must own what it reads (a
    kept tensor may be dropped while the graph lives), so a capture makes its own. Whoever gets
    them only reads them (they go into a Batch, which kvcanary only reads)."""
    torch = sys.modules["torch"]
    cuda = device.type == "cuda"
    key = (device, torch._C._cuda_getCurrentRawStream(device.index) if cuda else None, what)
    capturing = cuda and torch.cuda.is_current_stream_capturing()
    value = None if capturing else _KEPT.get(key)
    if value is None:
        value = make()
        if not capturing:
            _KEPT[key] = value
            while len(_KEPT) > KEPT:
                _KEPT.popitem(last=False)
    else:
        _KEPT.move_to_end(key)
    return value


def full_like(x, value: int):
    """An array like ``x`` (shape, dtype, device) filled with ``value``: one fill kernel where
    ``x * 0 + value`` takes two."""
    kind = framework(x)
    if kind == "torch":
        return sys.modules["torch"].full_like(x, value)
    if kind == "cupy":
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(x.device.id):
            return cupy.full_like(x, value)
    return np.full_like(x, value)


def arange(like, start: int, stop: int, dtype: str = "int64"):
    """``[start, stop)`` on the device of ``like``."""
    kind = framework(like)
    if kind == "torch":
        torch = sys.modules["torch"]
        return torch.arange(start, stop, dtype=getattr(torch, dtype), device=like.device)
    if kind == "cupy":
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(like.device.id):
            return cupy.arange(start, stop, dtype=dtype)
    return np.arange(start, stop, dtype=dtype)


def zeros(like, shape, dtype: str):
    kind = framework(like)
    if kind == "torch":
        torch = sys.modules["torch"]
        return torch.zeros(shape, dtype=getattr(torch, dtype), device=like.device)
    if kind == "cupy":
        cupy = sys.modules["cupy"]
        with cupy.cuda.Device(like.device.id):
            return cupy.zeros(shape, dtype=dtype)
    return np.zeros(shape, dtype=dtype)


def where(cond, a, b):
    return module_of(cond).where(cond, a, b)


def device_ordinal(x) -> int | None:
    """The CUDA ordinal an array lives on, or None for host memory."""
    return resolved(as_view(x, name="pool tensor")).device


def check_sizes(sizes: Sequence[int], what: str) -> int:
    """The common value of ``sizes`` (e.g. slots per layer); raises when layers disagree."""
    values = sorted(set(int(s) for s in sizes))
    if len(values) != 1:
        raise ValidationError(f"kv-canary: every layer of the {what} must hold the same number of slots, "
                              f"got {values}; fix: pass the layers of one pool")
    return values[0]
