"""An SGLang ``ForwardBatch`` staged on the device in one launch (``kvc_stage_sglang``,
kernels_src/stage.cu): the values of :func:`~.sglang_batch.sglang_batch` without its framework ops
(``seq_lens - 1``, the dtype casts), and the same :class:`~kvcanary.Batch` object for every step
of one shape, so the canary's HEAD and TAIL launches replay without keying the step's tensors.

Per step the stager keys the ForwardBatch's five arrays (and the mode's extend lengths) once, where
a fresh Batch is keyed by both of the canary's stages. Every forward mode of ``sglang_batch`` is
staged; what it does not stage, ``sglang_batch`` still does: the SWA map (``full_to_swa``) and
``--enable-unified-memory``'s translated ids are refused here with that fix.
"""

from __future__ import annotations

from .. import abi
from ..errors import ValidationError
from ..interop.arrays import ArrayView
from ..ops.batch import Batch
from ..ops.checks import checked
from ..ops.packing import layout_key
from ..validate import integer
from .common import require_attr
from .sglang_batch import _FIX, length_rule, req_to_token_source
from .stager import Stager

_ARRAYS = ("req_pool_indices", "seq_lens", "input_ids", "positions", "out_cache_loc")


class SglangBatchStager(Stager):
    """Persistent device buffers of the Batch of one SGLang model runner, filled by one launch per
    step from its ``ForwardBatch``. ``req_to_token``: the ModelRunner (preferred), its
    ``ReqToTokenPool`` or the int32 ``[rows, max_context_len]`` array: the Batch reads it in place.
    ``max_reqs`` / ``max_tokens``: the most requests and new tokens a step carries (the server's
    ``max_running_requests`` and ``chunked_prefill_size`` / ``max_prefill_tokens``); the buffers live
    on ``device``. ``launches`` counts the staging launches made."""

    KERNEL = "kvc_stage_sglang"
    INPUTS = abi.STAGE_SGLANG_INPUTS
    OPTIONAL = frozenset({"extend_seq_lens", "extend_prefix_lens"})
    SCALARS = ("uniform_extend", "seq_includes_new")

    def __init__(self, req_to_token, *, max_reqs: int, max_tokens: int, device: int = 0, kv_index_translator=None):
        max_reqs = integer("max_reqs", max_reqs, lo=1, fix="pass the most requests a step runs (max_running_requests)")
        max_tokens = integer("max_tokens", max_tokens, lo=1, fix="pass the most new tokens a step carries")
        rtt, translator = req_to_token_source(req_to_token, kv_index_translator)
        if translator is not None and getattr(translator, "is_translating", False):
            raise ValidationError("kv-canary: SglangBatchStager stages one id space, got a KVIndexTranslator that "
                                  "translates (--enable-unified-memory). Fix: use sglang_batch(forward_batch, "
                                  "model_runner), which reads the translated index table")
        super().__init__(device, {"rows": max_reqs, "prefix": max_reqs, "extend": max_reqs, "ids": max_tokens,
                                  "pos": max_tokens, "loc": max_tokens})
        self.req_to_token, self._table = rtt, None  # (layout key, address, checked view) of the engine's map

    def __call__(self, forward_batch, *, expected_input_ids=None, expected_positions=None, stream=None) -> Batch:
        """The step's Batch (views of the stager's buffers and of the engine's ``req_to_token``),
        staged on ``stream`` (explicit, else the framework's current one)."""
        fb = forward_batch
        for name in _ARRAYS:
            require_attr(fb, name, "the ForwardBatch", _FIX)
        uniform, ext, pre, counts_new = length_rule(fb)
        self._refresh_table()
        arrays = (*(getattr(fb, k) for k in _ARRAYS), ext, pre)
        return self._stage(arrays, (uniform, int(counts_new)), stream, expected_input_ids, expected_positions)

    def _refresh_table(self) -> None:
        """A checked view of the engine's req_to_token, rebuilt (with the Batches naming it) when
        its layout or address changed since the last step."""
        key = layout_key(self.req_to_token)
        if self._table is not None and self._table[0] == key and key[0] is not None:
            return
        view = checked(self.req_to_token, "req_to_token", dtype="int32", ndim=2)
        if view.device != self.device:
            raise ValidationError(f"kv-canary: req_to_token must live on cuda:{self.device} (the stager's device), got "
                                  f"{view.describe()}. Fix: build the stager with device={view.device}")
        self._table = (key, view)
        self.batches.clear()

    def _batch(self, s: int, n: int, t: int) -> Batch:
        v, rtt = self._view, self._table[1]
        table = ArrayView(rtt.ptr, rtt.shape, rtt.strides, rtt.dtype, rtt.dtype_name, self.device, False,
                          self.req_to_token, s)
        return Batch(v("rows", n, s), v("prefix", n, s), v("extend", n, s), table, input_ids=v("ids", t, s),
                     positions=v("pos", t, s), out_cache_loc=v("loc", t, s))

    def _pack(self, arrays, uniform: int, counts_new: int):
        """The validated launch of one ForwardBatch layout, and the step's (requests, tokens)."""
        views, wide = self._inputs(arrays, (1,) * len(self.INPUTS))
        rows, seq, ids, pos, loc, ext, pre = views
        n = rows.shape[0]
        short = {k: x.shape[0] for k, x in (("seq_lens", seq), ("extend_seq_lens", ext), ("extend_prefix_lens", pre))
                 if x is not None and x.shape[0] < n}
        if short:
            raise ValidationError(f"kv-canary: the ForwardBatch's lengths must have one entry per request (>= {n}), got "
                                  f"{', '.join(f'{k} of {m}' for k, m in short.items())}. Fix: {_FIX}")
        t = ids.shape[0]
        if pos.shape[0] != t or loc.shape[0] != t:
            raise ValidationError(f"kv-canary: input_ids, positions and out_cache_loc must have one entry per new "
                                  f"token, got {t}, {pos.shape[0]} and {loc.shape[0]}. Fix: {_FIX}")
        self._fits({"requests": (n, "rows"), "tokens": (t, "ids")},
                   "build the SglangBatchStager with the server's max_running_requests and max tokens per step")
        b = {k: buf.ptr for k, buf in self.buffers.items()}
        p = abi.StageSglangParams(
            req_pool_indices=rows.ptr, seq_lens=seq.ptr, input_ids=ids.ptr, positions=pos.ptr, out_cache_loc=loc.ptr,
            extend_seq_lens=0 if ext is None else ext.ptr, extend_prefix_lens=0 if pre is None else pre.ptr,
            rows=b["rows"], prefix_lens=b["prefix"], extend_lens=b["extend"], out_input_ids=b["ids"],
            out_positions=b["pos"], out_loc=b["loc"], num_reqs=n, num_tokens=t, uniform_extend=uniform,
            seq_includes_new=counts_new, wide=wide)
        return self._launch(p, max(n, t)), (n, t)
