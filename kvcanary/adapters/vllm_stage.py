"""vLLM attention metadata staged on the device into persistent Batch buffers: one launch per step.

:func:`~.vllm.vllm_batch` turns a step's metadata into a :class:`~kvcanary.Batch` with about a dozen
framework ops (the block table expanded into ``req_to_token``, the lengths subtracted, the token
arrays cast), each a launch of its own and new tensors every step, which the canary must then key
and patch into its launches. :class:`VllmBatchStager` does the same in one kernel
(kernels_src/stage.cu) into buffers it owns, and hands back the same Batch object for every step of
one shape (number of requests and of tokens): the canary's launches then replay without keying its
arrays, and a captured CUDA graph keeps every address. The values are :func:`~.vllm.vllm_batch`'s
(with ``max_len`` the stager's), byte for byte.

Per call: the six metadata arrays are keyed (layout and address, as the canary keys a Batch),
validated once per layout (an int32 or int64 integer array on the stager's device; the 1-D ones
contiguous, the block table's rows too; extents that cover what the kernel reads), and the packed
launch replayed with their addresses on the caller's stream (explicit, else the framework's
current stream). Nothing is read back to the host. Values are not checked: a wrong length or block
id becomes a wrong slot in the Batch, which the canary bound-checks and reports.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .. import abi, driver, memory, streams
from ..arrays import ArrayView, as_view
from ..errors import ValidationError, ValidationTypeError
from ..launch import Launch
from ..packing import PackCache, arg_keys
from ..plan import Batch
from ..sources import resolved
from ..validate import integer

INPUTS = ("block_table", "seq_lens", "query_start_loc", "slot_mapping", "input_ids", "positions")
LAYOUTS_KEPT = 64  # packed launches kept (one per distinct metadata layout: batch sizes vary per step)
_INT = (np.dtype(np.int32), np.dtype(np.int64))


class VllmBatchStager:
    """Persistent int64 / int32 device buffers of the Batch of one vLLM KV cache group, filled by
    one launch per step from that step's attention metadata (see the module docstring).

    ``max_reqs`` / ``max_tokens`` bound a step's requests and new tokens, ``max_len`` is the width
    of ``req_to_token`` (each request's length must fit; at most the block table's ``max_blocks *
    block_size``), ``block_size`` the cache's tokens per block; the buffers live on ``device``.
    ``launches`` counts the staging launches made."""

    def __init__(self, *, max_reqs: int, max_tokens: int, max_len: int, block_size: int, device: int = 0):
        self.max_reqs = integer("max_reqs", max_reqs, lo=1, fix="pass the most requests a step schedules")
        self.max_tokens = integer("max_tokens", max_tokens, lo=1, fix="pass the most tokens a step schedules")
        self.max_len = integer("max_len", max_len, lo=1, fix="pass the longest request length (max_model_len)")
        self.block_size = integer("block_size", block_size, lo=1, fix="pass the cache's tokens per block, e.g. 16")
        self.device = integer("device", device, lo=0, fix="pass a CUDA device ordinal")
        self.rt = driver.runtime(self.device)
        z = memory.zeros
        self.rows, self.prefix, self.extend = (z((self.max_reqs,), np.int64, self.device) for _ in range(3))
        self.req_to_token = z((self.max_reqs + 1, self.max_len), np.int32, self.device)
        self.ids, self.pos, self.loc = (z((self.max_tokens,), np.int64, self.device) for _ in range(3))
        self.packed = PackCache(LAYOUTS_KEPT)
        self.batches: OrderedDict = OrderedDict()  # (requests, tokens) -> the Batch of views
        self.launches = 0

    def __call__(self, *, block_table, seq_lens, query_start_loc, slot_mapping, input_ids, positions,
                 num_reqs: int | None = None, num_tokens: int | None = None, expected_input_ids=None,
                 expected_positions=None, stream=None) -> Batch:
        """The step's Batch (views of the stager's buffers), staged on ``stream``. Arguments as
        :func:`~.vllm.vllm_batch`'s: ``num_reqs`` / ``num_tokens`` trim padded metadata (default:
        the rows of the block table and query starts, the tokens of the three token arrays)."""
        arrays = (block_table, seq_lens, query_start_loc, slot_mapping, input_ids, positions)
        key, ptrs, _ = arg_keys((*arrays, num_reqs, num_tokens))
        with self.packed.lock:  # a replay patches the shared params: patch and launch under it
            entry = None if key is None else self.packed.get(key, ptrs)
            if entry is None:
                launch, shape = self._pack(arrays, num_reqs, num_tokens)
                if key is None:  # not keyable: validated and packed every call
                    return self._go(launch, shape, arrays, stream, expected_input_ids, expected_positions)
                entry = self.packed.put(key, [launch], (*arrays, num_reqs, num_tokens), ptrs,
                                        (*INPUTS, "num_reqs", "num_tokens"), extra=shape)
            return self._go(entry.launches[0], entry.extra, arrays, stream, expected_input_ids, expected_positions)

    def _go(self, launch, shape, arrays, stream, expected_input_ids, expected_positions) -> Batch:
        s = streams.stream_handle(stream) if stream is not None else streams.framework_stream(arrays, self.device)
        launch.go(driver.PER_THREAD_STREAM if s is None else s)
        self.launches += 1
        batch = self.batches.get(shape)
        if batch is None:
            batch = self.batches[shape] = self._batch(*shape)
            while len(self.batches) > LAYOUTS_KEPT:
                self.batches.popitem(last=False)
        if expected_input_ids is None and expected_positions is None:
            return batch
        return Batch(**{**batch.__dict__, "expected_input_ids": expected_input_ids,
                        "expected_positions": expected_positions})

    def _view(self, buf, shape) -> ArrayView:
        itemsize = buf.dtype.itemsize
        strides = (self.max_len * itemsize, itemsize) if len(shape) == 2 else (itemsize,)
        return ArrayView(buf.ptr, shape, strides, buf.dtype, buf.dtype.name, self.device, False, buf)

    def _batch(self, n: int, t: int) -> Batch:
        v = self._view
        return Batch(v(self.rows, (n,)), v(self.prefix, (n,)), v(self.extend, (n,)),
                     v(self.req_to_token, (n + 1, self.max_len)), input_ids=v(self.ids, (t,)),
                     positions=v(self.pos, (t,)), out_cache_loc=v(self.loc, (t,)))

    def _pack(self, arrays, num_reqs, num_tokens):
        """The validated launch of one metadata layout, and the step's (requests, tokens)."""
        views = [resolved(as_view(a, name=name)) for a, name in zip(arrays, INPUTS)]
        wide = 0
        for i, (v, name) in enumerate(zip(views, INPUTS)):
            want = 2 if i == abi.STAGE_BLOCK_TABLE else 1
            if v.dtype not in _INT or v.dtype_name not in ("int32", "int64"):
                raise ValidationTypeError(f"kv-canary: {name} must be int32 or int64, got {v.dtype_name}. Fix: pass "
                                          f"the attention metadata's own {name}")
            if v.ndim != want or v.strides[-1] != v.itemsize:
                raise ValidationError(f"kv-canary: {name} must be a {want}-D array with contiguous "
                                      f"{'rows' if want == 2 else 'elements'}, got shape {v.shape}, strides "
                                      f"{v.strides}. Fix: pass the metadata's {name} (or .contiguous())")
            if v.device != self.device:
                raise ValidationError(f"kv-canary: {name} must live on cuda:{self.device} (the stager's device), "
                                      f"got {v.describe()}. Fix: build the stager with device={v.device}")
            wide |= int(v.itemsize == 8) << i
        bt, seq, qsl, *tok = views
        if qsl.shape[0] < 1:
            raise ValidationError("kv-canary: query_start_loc must hold num_reqs + 1 offsets (at least the leading 0), "
                                  "got an empty array. Fix: pass the metadata's query_start_loc")
        rows = min(bt.shape[0], seq.shape[0], qsl.shape[0] - 1)
        n = rows if num_reqs is None else integer("num_reqs", num_reqs, lo=0, hi=max(rows, 0),
                                                  fix=f"pass at most the {rows} requests the metadata holds")
        have = min(x.shape[0] for x in tok)
        t = have if num_tokens is None else integer("num_tokens", num_tokens, lo=0, hi=have,
                                                    fix=f"pass at most the {have} tokens given")
        if n > self.max_reqs or t > self.max_tokens:
            raise ValidationError(f"kv-canary: a step of {n} requests and {t} tokens does not fit the stager "
                                  f"(max_reqs={self.max_reqs}, max_tokens={self.max_tokens}). Fix: build the "
                                  f"VllmBatchStager with the scheduler's max_num_seqs and max_num_batched_tokens")
        if self.max_len > bt.shape[1] * self.block_size:
            raise ValidationError(f"kv-canary: the stager's max_len={self.max_len} exceeds what the block table maps "
                                  f"({bt.shape[1]} blocks x block_size {self.block_size}). Fix: build the stager with "
                                  f"max_len <= {bt.shape[1] * self.block_size}, or pass the full block table")
        p = abi.StageVllmParams(
            block_table=bt.ptr, seq_lens=seq.ptr, query_start_loc=qsl.ptr, slot_mapping=tok[0].ptr,
            input_ids=tok[1].ptr, positions=tok[2].ptr, rows=self.rows.ptr, prefix_lens=self.prefix.ptr,
            extend_lens=self.extend.ptr, req_to_token=self.req_to_token.ptr, out_input_ids=self.ids.ptr,
            out_positions=self.pos.ptr, out_cache_loc=self.loc.ptr, block_table_stride=bt.strides[0] // bt.itemsize,
            num_reqs=n, num_tokens=t, block_size=self.block_size, max_len=self.max_len, wide=wide)
        work = max(n + 1, t, (n + 1) * self.max_len)
        grid = max(1, min(self.rt.resident_blocks("kvc_stage_vllm", abi.BLOCK_THREADS),
                          -(-work // abi.BLOCK_THREADS)))
        keep = (self.rows, self.prefix, self.extend, self.req_to_token, self.ids, self.pos, self.loc)
        return Launch(self.rt, "kvc_stage_vllm", grid, abi.BLOCK_THREADS, p, driver.PER_THREAD_STREAM, keep), (n, t)
