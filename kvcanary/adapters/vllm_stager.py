"""vLLM attention metadata staged on the device in one launch (``kvc_stage_vllm``,
kernels_src/stage.cu): the values of :func:`~.vllm.vllm_batch` (:mod:`.stager` says how a stager
works)."""

from __future__ import annotations

import numpy as np

from .. import abi
from ..errors import ValidationError
from ..interop.arrays import ArrayView
from ..ops.batch import Batch
from ..runtime import memory
from ..validate import integer
from .stager import Stager
from .vllm import step_requests


class VllmBatchStager(Stager):
    """Persistent device buffers of the Batch of one vLLM KV cache group, filled by one launch per
    step from that step's attention metadata (module docstring). ``max_reqs`` / ``max_tokens``
    bound a step's requests and new tokens, ``max_len`` is the width of ``req_to_token`` (each
    request's length must fit; at most the block table's ``max_blocks * block_size``),
    ``block_size`` the cache's tokens per block; the buffers live on ``device``. ``launches``
    counts the staging launches made."""

    KERNEL = "kvc_stage_vllm"
    INPUTS = abi.STAGE_VLLM_INPUTS
    SCALARS = ("num_reqs", "num_tokens")

    def __init__(self, *, max_reqs: int, max_tokens: int, max_len: int, block_size: int, device: int = 0):
        self.max_reqs = integer("max_reqs", max_reqs, lo=1, fix="pass the most requests a step schedules")
        self.max_tokens = integer("max_tokens", max_tokens, lo=1, fix="pass the most tokens a step schedules")
        self.max_len = integer("max_len", max_len, lo=1, fix="pass the longest request length (max_model_len)")
        self.block_size = integer("block_size", block_size, lo=1, fix="pass the cache's tokens per block, e.g. 16")
        super().__init__(device, {"rows": self.max_reqs, "prefix": self.max_reqs, "extend": self.max_reqs,
                                  "ids": self.max_tokens, "pos": self.max_tokens, "loc": self.max_tokens})
        self.req_to_token = memory.zeros((self.max_reqs + 1, self.max_len), np.int32, self.device)

    def __call__(self, *, block_table, seq_lens, query_start_loc, slot_mapping, input_ids, positions,
                 num_reqs: int | None = None, num_tokens: int | None = None, expected_input_ids=None,
                 expected_positions=None, stream=None) -> Batch:
        """The step's Batch (views of the stager's buffers), staged on ``stream``. Arguments as
        :func:`~.vllm.vllm_batch`'s: ``num_reqs`` / ``num_tokens`` trim padded metadata (default:
        the rows of the block table and query starts, the tokens of the three token arrays)."""
        return self._stage((block_table, seq_lens, query_start_loc, slot_mapping, input_ids, positions),
                           (num_reqs, num_tokens), stream, expected_input_ids, expected_positions)

    def _batch(self, s: int, n: int, t: int) -> Batch:
        v, rtt = self._view, self.req_to_token
        table = ArrayView(rtt.ptr, (n + 1, self.max_len), (4 * self.max_len, 4), rtt.dtype, "int32", self.device,
                          False, rtt, s)
        return Batch(v("rows", n, s), v("prefix", n, s), v("extend", n, s), table, input_ids=v("ids", t, s),
                     positions=v("pos", t, s), out_cache_loc=v("loc", t, s))

    def _pack(self, arrays, num_reqs, num_tokens):
        """The validated launch of one metadata layout, and the step's (requests, tokens)."""
        views, wide = self._inputs(arrays, (2, 1, 1, 1, 1, 1))
        bt, seq, qsl, *tok = views
        n = step_requests(bt.shape[0], qsl.shape[0], num_reqs)
        if seq.shape[0] < n:  # as block_table_to_req_to_token refuses it
            raise ValidationError(f"kv-canary: seq_lens must have one length per request (>= {n}), got "
                                  f"{seq.shape[0]}. Fix: pass the seq_lens of the same step")
        have = min(x.shape[0] for x in tok)
        t = have if num_tokens is None else integer("num_tokens", num_tokens, lo=0, hi=have,
                                                    fix=f"pass at most the {have} tokens given")
        self._fits({"requests": (n, "rows"), "tokens": (t, "ids")},
                   "build the VllmBatchStager with the scheduler's max_num_seqs and max_num_batched_tokens")
        if self.max_len > bt.shape[1] * self.block_size:
            raise ValidationError(f"kv-canary: the stager's max_len={self.max_len} exceeds what the block table maps "
                                  f"({bt.shape[1]} blocks x block_size {self.block_size}). Fix: build the stager with "
                                  f"max_len <= {bt.shape[1] * self.block_size}, or pass the full block table")
        b = {k: buf.ptr for k, buf in self.buffers.items()}
        p = abi.StageVllmParams(
            block_table=bt.ptr, seq_lens=seq.ptr, query_start_loc=qsl.ptr, slot_mapping=tok[0].ptr,
            input_ids=tok[1].ptr, positions=tok[2].ptr, rows=b["rows"], prefix_lens=b["prefix"],
            extend_lens=b["extend"], req_to_token=self.req_to_token.ptr, out_input_ids=b["ids"],
            out_positions=b["pos"], out_cache_loc=b["loc"], block_table_stride=bt.strides[0] // bt.itemsize,
            num_reqs=n, num_tokens=t, block_size=self.block_size, max_len=self.max_len, wide=wide)
        launch = self._launch(p, max(n + 1, t, (n + 1) * self.max_len))
        launch.keep = (launch.keep, self.req_to_token)
        return launch, (n, t)
