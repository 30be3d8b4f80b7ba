"""Checks of the scalar arguments of the public API, with the house error format.

Every failure raises :class:`ValidationTypeError` (a TypeError: the wrong kind of value) or
:class:`ValidationError` (a ValueError: the right kind, out of range) whose text starts with
``kv-canary:``, says what was expected and what was got, and ends with a fix. Booleans are not
integers here (``True`` is not a count). Imports nothing from CUDA.
"""

from __future__ import annotations

import enum
import numbers
import os
from typing import Mapping

from . import abi
from .errors import ValidationError, ValidationTypeError

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
INT32_MAX = (1 << 31) - 1


def _got(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def fail(name: str, expected: str, value, fix: str, *, kind: type = ValidationError):
    raise kind(f"kv-canary: {name} must be {expected}, got {_got(value)}. Fix: {fix}")


def integer(name: str, value, *, lo: int | None = None, hi: int | None = None, fix: str = "") -> int:
    """``value`` as an int in [lo, hi] (an int or numpy integer, not a bool or a float)."""
    span = (f"an integer in [{lo}, {hi}]" if lo is not None and hi is not None else
            f"an integer >= {lo}" if lo is not None else f"an integer <= {hi}" if hi is not None else "an integer")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        fail(name, span, value, fix or f"pass an int, e.g. {name}={lo if lo is not None else 0}",
             kind=ValidationTypeError)
    v = int(value)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        fail(name, span, value, fix or f"pass a value in that range, e.g. {name}={lo if lo is not None else hi}")
    return v


def boolean(name: str, value) -> bool:
    """``value`` as a bool (a bool or numpy bool only: 0/1 and strings are refused)."""
    if isinstance(value, bool) or type(value).__name__ == "bool_":
        return bool(value)
    fail(name, "True or False", value, f"pass {name}=True or {name}=False", kind=ValidationTypeError)


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
             "pass e.g. hash_mode='partial' or kvcanary.HashMode.PARTIAL", kind=ValidationTypeError)
    return choice(name, value, {m.name.lower(): m for m in abi.HashMode})


def path_like(name: str, value) -> str:
    if not isinstance(value, (str, os.PathLike)):
        fail(name, "a path (str or os.PathLike) or a callable", value, "pass a file path or a function",
             kind=ValidationTypeError)
    return os.fspath(value)
