"""Host plans of a sweep (docs/format.md §6 entries the caller names): idle cached slots, their positions and
predecessors, validated before anything is staged. Values are not checked here: a slot or a
predecessor out of range is the verify's to report (a SLOT_OUT_OF_RANGE row), as on the device."""

from __future__ import annotations

import numpy as np

from ..errors import ValidationError, ValidationTypeError

_FIX = "Fix: pass a list or a numpy int64 array (host memory)"


def _host_ints(name: str, values) -> np.ndarray:
    """``values`` as a 1-D int64 host array: a sequence of ints (any integer dtype; empty is fine)."""
    bad = isinstance(values, (str, bytes, dict, set)) or values is None
    a = None
    if not bad:
        try:
            a = np.asarray(values)
        except Exception:  # noqa: BLE001 - e.g. ragged nested sequences
            bad = True
    if bad or a.ndim == 0 or (a.size and a.dtype.kind not in "iu"):
        what = f"{type(values).__name__}" if a is None else f"{type(values).__name__} of dtype {a.dtype}, shape {a.shape}"
        raise ValidationTypeError(f"kv-canary: sweep {name} must be a 1-D sequence of ints, got {what}. {_FIX}")
    if a.ndim != 1:
        raise ValidationError(f"kv-canary: sweep {name} must be a 1-D sequence of ints, got shape {a.shape}. {_FIX}")
    return np.ascontiguousarray(a, np.int64)


def sweep_plan(slots, positions, prev_slots, capacity: int) -> tuple[dict, int]:
    """(plan entry arrays, n) of a sweep: slots, positions and predecessors (-1: chain head) of
    one length <= the sweep plan's capacity."""
    s, p, prev = (_host_ints(n, a) for n, a in (("slots", slots), ("positions", positions), ("prev_slots", prev_slots)))
    n = len(s)
    if not len(p) == len(prev) == n or n > capacity:
        raise ValidationError(f"kv-canary: sweep needs slots, positions and prev_slots of one length <= "
                              f"sweep_capacity ({capacity}), got {len(s)}, {len(p)}, {len(prev)}. Fix: sweep in "
                              f"chunks of at most sweep_capacity slots")
    return {"slot": s, "expected_position": p, "prev_slot": prev,
            "expected_token": np.full(n, -1, np.int64)}, n


def chains_plan(chains) -> tuple[list[int], list[int], list[int]]:
    """(slots, positions, prev_slots) of node chains: each lists the slots of positions 0, 1, ...
    of one cached sequence (e.g. a radix-tree path from the root)."""
    if isinstance(chains, (str, bytes, dict)) or not hasattr(chains, "__iter__"):
        raise ValidationTypeError(f"kv-canary: sweep chains must be an iterable of slot sequences, got "
                                  f"{type(chains).__name__}. Fix: pass e.g. [[slot_pos0, slot_pos1, ...], ...]")
    slots, positions, prev = [], [], []
    for chain in chains:
        chain = [int(x) for x in _host_ints("chain", chain)]
        slots += chain
        positions += range(len(chain))
        prev += [-1] + chain[:-1]
    return slots, positions, prev
