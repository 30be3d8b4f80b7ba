"""A canary's settings, checked once: :class:`CanaryConfig`. ``KvCanary(full, swa, config=...)``
takes one, or its fields as keyword arguments of the same names (which override the config's).
The built canary's parts carry the config, never the keywords again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from . import abi
from .errors import ValidationError, ValidationTypeError
from .ops.batch import MAX_BATCH_LIMIT
from .ops.state import RING_CAPACITY_LIMIT
from .reporting.outputs import MODES
from .validate import INT32_MAX, boolean, choice, integer
from .validate import device as check_device
from .validate import hash_mode as parse_hash_mode


@dataclass(frozen=True)
class CanaryConfig:
    """Everything about a :class:`~kvcanary.KvCanary` but its pools (docs/engines/custom.md, the step API; each argument error names the field and the fix).

    ``device``: None (host arrays, the CPU reference) or a CUDA ordinal; ``hash_mode``: how much of
    each real-KV strip is fingerprinted (none / partial / all, kept as :class:`~kvcanary.abi.HashMode`);
    ``mode``: none / log / raise / fail_request; ``max_batch``: requests per step; ``verify_capacity``
    and ``sweep_capacity``: cached entries a step and a sweep verify at most; ``ring_capacity``:
    violation rows kept between polls; ``check_expected_token``, ``chain_position_assert``: the
    optional checks; ``fused``: derive verify entries on the fly (else a materialised plan);
    ``stats_every``, ``self_test_every``, ``fingerprint_every``: every N steps (0: off; 1: every
    step); ``export``: a path or a callable taking each record."""

    device: int | None = None
    hash_mode: Any = "partial"
    mode: str = "log"
    max_batch: int = 256
    verify_capacity: int = 1 << 20
    ring_capacity: int = abi.DEFAULT_RING_CAPACITY
    sweep_capacity: int = 1 << 16
    check_expected_token: bool = False
    chain_position_assert: bool = False
    fused: bool = True
    stats_every: int = 0
    self_test_every: int = 0
    fingerprint_every: int = 1
    export: Any = None

    def __post_init__(self):
        set_ = object.__setattr__  # frozen: the checked values replace the given ones once, here
        set_(self, "device", check_device("device", self.device))
        set_(self, "hash_mode", parse_hash_mode(self.hash_mode))
        choice("mode", self.mode, MODES)
        integer("max_batch", self.max_batch, lo=1, hi=MAX_BATCH_LIMIT)
        integer("verify_capacity", self.verify_capacity, lo=1, hi=INT32_MAX)
        integer("ring_capacity", self.ring_capacity, lo=1, hi=RING_CAPACITY_LIMIT)
        integer("sweep_capacity", self.sweep_capacity, lo=1, hi=INT32_MAX)
        integer("stats_every", self.stats_every, lo=0)
        integer("self_test_every", self.self_test_every, lo=0, hi=INT32_MAX,
                fix="pass 0 (off) or the number of steps between self-tests, e.g. 1000")
        integer("fingerprint_every", self.fingerprint_every, lo=1, hi=INT32_MAX,
                fix="pass 1 (every cached token's KV every step) or N (a rotating 1/N per step, e.g. 8)")
        for name in ("check_expected_token", "chain_position_assert", "fused"):
            set_(self, name, boolean(name, getattr(self, name)))
        if self.fingerprint_every > 1 and not self.fused:
            raise ValidationError(f"kv-canary: fingerprint_every={self.fingerprint_every} needs the fused verify, "
                                  f"got fused=False. Fix: pass fused=True (the default), or fingerprint_every=1")

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def of(cls, config: CanaryConfig | None, settings: dict) -> CanaryConfig:
        """``config`` (default: the defaults) with ``settings`` (field -> value) applied, checked."""
        if config is not None and not isinstance(config, cls):
            raise ValidationTypeError(f"kv-canary: KvCanary(config=) must be a kvcanary.CanaryConfig, got "
                                      f"{type(config).__name__}. Fix: pass CanaryConfig(...) or its fields as keywords")
        unknown = sorted(set(settings) - set(cls.names()))
        if unknown:
            raise ValidationTypeError(f"kv-canary: KvCanary got unknown settings {unknown}. Fix: use the fields of "
                                      f"kvcanary.CanaryConfig: {', '.join(cls.names())}")
        if config is None:
            return cls(**settings)
        return dataclasses.replace(config, **settings) if settings else config
