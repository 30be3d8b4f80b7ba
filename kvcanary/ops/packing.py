"""Packed launches kept per array layout and replayed with the current arrays' addresses.

An engine hands kvcanary new arrays every step (fresh tensors, per-step slices of persistent
buffers), almost always of the layouts it had before. Validation depends only on the layout
(shape, strides, dtype, device, the producer's stream and flags, scalar arguments) and on each
address being a possible one; the params of a packed launch depend on the addresses too. So
launches are validated and packed once per layout (:func:`layout_key`, plus which
arguments alias) and replayed with the addresses of the call patched into the params fields that
held the packing call's addresses, each new address checked as :func:`~kvcanary.interop.arrays.as_view`
would. An object that cannot be keyed cheaply is never cached. Entries hold layouts and the
launches (which keep the canary's own state alive), never the caller's arrays.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict

import numpy as np

from ..errors import ValidationError
from ..interop.arrays import ArrayView, as_view, cuda_ordinal, extent
from ..runtime import streams
from ..runtime.driver import PER_THREAD_STREAM, pointer_device
from ..runtime.memory import DeviceArray

KEPT = 128  # layouts kept per cache (least recently used dropped first; batch sizes vary: stages.LAYOUTS_KEPT)
# Argument types whose layout and address never change while the object lives (kvcanary's own
# arrays, numbers, None): the same object proves the same key.
IMMUTABLE = frozenset({DeviceArray, ArrayView, type(None), int, float, bool})

_ADDRESS_END = 1 << 63


# ---- layout keys -----------------------------------------------------------------------------------
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
        TORCH_TENSOR[0] = kind  # for the inlined copy of this branch in arg_keys
        try:  # a strided tensor; its lazy neg bit, which as_view refuses (the conj bit needs a complex dtype)
            return (obj.shape, obj.stride(), obj.dtype, obj.device, obj.is_neg()), obj.data_ptr()
        except Exception:  # noqa: BLE001 - a sparse or otherwise unusual tensor: as_view says what is wrong
            return None, None
    if kind.__name__ == "DeviceArray" and kind.__module__ == "kvcanary.runtime.memory":  # its CAI's key, faster
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
        device = cuda_ordinal(obj)
        if device == -1 and ptr:  # the driver places the pointer (as resolved() does for the launch)
            device = pointer_device(ptr)
        return (shape, None if strides is None else tuple(strides), typestr, bool(readonly), stream,
                device), ptr
    except Exception:  # noqa: BLE001 - a malformed interface: not keyed, as_view reports it
        return None, None


def check_address(name: str, ptr: int, bounds: tuple[int, int]) -> None:
    """The address checks of :func:`~kvcanary.interop.arrays.as_view` for a new address of an already
    validated layout whose elements occupy ``bounds`` (:func:`~kvcanary.interop.arrays.extent`)."""
    low, high = bounds
    if high == 0:
        return
    if not 0 < ptr < 1 << 64:
        raise ValidationError(f"kv-canary: {name}: expected a non-NULL data pointer in [0, 2**64), got {hex(ptr)}. "
                              f"Fix: pass an allocated array")
    if ptr + low < 0 or ptr + high > 1 << 63:
        raise ValidationError(f"kv-canary: {name}: expected an array inside the address space, got bytes "
                              f"[{ptr + low:#x}, {ptr + high:#x}). Fix: check the shape, the strides and the pointer")


_NONE = layout_key(None)


# ---- packed launches by layout ---------------------------------------------------------------------


def arg_keys(objs) -> tuple[tuple | None, tuple, bool]:
    """(layout key of the arguments, their addresses, whether all are :data:`IMMUTABLE`); the key
    is None when an argument cannot be keyed (then nothing is cached). Which arguments share an
    address is part of the key: the patch map tells arguments apart by address. Plain torch
    tensors take an inlined copy of :func:`layout_key`'s branch (every step)."""
    tensor, none = TORCH_TENSOR[0], _NONE[0]
    layouts, ptrs, fixed = [], [], True
    lay_add, ptr_add = layouts.append, ptrs.append
    for obj in objs:
        if obj is None:
            lay_add(none)
            ptr_add(None)
        elif type(obj) is tensor:
            try:
                lay_add((obj.shape, obj.stride(), obj.dtype, obj.device, obj.is_neg()))
            except Exception:  # noqa: BLE001 - as layout_key: not keyed
                return None, (), False
            ptr_add(obj.data_ptr())
            fixed = False
        elif type(obj) is DeviceArray:  # layout_key's branch, inlined
            lay_add((obj.shape, None, obj.dtype.str, False, None, obj.device))
            ptr_add(obj.ptr)
        else:
            lay, ptr = layout_key(obj)
            if lay is None:
                return None, (), False
            lay_add(lay)
            ptr_add(ptr)
            fixed = fixed and type(obj) in IMMUTABLE
    given = [p for p in ptrs if p]
    if len(set(given)) == len(given):
        return (tuple(layouts), None), tuple(ptrs), fixed  # no two arguments alias
    first: dict = {}
    alias = tuple(first.setdefault(p, i) if p else -1 for i, p in enumerate(ptrs))
    return (tuple(layouts), alias), tuple(ptrs), fixed


def _pointer_fields(params):
    """(struct, field name) of every pointer field of a params struct and of the structs it holds
    (the halves of a paired launch: ctypes elements that write through to it)."""
    for name, ctype in type(params)._fields_:
        if ctype is ctypes.c_uint64:
            yield params, name
        elif issubclass(ctype, ctypes.Array) and issubclass(ctype._type_, ctypes.Structure):
            for item in getattr(params, name):
                yield from _pointer_fields(item)


def patch_map(launches, ptrs) -> tuple:
    """(argument index, its uint64 params fields) of every argument whose address a pointer field
    of the launches' params holds; a field is a ctypes view of the params' memory, so setting its
    ``value`` patches the struct (twice as fast as ``setattr`` by name)."""
    where = {p: i for i, p in enumerate(ptrs) if p}
    fields: dict[int, list] = {}
    for launch in launches:
        for params, name in _pointer_fields(launch.params):
            i = where.get(getattr(params, name))
            if i is not None:
                fields.setdefault(i, []).append(ctypes.c_uint64.from_buffer(params, getattr(type(params), name).offset))
    return tuple((i, tuple(f)) for i, f in sorted(fields.items()))


class Packed:
    """One layout's launches, where the arguments' addresses go, and the addresses they hold."""

    __slots__ = ("launches", "patches", "ptrs", "checks", "names", "extra")

    def __init__(self, launches, ptrs, bounds, names, extra=None):
        self.launches, self.ptrs, self.names, self.extra = launches, ptrs, names, extra
        self.patches = patch_map(launches, ptrs)
        # (index, low, high) of each argument whose elements occupy bytes: its new address is checked
        self.checks = tuple((i, low, high) for i, (low, high) in enumerate(bounds) if high)

    def retarget(self, ptrs) -> None:
        """Point the launches at the arguments' new addresses (each checked first: a refused one
        leaves the launches as they were); only the fields of arguments that moved are written."""
        old = self.ptrs
        for i, low, high in self.checks:
            p = ptrs[i]
            if p != old[i] and (p <= 0 or p + low < 0 or p + high > _ADDRESS_END):  # as check_address tests it
                check_address(self.names[i], p, (low, high))
        for i, fields in self.patches:
            p = ptrs[i]
            if p != old[i]:
                for field in fields:
                    field.value = p
        self.ptrs = ptrs


def _bounds(view: ArrayView) -> tuple[int, int]:
    return extent(view.shape, view.strides, view.itemsize)


class PackCache:
    """Packed launches by layout key, the least recently used dropped past :data:`KEPT`."""

    def __init__(self, kept: int = KEPT):
        self.entries: OrderedDict = OrderedDict()
        self.kept = kept
        self.lock = threading.Lock()  # a replay patches shared params: patch and launch under it

    def get(self, key, ptrs) -> Packed | None:
        """The entry of ``key`` retargeted at ``ptrs``, or None."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        self.entries.move_to_end(key)
        if entry.ptrs != ptrs:
            entry.retarget(ptrs)
        return entry

    def put(self, key, launches, objs, ptrs, names, extra=None, views=None) -> Packed:
        """Keep ``launches``, packed (and so validated) from the arguments ``objs`` at ``ptrs``;
        ``views``: the packing's own ArrayViews of them where it made them (None: made here)."""
        names = (*names, *(f"argument {i}" for i in range(len(names), len(objs))))  # a Batch subclass's extras
        views = views or ()
        bounds = tuple((0, 0) if p is None else _bounds(views[i] if i < len(views) and views[i] is not None
                                                      else as_view(o, name=n))
                       for i, (o, p, n) in enumerate(zip(objs, ptrs, names)))
        entry = self.entries[key] = Packed(launches, ptrs, bounds, names, extra)
        while len(self.entries) > self.kept:
            self.entries.popitem(last=False)
        return entry

    def values(self):
        return self.entries.values()

    def __len__(self) -> int:
        return len(self.entries)


# ---- the public ops (kvcanary.ops) called eagerly ---------------------------------------------------
FIXED_STATE = frozenset({DeviceArray, type(None)})  # state arrays that key as themselves (state_key)


def state_key(values) -> tuple | None:
    """Key of state arrays (a plan's): kvcanary's own DeviceArrays by identity (their address and
    layout are fixed for life; the key holds them), any other array by layout and address; None
    when one cannot be keyed."""
    out = []
    for v in values:
        if type(v) in FIXED_STATE:
            out.append(v)
            continue
        lay, ptr = layout_key(v)
        if lay is None:
            return None
        out.append((lay, ptr))
    return tuple(out)


def _view_stream(objs) -> int | None:
    """The first producer stream of the arrays (CAI v3), as :func:`kvcanary.runtime.streams.resolve` finds it."""
    for obj in objs:
        if obj is not None and not (type(obj) is TORCH_TENSOR[0]):
            v = as_view(obj, name="array")
            if v.stream is not None:
                return int(v.stream)
    return None


def run(owner, head, args, names, stream, device: int, owners, stream_objs, pack) -> None:
    """Run one eager op on ``device``: its launches as packed for the layout of ``args`` (and
    ``head``: the op, its state and scalar arguments), else ``pack()`` (validates and packs) run
    and kept in ``owner``'s cache. The stream is resolved per call as ``pack`` resolves it:
    explicit, then the framework of ``owners``, then a producer stream of ``stream_objs``."""
    cache = owner.__dict__.get("_kvc_packed")
    if cache is None:
        cache = owner.__dict__.setdefault("_kvc_packed", PackCache())
    key, ptrs, _ = arg_keys(args)
    if key is None or head is None:
        for launch in pack():
            launch()
        return
    key = (head, key)
    with cache.lock:
        entry = cache.get(key, ptrs)
        if entry is None:
            launches = pack()
            entry = cache.put(key, launches, args, ptrs, names, extra=_view_stream(stream_objs))
            for launch in launches:
                launch()
            return
        if stream is not None:
            s = streams.stream_handle(stream)
        else:
            s = streams.framework_stream(owners, device)
            if s is None:
                s = PER_THREAD_STREAM if entry.extra is None else entry.extra
        for launch in entry.launches:
            launch.go(s)
