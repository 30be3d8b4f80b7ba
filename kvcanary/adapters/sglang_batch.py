"""The per-step :class:`~kvcanary.Batch` of an SGLang ``ForwardBatch``, for every forward mode.

Lengths per ``forward_batch.forward_mode`` (SGLang's ``ForwardMode``, read by member name):

- ``DECODE`` / ``IDLE``: one new token per request, prefix ``seq_lens - 1``;
- ``TARGET_VERIFY`` (speculative decoding): ``extend_seq_lens`` is None; each request writes
  ``spec_info.draft_token_num`` draft tokens after a prefix of ``seq_lens`` (SGLang assigns the
  drafts' slots in ``req_to_token[seq_lens : seq_lens + draft_token_num]`` without bumping
  ``seq_lens``). Chain drafts only (``spec_info.topk == 1``): a token tree has no single order to
  chain, so ``topk > 1`` is refused;
- ``DRAFT_EXTEND_V2``: ``extend_seq_lens`` new tokens after ``seq_lens - extend_seq_lens``;
- ``EXTEND`` / ``MIXED`` / ``SPLIT_PREFILL``: ``extend_prefix_lens`` and ``extend_seq_lens``.

Two id spaces: under ``--enable-unified-memory`` ``ForwardBatch.init_new`` rebinds
``out_cache_loc`` to kernel-facing ids (``KVIndexTranslator.rebind_write_loc``) while
``req_to_token`` keeps virtual ids. Pass the model runner (or its ``kv_index_translator``): the
cached slots are then read from the translator's index table, in the kernel-facing ids the pool
tensors are indexed with, so writes and reads are compared in one space.
"""

from __future__ import annotations

from ..errors import ValidationError
from ..ops.batch import Batch
from ..validate import integer
from .common import (arange, astype, framework, full_like, kept_tensors, require_attr, where, zeros)

_FIX = "pass the ForwardBatch the model runner forwards (SGLang's forward_batch_info.ForwardBatch)"
_EXTEND_MODES = ("EXTEND", "MIXED", "SPLIT_PREFILL")


def _ones(seq):
    """A decode step's extend lengths: int64 ones like ``seq``, a kept tensor for torch (one launch
    less per step)."""
    if framework(seq) != "torch":
        return full_like(seq, 1)
    return kept_tensors(seq.device, ("ones", int(seq.shape[0])), lambda: full_like(seq, 1))


def length_rule(fb) -> tuple[int, object, object, bool]:
    """How ``fb``'s forward mode gives each request's lengths (see the module docstring): (a uniform
    extend, 0 when ``extend_seq_lens`` gives it per request; ``extend_seq_lens`` or None;
    ``extend_prefix_lens`` or None; whether ``seq_lens`` counts the step's new tokens, so that
    prefix = seq_lens - extend where no prefix array is given). Reads shapes and attributes only."""
    mode = require_attr(fb, "forward_mode", "the ForwardBatch", _FIX)
    name = getattr(mode, "name", str(mode))
    if name in ("DECODE", "IDLE"):
        return 1, None, None, True
    if name == "TARGET_VERIFY":
        spec = require_attr(fb, "spec_info", "a TARGET_VERIFY ForwardBatch", _FIX)
        what = f"the TARGET_VERIFY spec_info ({type(spec).__name__})"
        drafts = integer("spec_info.draft_token_num", require_attr(spec, "draft_token_num", what,
                                                                   "pass an EagleVerifyInput-style spec_info"),
                         lo=1, fix="pass the EagleVerifyInput the verify step runs with")
        topk = getattr(spec, "topk", 1)
        if topk is not None and integer("spec_info.topk", topk, lo=1, fix="pass the spec_info of the step") > 1:
            raise ValidationError(f"kv-canary: TARGET_VERIFY needs chain drafts (topk=1: one token order per request "
                                  f"for the hash chain), got tree drafts (spec_info.topk={topk}); "
                                  f"fix: --speculative-eagle-topk 1, or run the canary on non-verify steps only")
        bs, tokens = int(fb.req_pool_indices.shape[0]), int(fb.input_ids.shape[0])
        if tokens != bs * drafts:
            raise ValidationError(f"kv-canary: a TARGET_VERIFY batch of {bs} requests x draft_token_num={drafts} "
                                  f"should carry {bs * drafts} tokens, got {tokens} input_ids; fix: {_FIX}")
        return drafts, None, None, False
    ext = getattr(fb, "extend_seq_lens", None)
    if name == "DRAFT_EXTEND_V2" or name in _EXTEND_MODES:
        if ext is None:
            raise ValidationError(f"kv-canary: a {name} ForwardBatch must carry extend_seq_lens, got None; fix: {_FIX}")
        return 0, ext, None if name == "DRAFT_EXTEND_V2" else getattr(fb, "extend_prefix_lens", None), True
    raise ValidationError(f"kv-canary: forward_mode {name} is not a mode the canary checks (expected DECODE, IDLE, "
                          f"TARGET_VERIFY, DRAFT_EXTEND_V2, {', '.join(_EXTEND_MODES)}; got {name}); fix: run the "
                          f"canary only on batches that write KV through the model")


def _lengths(fb, seq):
    """(prefix_lens, extend_lens) int64 of ``fb`` on its device, by :func:`length_rule`."""
    uniform, ext, pre, counts_new = length_rule(fb)
    if uniform:
        extend = _ones(seq) if uniform == 1 else full_like(seq, uniform)
        return (seq - uniform if counts_new else seq), extend
    extend = astype(ext, "int64")
    return (seq - extend if pre is None else astype(pre, "int64")), extend


def req_to_token_source(req_to_token, translator):
    """(the int32 req_to_token array, the KVIndexTranslator or None) from a ModelRunner, a
    ReqToTokenPool or the array itself."""
    if hasattr(req_to_token, "req_to_token_pool"):  # a ModelRunner
        if translator is None:
            translator = getattr(req_to_token, "kv_index_translator", None)
        req_to_token = req_to_token.req_to_token_pool
    return getattr(req_to_token, "req_to_token", req_to_token), translator


def _translated_rows(table, bs: int):
    """int32 [bs + 1, width * page] kernel-facing slots of each batch lane (row b + 1) from a
    KVIndexTable: ``entry * entry_page_size + pos % entry_page_size``; entry 0 (padding) stays 0."""
    ids, rows = require_attr(table, "ids", "the KVIndexTable", _FIX), require_attr(table, "row_ids", "the KVIndexTable",
                                                                                   _FIX)
    page = int(require_attr(table, "entry_page_size", "the KVIndexTable", _FIX))
    width = int(ids.shape[1]) * page
    pos = arange(ids, 0, width)
    entry = astype(ids[astype(rows, "int64")[:bs]][:, pos // page], "int64")
    slots = where(entry == 0, entry, entry * page + pos % page)
    out = zeros(ids, (bs + 1, width), "int32")
    out[1:] = astype(slots, "int32")
    return out


def sglang_batch(forward_batch, req_to_token, *, full_to_swa=None, kv_index_translator=None,
                 expected_input_ids=None, expected_positions=None) -> Batch:
    """A :class:`Batch` from an SGLang ``ForwardBatch`` (``forward_mode``, ``req_pool_indices``,
    ``seq_lens``, ``input_ids``, ``positions``, ``out_cache_loc``, plus the mode's lengths: see the
    module docstring) and ``req_to_token``: the ModelRunner (preferred: its translator is used
    under unified memory), its ``ReqToTokenPool`` or the int32 array.

    With ``full_to_swa`` the SWA slots of the new tokens are gathered from it on the device (``-1``
    entries stay ``-1``). Only dtype casts, gathers and elementwise arithmetic run, on the arrays'
    device; nothing is read back to the host. A missing attribute is a ``kv-canary:`` error naming it."""
    fb = forward_batch
    rtt, translator = req_to_token_source(req_to_token, kv_index_translator)
    for name in ("req_pool_indices", "seq_lens", "input_ids", "positions", "out_cache_loc"):
        require_attr(fb, name, "the ForwardBatch", _FIX)
    seq = astype(fb.seq_lens, "int64")
    prefix, extend = _lengths(fb, seq)
    rows, rtt = astype(fb.req_pool_indices, "int64"), astype(rtt, "int32")
    if translator is not None and getattr(translator, "is_translating", False):
        table = translator.index_table_for_batch(fb)
        if full_to_swa is not None or getattr(table, "sliding_window_ids", None) is not None:
            raise ValidationError("kv-canary: expected one id space for full and SWA slots, got a unified-memory "
                                  "pool with a sliding-window id space (full and SWA ids translated separately, which "
                                  "the canary's full_to_swa map cannot express); fix: run the canary without "
                                  "--enable-unified-memory on hybrid SWA models")
        bs = int(rows.shape[0])
        rtt, rows = _translated_rows(table, bs), arange(rows, 1, bs + 1)
    loc = astype(fb.out_cache_loc, "int64")
    swa_loc = None
    if full_to_swa is not None:  # -1 (skip) stays -1 whatever the map's last entry holds
        swa_loc = where(loc < 0, loc, astype(full_to_swa, "int64")[loc])
    return Batch(rows, prefix, extend, rtt, input_ids=astype(fb.input_ids, "int64"),
                 positions=astype(fb.positions, "int64"), out_cache_loc=loc, swa_out_cache_loc=swa_loc,
                 expected_input_ids=expected_input_ids, expected_positions=expected_positions)
