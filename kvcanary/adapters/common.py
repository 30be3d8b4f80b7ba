"""What every adapter shares: layer selection and array arithmetic without importing a framework.

Adapters receive the engine's own arrays (torch, CuPy or numpy) and must derive new arrays on the
same device without a host round trip. The helpers here dispatch on the array's module, looked up
in ``sys.modules`` (a framework that is not already imported cannot have produced the array), so
importing kvcanary never imports torch or CuPy.
"""

from __future__ import annotations

import sys
import warnings
from typing import Sequence

import numpy as np

from .. import abi
from ..errors import ValidationError

def select_layers(num_layers: int, layers=None, *, sources_per_layer: int = 1, what: str = "pool") -> list[int]:
    """Indices of the layers to fingerprint: ``None``/``"first"`` -> ``[0]``; ``"all"`` -> every layer,
    truncated (with a warning) so that ``len * sources_per_layer <= MAX_REAL_KV_SOURCES``; an int or
    a sequence of ints -> those layers (checked, order kept, no duplicates)."""
    cap = abi.MAX_REAL_KV_SOURCES // max(1, sources_per_layer)
    if num_layers < 1:
        raise ValidationError(f"kv-canary: the {what} has no layers to fingerprint (got {num_layers})")
    if layers is None or layers == "first":
        return [0]
    if layers == "all":
        if num_layers > cap:
            warnings.warn(f"kv-canary: fingerprinting the first {cap} of {num_layers} layers of the {what}: "
                          f"the CUDA ABI takes at most {abi.MAX_REAL_KV_SOURCES} sources "
                          f"({sources_per_layer} per layer); pass a list to choose others", RuntimeWarning,
                          stacklevel=3)
        return list(range(min(num_layers, cap)))
    if isinstance(layers, str):
        raise ValidationError(f"kv-canary: layers must be None, 'first', 'all', an int or a list of ints, "
                              f"got {layers!r}")
    picked = [int(layers)] if isinstance(layers, (int, np.integer)) else [int(i) for i in layers]
    bad = [i for i in picked if not 0 <= i < num_layers]
    if bad or len(set(picked)) != len(picked) or not picked:
        raise ValidationError(f"kv-canary: layers must be distinct indices in [0, {num_layers}) of the "
                              f"{what}, got {list(picked)}")
    if len(picked) > cap:
        raise ValidationError(f"kv-canary: {len(picked)} layers x {sources_per_layer} source(s) exceed the "
                              f"{abi.MAX_REAL_KV_SOURCES} real-KV sources of the CUDA ABI; fix: pass at "
                              f"most {cap} layers")
    return picked


_MISSING = object()


def require_attr(obj, name: str, what: str, fix: str):
    """``obj.name``, or a :class:`ValidationError` naming the attribute that is missing: the engine
    object is not of the layout this adapter was written against (SPEC: errors say expected / got / fix)."""
    value = getattr(obj, name, _MISSING)
    if value is _MISSING:
        public = sorted(a for a in dir(obj) if not a.startswith("__"))[:24]
        raise ValidationError(f"kv-canary: expected {what} ({type(obj).__name__}) to have attribute {name!r}, "
                              f"got an object without it (attributes: {public}); fix: {fix}")
    return value


def layer_list(buffers, what: str) -> list:
    """A per-layer list from a list/tuple of arrays or one stacked ``[layers, ...]`` array."""
    if buffers is None:
        raise ValidationError(f"kv-canary: {what} is missing (None)")
    if isinstance(buffers, (list, tuple)):
        return list(buffers)
    return [buffers[i] for i in range(int(buffers.shape[0]))]


# ---- framework-neutral array arithmetic ------------------------------------------------------------
def framework(x) -> str:
    """``"torch"``, ``"cupy"`` or ``"numpy"``: the module family of array ``x``."""
    root = type(x).__module__.split(".")[0]
    if root in ("torch", "cupy") and root in sys.modules:
        return root
    if isinstance(x, np.ndarray):
        return "numpy"
    raise ValidationError(f"kv-canary: expected a torch tensor, a CuPy array or a numpy array, got "
                          f"{type(x).__module__}.{type(x).__qualname__}; fix: pass the engine's tensor")


def module_of(x):
    kind = framework(x)
    return np if kind == "numpy" else sys.modules[kind]


def astype(x, dtype: str):
    """``x`` as ``dtype`` ("int32" / "int64") on its own device; no copy when it already is."""
    if framework(x) == "torch":
        want = getattr(sys.modules["torch"], dtype)
        return x if x.dtype == want else x.to(want)
    return x if x.dtype == np.dtype(dtype) else x.astype(dtype)


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
    from ..arrays import as_view
    from ..sources import resolved
    return resolved(as_view(x, name="pool tensor")).device


def check_sizes(sizes: Sequence[int], what: str) -> int:
    """The common value of ``sizes`` (e.g. slots per layer); raises when layers disagree."""
    values = sorted(set(int(s) for s in sizes))
    if len(values) != 1:
        raise ValidationError(f"kv-canary: every layer of the {what} must hold the same number of slots, "
                              f"got {values}; fix: pass the layers of one pool")
    return values[0]
