"""An engine's step staged on the device into persistent Batch buffers: one launch per step
(kernels_src/stage.cu) instead of an adapter's framework ops.

An adapter that builds the canary's :class:`~kvcanary.Batch` with framework ops pays a launch's
host time for each and hands the canary new tensors every step to key. A stager does the same in
one kernel into buffers it owns and hands back the same Batch object for every step of one shape,
so the canary's launches replay without keying and a captured CUDA graph keeps every address. The
Batch's views name the stream the step was staged on (a canary step given no stream runs there).

- :class:`~.vllm_stager.VllmBatchStager`: vLLM attention metadata, the values of :func:`~.vllm.vllm_batch`;
- :class:`~.paged_stager.PagedBatchStager`: cumulative query / key lengths and physical cache indices
  (transformers continuous batching), the values of :class:`~.transformers_batch.StepBatches`' torch path;
- :class:`~.sglang_stager.SglangBatchStager`: an SGLang ForwardBatch, the values of :func:`~.sglang_batch.sglang_batch`.

Per call the engine's arrays are keyed (layout and address), validated once per layout (int32 or
int64, on the stager's device, contiguous, covering what the kernel reads) and the packed launch
replayed with their addresses on the caller's stream (explicit, else the framework's current one).
Nothing is read back to the host; values are not checked: a wrong length or index becomes a wrong
slot in the Batch, which the canary bound-checks and reports.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .. import abi
from ..errors import ValidationError, ValidationTypeError
from ..interop.arrays import ArrayView, as_view
from ..ops.batch import Batch
from ..ops.packing import KEPT, PackCache, arg_keys
from ..ops.sources import resolved
from ..runtime import devices, driver, memory, streams
from ..runtime.launch import Launch
from ..validate import integer

_INT = ("int32", "int64")


class Stager:
    """The keying, packing and replay of one staging kernel into int64 buffers it owns."""

    KERNEL = ""
    INPUTS: tuple[str, ...] = ()
    OPTIONAL: frozenset = frozenset()  # inputs that may be None (a NULL pointer for the kernel)
    SCALARS: tuple[str, ...] = ()

    def __init__(self, device: int, sizes: dict):
        self.device = integer("device", device, lo=0, fix="pass a CUDA device ordinal")
        self.rt = devices.runtime(self.device)
        self.rt.functions.library(abi.family_of(self.KERNEL))  # loaded now, never in a stream capture of a step
        self.buffers = {name: memory.zeros((n,), np.int64, self.device) for name, n in sizes.items()}
        self.packed = PackCache(KEPT)
        self._views = None  # the ArrayViews of the arrays the last _pack validated
        self.batches: OrderedDict = OrderedDict()  # the shape of a step -> its Batch of views
        self.launches = 0

    def _stage(self, arrays, scalars, stream, expected_input_ids=None, expected_positions=None) -> Batch:
        objs = (*arrays, *scalars)
        key, ptrs, _ = arg_keys(objs)
        with self.packed.lock:  # a replay patches the shared params: patch and launch under it
            entry = None if key is None else self.packed.get(key, ptrs)
            if entry is None:
                self._views = None
                launch, shape = self._pack(arrays, *scalars)
                if key is not None:  # else not keyable: validated and packed every call
                    self.packed.put(key, [launch], objs, ptrs, (*self.INPUTS, *self.SCALARS), extra=shape,
                                    views=self._views)
            else:
                launch, shape = entry.launches[0], entry.extra
            s = streams.stream_handle(stream) if stream is not None else streams.framework_stream(arrays, self.device)
            s = driver.PER_THREAD_STREAM if s is None else s
            launch.go(s)
            self._launched(shape, s)
            self.launches += 1
        key = (self._batch_key(shape), s)
        batch = self.batches.get(key)
        if batch is None:  # its views name the stream: a canary step given no stream runs there too
            batch = self.batches[key] = self._batch(s, *shape)
            while len(self.batches) > KEPT:
                self.batches.popitem(last=False)
        if expected_input_ids is None and expected_positions is None:
            return batch
        return Batch(**{**batch.__dict__, "expected_input_ids": expected_input_ids,
                        "expected_positions": expected_positions})

    def _view(self, name: str, n: int, stream: int) -> ArrayView:
        buf = self.buffers[name]
        return ArrayView(buf.ptr, (n,), (8,), buf.dtype, buf.dtype.name, self.device, False, buf, stream)

    def _inputs(self, arrays, ndims) -> tuple[list[ArrayView], int]:
        """The validated views of the engine's arrays and the kernel's int64 bit mask."""
        views, wide = [], 0
        for i, (a, name, want) in enumerate(zip(arrays, self.INPUTS, ndims)):
            if a is None and name in self.OPTIONAL:
                views.append(None)
                continue
            v = resolved(as_view(a, name=name))
            if v.dtype_name not in _INT:
                raise ValidationTypeError(f"kv-canary: {name} must be int32 or int64, got {v.dtype_name}. Fix: pass "
                                          f"the engine's own {name}")
            if v.ndim != want or (v.numel and v.strides[-1] != v.itemsize):
                raise ValidationError(f"kv-canary: {name} must be a {want}-D array with contiguous "
                                      f"{'rows' if want == 2 else 'elements'}, got shape {v.shape}, strides "
                                      f"{v.strides}. Fix: pass the engine's {name} (or .contiguous())")
            if v.device != self.device:
                raise ValidationError(f"kv-canary: {name} must live on cuda:{self.device} (the stager's device), "
                                      f"got {v.describe()}. Fix: build the stager with device={v.device}")
            views.append(v)
            wide |= int(v.itemsize == 8) << i
        self._views = views  # the packed entry's bounds come from these (no second conversion)
        return views, wide

    def _launch(self, params, work: int) -> Launch:
        grid = max(1, min(self.rt.resident_blocks(self.KERNEL, abi.BLOCK_THREADS), -(-work // abi.BLOCK_THREADS)))
        return Launch(self.rt, self.KERNEL, grid, abi.BLOCK_THREADS, params, driver.PER_THREAD_STREAM,
                      tuple(self.buffers.values()))

    def _fits(self, what: dict, fix: str) -> None:
        over = {k: (n, self.buffers[b].shape[0]) for k, (n, b) in what.items() if n > self.buffers[b].shape[0]}
        if over:
            got = ", ".join(f"{k}={n} (capacity {cap})" for k, (n, cap) in over.items())
            raise ValidationError(f"kv-canary: a step of {got} does not fit the {type(self).__name__}. Fix: {fix}")

    def _batch_key(self, shape) -> tuple:
        """What tells a step's Batch apart (its shape: one Batch of views per shape)."""
        return shape

    def _launched(self, shape, stream: int) -> None:
        """After the step's launch was enqueued on ``stream`` (a stager may enqueue more there)."""

    def _batch(self, stream: int, *shape) -> Batch:
        raise NotImplementedError

    def _pack(self, arrays, *scalars):
        raise NotImplementedError
