"""The launches of a canary's HEAD and TAIL stages (docs/format.md §6-§8): which ops a stage runs
for each pool group and half, packed once per batch layout and replayed with each step's
addresses (:mod:`kvcanary.ops.packing`), the K and V halves paired into one launch where the device allows.
"""

from __future__ import annotations

from operator import is_
from typing import Any, NamedTuple

from .. import abi
from ..errors import ValidationError
from ..ops.batch import BATCH_FIELD_NAMES, Batch
from ..ops.bind import bind_build_plan, bind_fused_verify, bind_verify, bind_write
from ..ops.packing import PackCache, arg_keys
from .assembly import STAGES, Key

# Packed launch sets kept per stage, one per distinct batch layout: an engine's batch size takes many
# values (vLLM captures CUDA graphs for 67 sizes by default; eager, any size up to max_num_seqs), and
# a layout dropped is validated and packed again when it returns (about 0.1-0.3 ms of host time).
LAYOUTS_KEPT = 128


class _Hot(NamedTuple):
    """A stage's last step whose batch fields were all packing.IMMUTABLE: those very objects replay
    their packed launches without a key."""

    fields: tuple
    packed: Any


class StageLaunches:
    """The step launches of a canary built from ``parts`` (an :class:`~kvcanary.manager.assembly.Parts`).
    ``launched`` counts the kernel launches made (captures included)."""

    def __init__(self, parts):
        self.groups, self.ctx, self.plans, self.head_ctx = parts.groups, parts.ctx, parts.plans, parts.head_ctx
        self.backend, self.fused, self.check_expected_token = parts.backend, parts.config.fused, \
            parts.config.check_expected_token
        self.packed = {st: PackCache(LAYOUTS_KEPT) for st in STAGES}  # layout key -> launches, per stage
        self.held = {st: None for st in STAGES}  # the last step's batch fields, per stage
        self.hot: dict[str, _Hot | None] = {st: None for st in STAGES}
        self.launched = 0

    def run(self, batch: Batch, stage: str, stream, end=None) -> bool:
        """Enqueue (or, on the host, run) ``stage`` on ``stream``; False when the stream is being
        captured into a CUDA graph (the launches then run only when the graph is replayed). ``end``:
        the step ends here and its last launch takes the pump's snapshot (backends' ``run_stage``)."""
        return self.backend.run_stage(self, batch, stage, stream, end)

    def launches(self, batch: Batch, stage: str, stream) -> list:
        """The stage's packed launches for this batch: validated and packed once per array layout
        (shapes, strides, dtypes, devices, scalars, which fields alias: :mod:`kvcanary.ops.packing`), then
        replayed with the current arrays' addresses patched into their params (an engine hands
        over new tensors every step). Keyed per call: a tensor may change in place (``set_``,
        ``resize_``); only a step of the very objects of the last one, all of them arrays kvcanary
        made (DeviceArray, ArrayView: fixed for life) or numbers, replays without a key."""
        fields = tuple(batch.__dict__.values())
        hot = self.hot[stage]
        if hot is not None and len(fields) == len(hot.fields) and all(map(is_, fields, hot.fields)):
            return hot.packed.launches  # the very immutable arrays of the stage's last step
        key, ptrs, fixed = arg_keys(fields)
        self.hot[stage] = None
        self.held[stage] = fields  # the last step's arrays stay alive until the next step of the stage
        if key is None:  # an array that cannot be keyed cheaply: validated and packed every step
            return self.pack(batch, stage, stream)
        cache = self.packed[stage]
        entry = cache.get(key, ptrs)
        if entry is None:
            launches = self.pack(batch, stage, stream)
            entry = cache.put(key, launches, fields, ptrs, BATCH_FIELD_NAMES)
        if fixed:  # every field IMMUTABLE: identity proves their layout and address
            self.hot[stage] = _Hot(fields, entry)
        return entry.launches

    def pack(self, batch: Batch, stage: str, stream) -> list:
        """The launches of one stage for this batch's array layout (validated here, once per
        layout). They hold no reference to the batch's arrays: a later batch with the same layout
        replays them on its own arrays (same addresses)."""
        out = []
        for g, grp in self.groups.items():
            plan = self.plans[g]
            swa = dict(swa_window=grp.window, swa_map=grp.full_to_swa) if g == "SWA" else {}
            build = None
            if stage == "HEAD":  # the step's first build resets its request verdicts (docs/format.md §5.7)
                build = bind_build_plan(batch, plan, ctx=self.head_ctx[g], reset_verdicts=g == next(iter(self.groups)),
                                        **swa)
            loc = batch.swa_out_cache_loc if g == "SWA" else batch.out_cache_loc
            if loc is None:
                raise ValidationError(f"kv-canary: batch.{'swa_' if g == 'SWA' else ''}out_cache_loc must be given "
                                      f"to stamp the {g} group, got None. Fix: pass the new tokens' slots")
            halves = grp.resolved_halves()
            first = self.ctx[Key("HEAD", g, halves[0], "write")]  # runs the step's serial chain
            # A device pairs the halves' writes into one launch and their verifies into another
            # (blockIdx.y the half): HEAD's halves then stamp side by side, each running the chain itself.
            pair = len(halves) == abi.HALVES
            bound = []
            for h in halves:  # stamp first, then verify: a new token stamped over a slot that
                # another request still reads (premature free, a draft landing in a committed slot) is
                # then caught by this very stage, before the forward reads it (HEAD) or right after (TAIL)
                vctx, wctx = self.ctx[Key(stage, g, h, "verify")], self.ctx[Key(stage, g, h, "write")]
                chain = None if wctx is first or (pair and stage == "HEAD") else first
                write = bind_write(wctx, plan, batch.input_ids, batch.positions, loc, chain_from=chain,
                                   expected_input_ids=batch.expected_input_ids,
                                   expected_positions=batch.expected_positions)
                if self.fused:
                    verify = bind_fused_verify(vctx, batch, plan, check_expected_token=self.check_expected_token, **swa)
                else:
                    verify = bind_verify(vctx, plan, check_expected_token=self.check_expected_token, per_request=True)
                bound.append((write, verify))
            # a device may fold a small step's build into HEAD's first launch (backends' prepare_head)
            out += self.backend.prepare_halves(bound, stream) if build is None else \
                self.backend.prepare_head(build, bound, stream)
        return out

    def per_step(self) -> int:
        """Launches of both stages for the batch layout each stage packed last (0 before any)."""
        return sum(len(next(reversed(c.entries.values())).launches) for c in self.packed.values() if c.entries)
