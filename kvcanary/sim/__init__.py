"""A simulated paged-KV serving engine that drives a KvCanary through its public step API, fault
injectors for the classes K1-K14 and K5b of FAULTS.md, and the campaign that measures what the canary
catches (``python -m kvcanary demo``).

- :mod:`.engine` — the engine (:class:`Engine`), :mod:`.prefix_cache` — allocation, prefix cache,
  host tier, sweeps; :mod:`.kvpool` — KV tensors and the model's deterministic KV bytes;
  :mod:`.data` — plain data.
- :mod:`.faults`, :mod:`.faults_step`, :mod:`.faults_kv`, :mod:`.faults_write` — one injector per class, and the
  coverage table (which hash mode can see which class).
- :mod:`.campaign` — injections; :mod:`.clean` — clean runs; :mod:`.workers` — their worker
  processes; :mod:`.output` — table, JSON, heat map; :mod:`.merge` — campaigns run in parts.
"""

from .data import SimConfig
from .engine import Engine, NoFault

__all__ = ["Engine", "NoFault", "SimConfig"]
