"""Element types: DLPack's type codes (dlpack.h, v1.1), numpy dtypes, and the types numpy lacks
(bfloat16, the float8 / float6 / float4 families, torch-only types), which kvcanary carries as a
same-size unsigned stand-in with their real name beside it (bytes are bytes to a fingerprint).
This module never imports torch, CuPy, JAX or the CUDA driver.
"""

from __future__ import annotations

import functools

import numpy as np

from ..errors import ValidationTypeError

kDLInt, kDLUInt, kDLFloat, kDLOpaqueHandle, kDLBfloat, kDLComplex, kDLBool = range(7)
NAMED_CODES = {4: "bfloat16", 7: "float8_e3m4", 8: "float8_e4m3", 9: "float8_e4m3b11fnuz",
               10: "float8_e4m3fn", 11: "float8_e4m3fnuz", 12: "float8_e5m2", 13: "float8_e5m2fnuz",
               14: "float8_e8m0fnu", 15: "float6_e2m3fn", 16: "float6_e3m2fn", 17: "float4_e2m1fn"}
_NAMED_BITS = {4: 16, 15: 6, 16: 6, 17: 4}       # every other named code is 8 bits
_NUMPY_KIND_CODES = {"i": kDLInt, "u": kDLUInt, "f": kDLFloat, "c": kDLComplex, "b": kDLBool}
_CODE_KINDS = {v: k for k, v in _NUMPY_KIND_CODES.items()}

_TORCH_ONLY_SIZES = {"float4_e2m1fn_x2": 1, "complex32": 4, "bits8": 1, "bits16": 2,
                     "quint8": 1, "qint8": 1, "qint32": 4, "quint4x2": 1, "quint2x4": 1}


def stand_in(itemsize: int) -> np.dtype:
    """The numpy dtype used in place of one numpy lacks: an unsigned int of the same size."""
    return np.dtype({1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}.get(itemsize, f"V{itemsize}"))


def describe_dtype(code: int, bits: int, lanes: int, padded: bool = False) -> tuple[np.dtype, str]:
    """(numpy dtype or same-size stand-in, canonical name) for a DLPack (code, bits, lanes)."""
    total = bits * lanes
    if total % 8 == 0 and total > 0:
        itemsize = total // 8
    elif padded and lanes == 1 and 0 < bits < 8:
        itemsize = 1
    else:
        raise ValidationTypeError(
            f"kv-canary: expected DLPack elements that occupy whole bytes, got dtype (code={code}, "
            f"bits={bits}, lanes={lanes}) with packed sub-byte elements. Fix: export the tensor "
            f"viewed as uint8 (e.g. t.view(torch.uint8)) so every element is addressable by byte.")
    suffix = f"_x{lanes}" if lanes > 1 else ""
    if lanes == 1 and code in _CODE_KINDS and (code != kDLBool or bits == 8):
        try:
            dt = np.dtype(f"{_CODE_KINDS[code]}{itemsize}")
            return dt, dt.name
        except TypeError:
            pass
    name = NAMED_CODES.get(code, f"dlpack({code},{bits})") + suffix
    return stand_in(itemsize), name


def dl_dtype(dtype) -> tuple[int, int, int]:
    """(code, bits, lanes) for a numpy dtype or a name such as "bfloat16" / "torch.float8_e5m2"."""
    if isinstance(dtype, str):
        name = dtype[6:] if dtype.startswith("torch.") else dtype
        base, _, lanes = name.partition("_x")
        for code, known in NAMED_CODES.items():
            if base == known and (lanes == "" or lanes.isdigit()):
                return code, _NAMED_BITS.get(code, 8), int(lanes or 1)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.kind not in _NUMPY_KIND_CODES or not dt.isnative:
        raise ValidationTypeError(
            f"kv-canary: expected a DLPack-representable dtype (numpy int/uint/float/complex/"
            f"bool or one of {sorted(NAMED_CODES.values())}), got {dtype!r}. Fix: export the "
            f"buffer as uint8 or pass one of those names.")
    return _NUMPY_KIND_CODES[dt.kind], dt.itemsize * 8, 1


def resolve_dtype(spec, itemsize: int | None = None) -> tuple[np.dtype, str]:
    """(numpy dtype or same-size unsigned stand-in, canonical name) for a numpy dtype, a typestr
    ("<i8", "|u1", "<V2"), a name ("bfloat16", "float8_e4m3fn") or a torch dtype string
    ("torch.float8_e4m3fn"). ``itemsize`` names the size of an otherwise unknown dtype."""
    if isinstance(spec, str):  # typestrs and names repeat on every launch: resolve each once
        return _resolve_text(spec, itemsize)
    return _resolve(spec, itemsize)


def resolve_typestr(typestr, producer) -> tuple[np.dtype, str]:
    """:func:`resolve_dtype` of an array interface typestr; an opaque one ("<V2") takes the name
    of the ``producer``'s own dtype (e.g. bfloat16) when that names a type of the same size."""
    dtype, dtype_name = resolve_dtype(typestr)
    hint = getattr(getattr(producer, "dtype", None), "name", None) if dtype_name.startswith("void") else None
    if hint:
        try:
            hinted = resolve_dtype(hint)
            if hinted[0].itemsize == dtype.itemsize:
                return hinted
        except ValidationTypeError:
            pass
    return dtype, dtype_name


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
        code, bits, lanes = dl_dtype(name)
        if code in NAMED_CODES:
            return describe_dtype(code, bits, lanes, padded=True)
    except ValidationTypeError:
        pass
    if name in _TORCH_ONLY_SIZES:
        return stand_in(_TORCH_ONLY_SIZES[name]), name
    try:
        dt = np.dtype(name)
    except TypeError:
        dt = None
    if dt is not None and not dt.hasobject:
        if dt.kind == "V" and dt.names is None and dt.itemsize in (1, 2, 4, 8):
            return stand_in(dt.itemsize), dt.name     # opaque "<V2" (e.g. bfloat16 via CAI)
        return dt, dt.name
    if itemsize:
        return stand_in(itemsize), name
    raise ValidationTypeError("kv-canary: dtype: expected a dtype kvcanary knows (numpy dtypes, typestrs such as "
                              "'<i8', bfloat16, float8_*, torch dtype strings), got " + repr(spec) + ". Fix: "
                              "pass the array viewed as uint8 or use one of those dtypes")
