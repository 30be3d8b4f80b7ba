"""A packed kernel launch, and the K and V halves of a group paired into one (abi.PAIRED).

Built by :mod:`kvcanary.ops.bind` (and the pump, the records copy), replayed by the stages and the
eager ops: replaying one costs one ``cuLaunchKernelEx`` on its device's
:class:`~kvcanary.runtime.devices.DeviceRuntime` (configured by
:func:`kvcanary.runtime.devices.launch_config`). Above the device runtime, whose launcher it binds;
nothing here calls the driver itself.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from .. import abi

if TYPE_CHECKING:  # only its type: a Launch calls the DeviceRuntime it is given
    from .devices import DeviceRuntime


class Launch:
    """A validated, packed kernel launch: replaying it costs one cuLaunchKernelEx.

    Holds the params struct and its pointer array, so both outlive every launch of it. Pointers
    inside are fixed: replay only while the arrays it was built from are alive and unchanged.
    ``go(stream)`` is the bound launch (``DeviceRuntime.launcher``): hot loops call it directly.
    Fields of ``params`` may be changed between launches (the launch copies the struct).
    ``grid_y`` > 1: a paired launch (:func:`paired`), whose params hold one struct per half.
    """

    __slots__ = ("rt", "name", "grid", "grid_y", "block", "params", "_ptrs", "address", "stream", "keep", "go")

    def __init__(self, rt: DeviceRuntime, name: str, grid: int, block: int, params, stream: int, keep=(),
                 grid_y: int = 1):
        self.rt, self.name, self.grid, self.block, self.params, self.stream = rt, name, grid, block, params, stream
        self.grid_y = grid_y
        self._ptrs = (ctypes.c_void_p * 1)(ctypes.addressof(params))
        self.address = ctypes.addressof(self._ptrs)
        self.keep = keep  # the objects owning every pointer in params stay alive with the launch
        self.go = rt.launcher(name, grid, block, self.address, grid_y)

    def __call__(self, stream: int | None = None) -> None:
        self.go(self.stream if stream is None else stream)


def paired(k: Launch, v: Launch) -> Launch | None:
    """One launch running both ``k`` and ``v`` (the K and V halves of a group, each as its own
    launch would run; abi.PAIRED, blockIdx.y picks the half), or None when they cannot share one:
    another kernel or block size, another device or stream, or a kernel with no paired entry point.
    The params are copied: later changes to ``k.params`` or ``v.params`` do not reach it."""
    name = abi.PAIRED.get(k.name)
    if name is None or v.name != k.name or v.block != k.block or v.rt is not k.rt or v.stream != k.stream:
        return None
    p = abi.CTYPES[abi.KERNELS[name]]()
    p.half[0], p.half[1] = k.params, v.params
    return Launch(k.rt, name, max(k.grid, v.grid), k.block, p, k.stream, (k.keep, v.keep), grid_y=abi.HALVES)


def folded(plan: Launch, writes: Launch) -> Launch | None:
    """HEAD's first launch of a small step: the plan builder ``plan`` (kvc_prepare) and the paired
    writes ``writes`` (kvc_write_pair) as one kvc_prepare_write_pair launch, a block per request; or
    None where they cannot share one: other kernels, devices, streams or blocks, or a step past
    abi.FOLD_MAX_BATCH requests or abi.FOLD_MAX_TOKENS new tokens. The params are copied."""
    if plan.name != "kvc_prepare" or writes.name != "kvc_write_pair" or plan.rt is not writes.rt \
            or plan.stream != writes.stream or writes.block != abi.BLOCK_THREADS:
        return None
    q, halves = plan.params, writes.params.half
    # the writes' token count decides the kernel: the plan's is 0 when it was built without out_cache_loc
    tokens = max(q.num_tokens, halves[0].num_tokens, halves[1].num_tokens)
    if q.batch_size > abi.FOLD_MAX_BATCH or tokens > abi.FOLD_MAX_TOKENS:
        return None
    p = abi.PrepareWritePair()
    p.plan[0] = q
    p.half[0], p.half[1] = halves[0], halves[1]
    grid = max(1, min(writes.grid, q.batch_size))
    # a step of at most a warp's new tokens: no request needs the block's path (nor its shared stage)
    name = "kvc_prepare_write_pair_warps" if tokens <= abi.WARP_SIZE else "kvc_prepare_write_pair"
    return Launch(plan.rt, name, grid, abi.BLOCK_THREADS, p, plan.stream, (plan.keep, writes.keep))


def snapshot_target(launch: Launch):
    """The snapshot params a step's last launch takes the pump's snapshot with (a verify's
    ``snap``; a paired launch's half 0's), or None for a kernel that takes none."""
    p = launch.params
    holder = p.half[0] if launch.grid_y > 1 else p
    return holder.snap[0] if hasattr(holder, "snap") else None
