"""A simulated paged-KV serving engine, fault injectors for the classes K1-K13 of FAULTS.md and
a campaign runner that measures what the canary catches (``python -m kvcanary demo``)."""

from .engine import Engine, NoFault
from .state import SimConfig

__all__ = ["Engine", "NoFault", "SimConfig"]
