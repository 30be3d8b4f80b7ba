"""Checks of the scalar arguments of the public API, with the house error format.

Every failure raises :class:`ValidationTypeError` (a TypeError: the wrong kind of value) or
:class:`ValidationError` (a ValueError: the right kind, out of range) whose text starts with
``kv-canary:``, says what was expected and what was got, and ends with a fix. Booleans are not
integers here (``True`` is not a count) and floats are not integers (``1.5`` is the wrong kind,
not a value out of range). Imports nothing from CUDA; reads no array element.
"""

from __future__ import annotations

import enum
import numbers
import os
from typing import Mapping

import numpy as np

from . import abi
from .errors import ValidationError, ValidationTypeError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1


def _got(value) -> str:
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if isinstance(shape, tuple) and dtype is not None and not isinstance(value, np.generic):
        return f"a {type(value).__name__} of shape {shape} and dtype {dtype}"
    text = " ".join(repr(value).split())
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({type(value).__name__})"


def fail(name: str, expected: str, value, fix: str, *, kind: type = ValidationError):
    raise kind(f"kv-canary: {name} must be {expected}, got {_got(value)}. Fix: {fix}")


def is_int(value) -> bool:
    """An int or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def integer(name: str, value, *, lo: int | None = None, hi: int | None = None, fix: str = "") -> int:
    """``value`` as an int in [lo, hi] (an int or numpy integer, not a bool or a float)."""
    span = (f"an integer in [{lo}, {hi}]" if lo is not None and hi is not None else
            f"an integer >= {lo}" if lo is not None else f"an integer <= {hi}" if hi is not None else "an integer")
    if not is_int(value):
        fail(name, span, value, fix or f"pass an int, e.g. {name}={lo if lo is not None else 0}",
             kind=ValidationTypeError)
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        fail(name, span, value, fix or f"pass a value in that range, e.g. {name}={lo if lo is not None else hi}")
    return v


def optional_integer(name: str, value, **kw) -> int | None:
    """None, or :func:`integer`."""
    return None if value is None else integer(name, value, **kw)


def boolean(name: str, value) -> bool:
    """``value`` as a bool (a bool or numpy bool only: 0/1 and strings are refused)."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    fail(name, "True or False", value, f"pass {name}=True or {name}=False", kind=ValidationTypeError)


def device(name: str, value) -> int | None:
    """None (host memory) or a CUDA ordinal >= 0."""
    if value is None:
        return None
    return integer(name, value, lo=0, fix=f"pass {name}=None (host arrays) or a CUDA ordinal such as {name}=0")


def instance(name: str, value, types, expected: str, fix: str):
    """``value`` if it is one of ``types``, else a ValidationTypeError naming ``expected``."""
    if not isinstance(value, types):
        fail(name, expected, value, fix, kind=ValidationTypeError)
    return value


def callable_or_none(name: str, value, fix: str = ""):
    if value is not None and not callable(value):
        fail(name, "a callable or None", value, fix or f"pass a function, or leave {name} out",
             kind=ValidationTypeError)
    return value


def choice(name: str, value, options: Mapping[str, object] | tuple[str, ...]):
    """One of ``options`` by name (case-insensitive); a mapping gives the mapped value."""
    names = tuple(options)
    if not isinstance(value, str):
        fail(name, f"one of {names}", value, f"pass a string, e.g. {name}={names[0]!r}", kind=ValidationTypeError)
    key = value.lower()
    if key not in names:
        fail(name, f"one of {names}", value, f"pass one of {', '.join(repr(n) for n in names)}")
    return options[key] if isinstance(options, Mapping) else key


def hash_mode(value, name: str = "hash_mode") -> abi.HashMode:
    """A HashMode from the enum itself or its name in any case ("none", "PARTIAL", "All")."""
    if isinstance(value, abi.HashMode):
        return value
    if isinstance(value, enum.Enum) or isinstance(value, bool) or not isinstance(value, str):
        fail(name, "a kvcanary.HashMode or one of 'none', 'partial', 'all'", value,
             f"pass e.g. {name}='partial' or kvcanary.HashMode.PARTIAL", kind=ValidationTypeError)
    return choice(name, value, {m.name.lower(): m for m in abi.HashMode})


def launch_tag(value, name: str = "tag") -> abi.LaunchTag:
    """A LaunchTag from the enum, its name in any case ("HEAD_K_FULL") or its int value."""
    names = ", ".join(t.name for t in abi.LaunchTag)
    if isinstance(value, abi.LaunchTag):
        return value
    if isinstance(value, str):
        return choice(name, value, {t.name.lower(): t for t in abi.LaunchTag})
    if not is_int(value) or isinstance(value, enum.Enum):
        fail(name, f"a kvcanary.LaunchTag, its name ({names}) or its value", value,
             f"pass e.g. {name}=kvcanary.LaunchTag.HEAD_K_FULL", kind=ValidationTypeError)
    if int(value) not in {int(t) for t in abi.LaunchTag}:
        fail(name, f"a LaunchTag value in [0, {int(max(abi.LaunchTag))}]", value,
             f"pass e.g. {name}=kvcanary.LaunchTag.HEAD_K_FULL")
    return abi.LaunchTag(int(value))


def path_like(name: str, value) -> str:
    if not isinstance(value, (str, os.PathLike)) or isinstance(os.fspath(value), bytes):
        fail(name, "a path (str or os.PathLike) or a callable", value, "pass a file path or a function",
             kind=ValidationTypeError)
    return os.fspath(value)
