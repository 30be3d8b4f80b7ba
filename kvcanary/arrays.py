"""One view type for every array kvcanary is handed, and the checks made on it.

``as_view`` turns a torch tensor (duck-typed, torch is never imported), a
``__cuda_array_interface__`` producer (CuPy, JAX, Numba, ...), a DLPack producer or capsule, a
numpy array or an ``ArrayView`` into an ``ArrayView``: address, shape, BYTE strides, dtype, device
and an owner that keeps the memory alive. Nothing is copied and no device memory is touched; host
views carry a zero-copy numpy array in ``host``. ``from_pointer`` describes raw memory,
``as_uint8_2d`` gives the [rows, row_bytes] byte view used for real-KV sources (the state arrays'
rules are :func:`kvcanary.state.checked`).

Device ordinals: ``device`` is None for host memory, else the CUDA ordinal, or -1 when the
producer does not say (``__cuda_array_interface__`` carries no ordinal): -1 means "a CUDA device,
ordinal to be resolved from the pointer" and the driver layer resolves it with
cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL) before a launch.
This module never imports torch, CuPy, JAX or the CUDA driver.
"""

from __future__ import annotations

import functools
import math
import operator
from dataclasses import dataclass
from typing import NoReturn

import numpy as np

from . import dlpack
from .dlpack import c_strides
from .errors import ValidationError, ValidationTypeError

_TORCH_ONLY_SIZES = {"float4_e2m1fn_x2": 1, "complex32": 4, "bits8": 1, "bits16": 2,
                     "quint8": 1, "qint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1}
_ACCEPTED = ("a torch tensor, an object with __cuda_array_interface__ (CuPy, JAX, Numba), an "
             "object with __dlpack__ or a DLPack capsule, a numpy array, or "
             "kvcanary.arrays.from_pointer(...)")


def _fail(cls, name: str, expected: str, got: str, fix: str) -> NoReturn:
    """Raise ``cls`` with the house format: what was expected, what was got, how to fix it."""
    raise cls(f"kv-canary: {name}: expected {expected}, got {got}. Fix: {fix}")


def resolve_dtype(spec, itemsize: int | None = None) -> tuple[np.dtype, str]:
    """(numpy dtype or same-size unsigned stand-in, canonical name) for a numpy dtype, a typestr
    ("<i8", "|u1", "<V2"), a name ("bfloat16", "float8_e4m3fn") or a torch dtype string
    ("torch.float8_e4m3fn"). ``itemsize`` names the size of an otherwise unknown dtype."""
    if isinstance(spec, str):  # typestrs and names repeat on every launch: resolve each once
        return _resolve_text(spec, itemsize)
    return _resolve(spec, itemsize)


@functools.lru_cache(maxsize=256)
def _resolve_text(spec: str, itemsize: int | None) -> tuple[np.dtype, str]:
    return _resolve(spec, itemsize)


def _resolve(spec, itemsize: int | None) -> tuple[np.dtype, str]:
    if isinstance(spec, np.dtype) or (isinstance(spec, type) and issubclass(spec, np.generic)):
        dt = np.dtype(spec)
        return dt, dt.name
    text = str(spec).strip()
    name = text[6:] if text.startswith("torch.") else text
    try:
        code, bits, lanes = dlpack.dl_dtype(name)
        if code in dlpack.NAMED_CODES:
            return dlpack.describe_dtype(code, bits, lanes, padded=True)
    except ValidationTypeError:
        pass
    if name in _TORCH_ONLY_SIZES:
        return dlpack.stand_in(_TORCH_ONLY_SIZES[name]), name
    try:
        dt = np.dtype(name)
    except TypeError:
        dt = None
    if dt is not None and not dt.hasobject:
        if dt.kind == "V" and dt.names is None and dt.itemsize in (1, 2, 4, 8):
            return dlpack.stand_in(dt.itemsize), dt.name     # opaque "<V2" (e.g. bfloat16 via CAI)
        return dt, dt.name
    if itemsize:
        return dlpack.stand_in(itemsize), name
    _fail(ValidationTypeError, "dtype", "a dtype kvcanary knows (numpy dtypes, typestrs such as "
          "'<i8', bfloat16, float8_*, torch dtype strings)", repr(spec),
          "pass the array viewed as uint8 or use one of those dtypes")


@dataclass(frozen=True)
class ArrayView:
    """An array as kvcanary sees it. ``strides`` are in BYTES; ``dtype`` is a numpy dtype or a
    same-size unsigned stand-in (bf16, fp8 ...) with the real name in ``dtype_name``; ``device``
    is None (host), a CUDA ordinal, or -1 (CUDA, ordinal resolved later from the pointer);
    ``stream`` is the producer stream from CAI v3 that a launch must be ordered after."""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: np.dtype
    dtype_name: str
    device: int | None
    readonly: bool
    owner: object
    stream: int | None = None
    host: np.ndarray | None = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes_span(self) -> int:
        """Bytes from the lowest to one past the highest byte any element occupies."""
        if self.numel == 0:
            return 0
        ext = [(n - 1) * s for n, s in zip(self.shape, self.strides)]
        return sum(e for e in ext if e > 0) - sum(e for e in ext if e < 0) + self.itemsize

    def is_c_contiguous(self) -> bool:
        if self.numel == 0:
            return True
        want = c_strides(self.shape, self.itemsize)
        return all(n == 1 or s == w for n, s, w in zip(self.shape, self.strides, want))

    def as_uint8_2d(self, name: str) -> ArrayView:
        return as_uint8_2d(self, name)

    def describe(self) -> str:
        dev = "host" if self.device is None else f"cuda:{self.device if self.device >= 0 else '?'}"
        return (f"shape={self.shape}, strides={self.strides} bytes, dtype={self.dtype_name}, "
                f"device={dev}")


def _ints(name: str, what: str, values) -> tuple[int, ...]:
    """``values`` as a tuple of Python ints (a sequence of ints: numpy ints pass, floats do not)."""
    try:
        return tuple(operator.index(n) for n in values)
    except TypeError:
        _fail(ValidationTypeError, name, f"{what} as a sequence of ints", repr(values),
              "describe the array with integer extents and byte strides")


def _finish(name, ptr, shape, strides, dtype, dtype_name, device, readonly, owner, stream=None,
            host=None) -> ArrayView:
    shape, strides = _ints(name, "a shape", shape), _ints(name, "strides", strides)
    if isinstance(ptr, (bool, np.bool_)) or not isinstance(ptr, (int, np.integer, type(None))):
        _fail(ValidationTypeError, name, "a data pointer (an int address)", repr(ptr), "pass the address as an int")
    ptr = int(ptr or 0)
    if len(strides) != len(shape) or any(n < 0 for n in shape):
        _fail(ValidationError, name, "one stride per dimension and non-negative extents",
              f"shape={shape}, strides={strides}", "describe the array correctly")
    if not 0 <= ptr < 1 << 64:
        _fail(ValidationError, name, "a data pointer in [0, 2**64)", hex(ptr), "pass the allocation's address")
    if ptr == 0 and math.prod(shape) > 0:
        _fail(ValidationError, name, "a non-NULL data pointer", f"NULL with shape {shape}",
              "pass an allocated array")
    if math.prod(shape) > 0:
        ext = [(n - 1) * s for n, s in zip(shape, strides)]
        low, high = ptr + sum(e for e in ext if e < 0), ptr + sum(e for e in ext if e > 0) + dtype.itemsize
        if low < 0 or high > 1 << 63:
            _fail(ValidationError, name, "an array inside the address space", f"bytes [{low:#x}, {high:#x}) for "
                  f"shape {shape}, strides {strides}", "check the shape, the strides and the pointer")
    if device is None and host is None:
        host = dlpack.ndarray_at(ptr, shape, strides, dtype, readonly=readonly, owner=owner)
    return ArrayView(ptr, shape, strides, dtype, dtype_name, device, bool(readonly), owner,
                     stream, host)


def from_pointer(ptr: int, shape, dtype, *, device: int | None, strides=None,
                 readonly: bool = False, owner=None) -> ArrayView:
    """Describe raw memory. ``strides`` in bytes (None = C-contiguous); ``device`` None = host
    (a zero-copy ``host`` array is built; the caller keeps the memory alive through ``owner``)."""
    dt, dt_name = resolve_dtype(dtype)
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        _fail(ValidationTypeError, "from_pointer(shape=)", "a tuple of ints", repr(shape), "pass e.g. shape=(4,)")
    shape = _ints("from_pointer(shape=)", "a shape", shape)
    if strides is not None and (isinstance(strides, (str, bytes)) or not hasattr(strides, "__iter__")):
        _fail(ValidationTypeError, "from_pointer(strides=)", "None or a tuple of byte strides", repr(strides),
              "pass e.g. strides=(8,) or None (C-contiguous)")
    strides = c_strides(shape, dt.itemsize) if strides is None else tuple(strides)
    if device is not None and (isinstance(device, (bool, np.bool_)) or not isinstance(device, (int, np.integer))):
        _fail(ValidationTypeError, "from_pointer(device=)", "None (host), a CUDA ordinal or -1 (ordinal unknown)",
              repr(device), "pass the device ordinal the memory lives on as an int")
    if device is not None and device < -1:
        _fail(ValidationError, "from_pointer(device=)", "None (host), a CUDA ordinal or -1 "
              "(ordinal unknown)", repr(device), "pass the device ordinal the memory lives on")
    return _finish("from_pointer", ptr, shape, strides, dt, dt_name, None if device is None else int(device),
                   readonly, owner)


def _is_torch_like(obj) -> bool:
    return all(hasattr(obj, a) for a in ("data_ptr", "stride", "element_size", "device")) \
        and isinstance(getattr(obj.device, "type", None), str)


def _torch_ordinal(obj) -> int | None:
    """The CUDA ordinal of a torch tensor (-1 when torch does not say), None for a CPU one."""
    if obj.device.type != "cuda":
        return None
    index = obj.device.index
    return -1 if index is None else int(index)


def _from_torch(obj, name) -> ArrayView:
    kind = obj.device.type
    layout = getattr(obj, "layout", None)
    if kind not in ("cuda", "cpu") or (layout is not None and str(layout) != "torch.strided"):
        _fail(ValidationTypeError, name, "a strided CUDA or CPU tensor",
              f"device={kind}, layout={layout}", "t.to('cuda') / t.to_dense()")
    for flag in ("is_conj", "is_neg"):
        if getattr(obj, flag, lambda: False)():
            _fail(ValidationError, name, f"a tensor without a lazy {flag[3:]} bit",
                  f"{flag}()=True", f"t.resolve_{flag[3:]}()")
    esize = int(obj.element_size())
    dtype, dtype_name = resolve_dtype(str(obj.dtype), esize)
    if dtype.itemsize != esize:
        dtype = dlpack.stand_in(esize)
    shape = tuple(int(n) for n in obj.shape)
    strides = tuple(int(s) * esize for s in obj.stride())
    ptr = int(obj.data_ptr())
    ordinal = _torch_ordinal(obj)
    if ordinal is not None:
        return _finish(name, ptr, shape, strides, dtype, dtype_name, ordinal, False, obj)
    host = None
    if dtype.name == dtype_name and hasattr(obj, "__dlpack__"):
        try:
            host = np.from_dlpack(obj)
            if host.__array_interface__["data"][0] != ptr and host.size:
                host = None
        except Exception:  # noqa: BLE001 - e.g. requires_grad; fall back to the pointer
            host = None
    return _finish(name, ptr, shape, strides, dtype, dtype_name, None, False, obj, host=host)


def _cuda_ordinal(obj) -> int:
    """The CUDA ordinal a CAI producer names (CuPy .device.id, JAX .devices()), else -1."""
    try:
        dev = getattr(obj, "device", None)
        if (dev is None or callable(dev)) and callable(getattr(obj, "devices", None)):
            devs = list(obj.devices())
            dev = devs[0] if len(devs) == 1 else None
        if isinstance(dev, int) and not isinstance(dev, bool):
            return dev
        if isinstance(dev, str) and dev.startswith("cuda:"):
            return int(dev[5:])
        for attr in ("local_hardware_id", "id"):
            value = getattr(dev, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    except Exception:  # noqa: BLE001 - a producer that cannot say leaves it to the driver
        pass
    return -1


def _from_cai(obj, name) -> ArrayView:
    try:
        cai = obj.__cuda_array_interface__
        ptr, readonly = cai["data"]
        shape, typestr = cai["shape"], cai["typestr"]
        strides, version = cai.get("strides"), cai.get("version", 0)
    except Exception as exc:  # noqa: BLE001 - torch raises TypeError for bf16; a malformed dict, KeyError
        _fail(ValidationTypeError, name, "a readable __cuda_array_interface__ (a dict with data=(ptr, readonly), "
              "shape, typestr)", f"{type(exc).__name__}: {exc}", "pass it through DLPack or viewed as uint8")
    if cai.get("mask") is not None:
        _fail(ValidationError, name, "an unmasked array", "a __cuda_array_interface__ with a "
              "mask (unsupported)", "pass the unmasked data")
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        _fail(ValidationTypeError, name, "a __cuda_array_interface__ shape tuple", repr(shape), "fix the producer")
    shape = _ints(name, "a shape", shape)
    dtype, dtype_name = resolve_dtype(typestr)
    hint = getattr(getattr(obj, "dtype", None), "name", None) if dtype_name.startswith("void") else None
    if hint:  # an opaque typestr ("<V2"): the producer's dtype name may say what it is
        try:
            hinted = resolve_dtype(hint)
            if hinted[0].itemsize == dtype.itemsize:
                dtype, dtype_name = hinted
        except ValidationTypeError:
            pass
    strides = c_strides(shape, dtype.itemsize) if strides is None else strides
    stream = cai.get("stream") if isinstance(version, int) and version >= 3 else None
    if stream is not None and (not isinstance(stream, int) or stream == 0):
        _fail(ValidationError, f"{name}.__cuda_array_interface__['stream']", "None or a stream "
              "handle (1 = legacy default, 2 = per-thread default)", f"{stream!r} (CAI v3 "
              "disallows 0)", "export it with the producer's stream, or None if no sync is needed")
    return _finish(name, ptr, shape, strides, dtype, dtype_name, _cuda_ordinal(obj), readonly,
                   obj, stream=stream)


def _from_dlpack(obj, name, stream) -> ArrayView:
    producer = None
    if not dlpack.is_capsule(obj):
        producer, kwargs = obj, {}
        try:
            device = obj.__dlpack_device__() if hasattr(obj, "__dlpack_device__") else None
            if stream is not None and device and device[0] in dlpack.CUDA_DEVICE_TYPES:
                kwargs["stream"] = stream
            try:
                obj = producer.__dlpack__(max_version=(1, 1), **kwargs)
            except TypeError:
                obj = producer.__dlpack__(**kwargs)
        except Exception as exc:  # noqa: BLE001 - whatever the producer raises is its refusal to export
            _fail(ValidationTypeError, name, "an array that exports through __dlpack__",
                  f"{type(exc).__name__}: {exc}", "pass it viewed as uint8, or via another kind")
    t = dlpack.import_capsule(obj, producer)
    if t.device_type in dlpack.HOST_DEVICE_TYPES:
        device = None
    elif t.device_type in dlpack.CUDA_DEVICE_TYPES:
        device = t.device_id
    else:
        where = dlpack.DEVICE_NAMES.get(t.device_type, t.device_type)
        _fail(ValidationTypeError, name, "CPU, CUDA, CUDA-host or CUDA-managed memory",
              f"DLPack device {where}:{t.device_id}", "move it to a CUDA device or the host")
    itemsize = t.dtype.itemsize
    strides = (c_strides(t.shape, itemsize) if t.strides is None
               else tuple(s * itemsize for s in t.strides))
    return _finish(name, t.ptr, t.shape, strides, t.dtype, t.dtype_name, device, t.readonly,
                   t.owner)


def _from_numpy(obj: np.ndarray, name) -> ArrayView:
    if obj.dtype.hasobject:
        _fail(ValidationTypeError, name, "an array of plain data", f"numpy dtype {obj.dtype}",
              "convert it, e.g. a.astype(np.int64)")
    return _finish(name, obj.__array_interface__["data"][0], obj.shape, obj.strides, obj.dtype,
                   obj.dtype.name, None, not obj.flags.writeable, obj, host=obj)


def as_view(obj, *, name: str, stream: int | None = None) -> ArrayView:
    """An ``ArrayView`` of ``obj`` (see the module docstring), zero-copy.

    ``stream`` is the consumer stream the caller will launch on: it is passed to a CUDA producer's
    ``__dlpack__(stream=...)`` so the producer orders its pending work before it. A CAI v3
    producer reports its own stream instead, in ``ArrayView.stream``, which the caller must order
    after. Detection order: ArrayView, torch-like, __cuda_array_interface__, numpy, DLPack."""
    if isinstance(obj, ArrayView):
        return obj
    if _is_torch_like(obj):
        return _from_torch(obj, name)
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_cai(obj, name)
    if isinstance(obj, np.ndarray):
        return _from_numpy(obj, name)
    if hasattr(obj, "__dlpack__") or dlpack.is_capsule(obj):
        return _from_dlpack(obj, name, stream)
    _fail(ValidationTypeError, name, _ACCEPTED, f"{type(obj).__module__}.{type(obj).__qualname__}",
          "pass one of those, e.g. a torch.Tensor on the KV cache's device")


_SCALARS = (int, float, bool)
TORCH_TENSOR = [None]  # torch.Tensor once layout_key has seen one (torch is never imported here)


def layout_key(obj):
    """(layout, address) of one array argument, cheaply: everything a packed launch's validation
    and params depend on (shape, byte strides or their source, dtype, device, the producer's stream
    and flags; a scalar's type and value) and where its data is. Arrays of one layout may replay
    each other's launches once the address is patched in (and checked: :func:`check_address`).
    ``(None, None)`` for an object that cannot be keyed without a full conversion (a DLPack
    producer, a numpy array, a torch subclass ...): never cached, always validated."""
    kind = type(obj)
    if obj is None or kind in _SCALARS or isinstance(obj, (np.integer, np.floating, np.bool_)):
        return (kind, obj), None  # the type too: True == 1 == 1.0, and only an int passes integer()
    if kind.__name__ == "Tensor" and kind.__module__ == "torch":
        TORCH_TENSOR[0] = kind  # for the inlined copy of this branch in packing.arg_keys
        try:  # a strided tensor; its lazy neg bit, which as_view refuses (the conj bit needs a complex dtype)
            return (obj.shape, obj.stride(), obj.dtype, obj.device, obj.is_neg()), obj.data_ptr()
        except Exception:  # noqa: BLE001 - a sparse or otherwise unusual tensor: as_view says what is wrong
            return None, None
    if kind.__name__ == "DeviceArray" and kind.__module__ == "kvcanary.memory":  # its CAI's key, faster
        return (obj.shape, None, obj.dtype.str, False, None, obj.device), obj.ptr
    if kind is ArrayView:
        if obj.device == -1 or obj.host is not None:
            return None, None
        return (ArrayView, obj.shape, obj.strides, obj.dtype, obj.dtype_name, obj.readonly, obj.stream,
                obj.device), obj.ptr
    try:
        cai = obj.__cuda_array_interface__
    except Exception:  # noqa: BLE001 - no CAI (or a refusing one): not keyed
        return None, None
    try:
        (ptr, readonly), typestr = cai["data"], cai["typestr"]
        shape, strides = tuple(cai["shape"]), cai.get("strides")
        version, mask = cai.get("version", 0), cai.get("mask")
        if mask is not None or not isinstance(typestr, str) or typestr[1:2] == "V" or not isinstance(ptr, int):
            return None, None  # masked, opaque (the producer's dtype decides) or malformed: as_view says
        stream = cai.get("stream") if isinstance(version, int) and version >= 3 else None
        device = _cuda_ordinal(obj)
        if device == -1 and ptr:  # the driver places the pointer (as resolved() does for the launch)
            from .driver import pointer_device
            device = pointer_device(ptr)
        return (shape, None if strides is None else tuple(strides), typestr, bool(readonly), stream,
                device), ptr
    except Exception:  # noqa: BLE001 - a malformed interface: not keyed, as_view reports it
        return None, None


def address_bounds(view: ArrayView) -> tuple[int, int]:
    """(lowest, one past the highest) byte offset from ``view.ptr`` an element occupies ((0, 0) if
    empty): what :func:`check_address` needs to re-check a new address of the same layout."""
    if view.numel == 0:
        return 0, 0
    ext = [(n - 1) * s for n, s in zip(view.shape, view.strides)]
    return sum(e for e in ext if e < 0), sum(e for e in ext if e > 0) + view.itemsize


def check_address(name: str, ptr: int, bounds: tuple[int, int]) -> None:
    """The address checks of :func:`as_view` for a new address of an already validated layout."""
    low, high = bounds
    if high == 0:
        return
    if not 0 < ptr < 1 << 64:
        _fail(ValidationError, name, "a non-NULL data pointer in [0, 2**64)", hex(ptr), "pass an allocated array")
    if ptr + low < 0 or ptr + high > 1 << 63:
        _fail(ValidationError, name, "an array inside the address space", f"bytes [{ptr + low:#x}, {ptr + high:#x})",
              "check the shape, the strides and the pointer")


_SHAPE_FIX = "reshape to [num_slots, bytes_per_slot], e.g. t.view(t.shape[0], -1)"


def as_uint8_2d(view: ArrayView, name: str) -> ArrayView:
    """The [rows, row_bytes] uint8 view of ``view``: row = dims 1.. collapsed, which requires them
    to be contiguous; the row stride is the array's real ``strides[0]`` (a per-layer slice of a
    larger buffer keeps its stride, no copy). A single row gets stride row_bytes."""
    if view.ndim < 2:
        _fail(ValidationError, name, "an array of at least 2 dimensions to view as uint8 "
              "[rows, row_bytes]", f"{view.ndim}-D shape {view.shape}", _SHAPE_FIX)
    row_bytes = view.itemsize
    if all(view.shape[1:]):
        for i in range(view.ndim - 1, 0, -1):
            n, s = view.shape[i], view.strides[i]
            if n != 1 and s != row_bytes:
                what = ("a contiguous last dimension (stride == itemsize)" if i == view.ndim - 1
                        else "dims 1.. that collapse into one contiguous row")
                _fail(ValidationError, name, f"{what} to view as uint8 [rows, row_bytes], i.e. "
                      f"dim {i} stride {row_bytes} bytes", f"{s} bytes ({view.describe()})",
                      "pass the buffer in its storage layout, not a transposed or permuted view "
                      f"(a .contiguous() copy would be a stale snapshot), then {_SHAPE_FIX}")
            row_bytes *= n
    else:
        row_bytes = 0
    rows = view.shape[0]
    row_stride = view.strides[0] if rows > 1 else row_bytes
    if row_stride < 0:
        _fail(ValidationError, name, "a non-negative row stride", f"{row_stride} bytes "
              f"({view.describe()})", "pass the buffer itself, not a reversed view")
    shape, strides = (rows, row_bytes), (row_stride, 1)
    host = None
    if view.host is not None:
        host = dlpack.ndarray_at(view.ptr, shape, strides, np.uint8, readonly=view.readonly,
                                 owner=view)
    return ArrayView(view.ptr, shape, strides, np.dtype(np.uint8), "uint8", view.device,
                     view.readonly, view, view.stream, host)
