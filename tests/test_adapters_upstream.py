"""Engine adapters against the objects today's vLLM and SGLang hand out, built here with their exact
attribute names, dtypes, shapes and strides (torch CPU tensors on the reference backend):

- vLLM main (vllm/v1/kv_cache_layout.py, kv_cache_interface.py ``create_kv_cache_views``): one flat
  int8 buffer per KV cache group, viewed per layer as packed ``[num_blocks, heads, block_size,
  head_size + head_size_v]`` with the byte strides of each ``KVCacheLayout``; V1's
  ``attn_metadata`` dict keyed by layer name; fp8_ds_mla's 584-byte tokens.
- SGLang main (forward_batch_info.ForwardMode, EagleVerifyInput, kv_index_translator,
  swa_memory_pool.SWAKVPool, memory_pool.MLATokenToKVPoolFP4): TARGET_VERIFY batches with draft
  tokens, unified-memory index tables, SWA pools without the window, 36-byte FP4 scale rows.

Each layout is checked on the bytes: a flipped byte of a token the canary fingerprints is a
``verify_real_kv_hash`` row at that token's slot, a flipped byte it does not read gives none.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest

import kvcanary as kc
from kvcanary.adapters import (KV_CACHE_LAYOUTS, sglang_batch, sglang_canary, sglang_groups, sglang_sources,
                               vllm_batch, vllm_batch_from_metadata, vllm_canary, vllm_layer_layout,
                               vllm_layer_sources, vllm_metadata, vllm_pool_group)
from tests.test_adapters import ALL, ForwardMode, check_fingerprints

torch = pytest.importorskip("torch")

# ---- vLLM: packed caches as create_kv_cache_views builds them ----------------------------------------
# KVCacheLayout members: stride permutation of the logical [L, B, H, N, C] axes (vllm/v1/kv_cache_layout.py).
VLLM_ORDERS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
               "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
L, B, H, N, D = 3, 10, 2, 16, 32   # layers, blocks, kv heads, block_size, head_size (bf16: C = 128 bytes)


def packed_caches(layout: str, *, seed=0, dtype=torch.bfloat16, heads=H, head_size=D, head_size_v=D, blocks=B):
    """(raw int8 buffer, per-layer views): logical [L, B, H, N, C] byte strides follow the layout's
    stride order outer to inner, as compute_layout_strides does; each layer is view_5d[l].view(dtype)."""
    item = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 1
    shape = (L, blocks, heads, N, (head_size + head_size_v) * item)
    strides, step = [0] * 5, 1
    for dim in reversed(VLLM_ORDERS[layout]):
        strides[dim], step = step, step * shape[dim]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(-128, 128, (step,), dtype=torch.int8, generator=g)
    view_5d = torch.as_strided(raw, shape, tuple(strides))
    return raw, [view_5d[i].view(dtype) for i in range(L)]


def token_bytes(cache, slot, half, head_size=D, head=0):
    """The bytes of ``half`` (0 K, 1 V) of ``head`` for ``slot`` — indexed logically, as attention does."""
    b, n = divmod(slot, cache.shape[2])
    row = cache[b, head, n]
    part = row[:head_size] if half == 0 else row[head_size:]
    return part.contiguous().view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("layout", list(VLLM_ORDERS))
def test_vllm_packed_layouts_fingerprint_head0_k_and_v(layout):
    assert set(KV_CACHE_LAYOUTS) == set(VLLM_ORDERS)
    _, caches = packed_caches(layout)
    found = vllm_layer_layout(caches[1], layout=layout)
    assert found.kind == "packed" and layout in found.name and found.num_slots == B * N
    k, v = vllm_layer_sources(caches[1], layout=layout)
    check_fingerprints([k], lambda s: [token_bytes(caches[1], s, 0)], B * N)
    check_fingerprints([v], lambda s: [token_bytes(caches[1], s, 1)], B * N)
    alias = {"LBNHC": "NHD", "LBHNC": "HND"}.get(layout)
    if alias:  # vLLM's compatibility aliases resolve to the same member
        assert vllm_layer_layout(caches[0], layout=alias).name == found.name


def test_vllm_packed_auto_detection_and_ambiguity():
    _, lhbnc = packed_caches("LHBNC")   # heads outside blocks: only the packed reading fits
    assert vllm_layer_layout(lhbnc[0]).kind == "packed"
    for layout in ("LBHNC", "BLNHC"):    # also a valid flat [B, N, H, D] one: refused, naming both
        _, caches = packed_caches(layout)
        with pytest.raises(kc.ValidationError, match=r"ambiguous.*could be packed .* or flat .*kv_cache_layout"):
            vllm_layer_layout(caches[0])
        assert vllm_layer_layout(caches[0], layout="flat").kind == "flat"
    _, nhc = packed_caches("LBNHC")
    with pytest.raises(kc.ValidationError, match=r"LBHNC.*got shape \(10, 2, 16, 64\), strides"):
        vllm_layer_layout(nhc[0], layout="LBHNC")   # the strides say N outside H: not that member
    with pytest.raises(kc.ValidationError, match="unknown layout 'NCHW'"):
        vllm_layer_layout(nhc[0], layout="NCHW")
    member = SimpleNamespace(name="LBNHC")          # a KVCacheLayout enum member works as well
    assert vllm_layer_layout(nhc[0], layout=member).kind == "packed"


def test_vllm_packed_mla_and_fp8_ds_mla():
    _, mla = packed_caches("LBHNC", heads=1, head_size=576, head_size_v=0)   # MLA: one latent, no V
    found = vllm_layer_layout(mla[0], layout="LBHNC", head_size_v=0)
    assert len(found.halves) == 1
    (k,) = found.sources()
    check_fingerprints([k], lambda s: [token_bytes(mla[0], s, 0, head_size=576)], B * N, modes=(ALL,))
    # DeepSeek-V4 SWA fp8_ds_mla: 584 opaque bytes per token, uint8 (not a multiple of 16)
    _, ds = packed_caches("LBHNC", dtype=torch.uint8, heads=1, head_size=584, head_size_v=0)
    with pytest.raises(kc.ValidationError, match=r"584 bytes apart.*fp8_ds_mla.*fix: fingerprint=False"):
        vllm_pool_group(ds, layout="LBHNC", head_size_v=0)
    group = vllm_pool_group(ds, layout="LBHNC", head_size_v=0, fingerprint=False, layers="all")
    assert (group.num_slots, group.k_sources, group.v_sources) == (B * N, (), ())


def test_vllm_split_layout_is_still_detected():
    cache = torch.zeros((2, B, N, H, D), dtype=torch.bfloat16)   # FlashAttention before the packed layout
    assert vllm_layer_layout(cache).name == "split kv_dim=0 NHD"
    with pytest.raises(kc.ValidationError, match="must be packed"):
        vllm_layer_layout(cache, layout="LBHNC")


def _metadata(block_table, seq_lens, qsl, slots):
    """FlashAttentionMetadata's fields (vllm/v1/attention/backends/flash_attn.py)."""
    return SimpleNamespace(num_actual_tokens=len(slots), max_query_len=int(np.diff(qsl).max()),
                           query_start_loc=torch.tensor(qsl, dtype=torch.int32), max_seq_len=max(seq_lens),
                           seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                           block_table=torch.tensor(block_table, dtype=torch.int32),
                           slot_mapping=torch.tensor(slots, dtype=torch.int64), use_cascade=False,
                           common_prefix_len=0, causal=True)


def test_vllm_attn_metadata_dict_keyed_by_layer():
    md = _metadata([[3, 5], [7, 0]], [20, 4], [0, 20, 24], list(range(48, 64)) + list(range(80, 84)) + [112, 113, 114, 115])
    names = [f"model.layers.{i}.self_attn.attn" for i in range(L)]
    per_layer = dict.fromkeys(names, md)           # one KV cache group: every layer shares the object
    assert vllm_metadata(per_layer) is md and vllm_metadata(md) is md
    ids, pos = torch.arange(24), torch.cat([torch.arange(20), torch.arange(4)])
    got = vllm_batch_from_metadata(per_layer, input_ids=ids, positions=pos, block_size=N)
    want = vllm_batch(block_table=md.block_table, seq_lens=md.seq_lens, query_start_loc=md.query_start_loc,
                      slot_mapping=md.slot_mapping, input_ids=ids, positions=pos, block_size=N)
    for field in ("req_pool_indices", "prefix_lens", "extend_lens", "req_to_token", "out_cache_loc"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    two_groups = {names[0]: md, names[1]: _metadata([[1]], [1], [0, 1], [16])}
    with pytest.raises(kc.ValidationError, match="2 different metadata objects.*layer_name="):
        vllm_metadata(two_groups)
    assert vllm_metadata(two_groups, names[1]).num_actual_tokens == 1
    with pytest.raises(kc.ValidationError, match="no layer 'x'"):
        vllm_metadata(two_groups, "x")
    with pytest.raises(kc.ValidationError, match="list of 2 .*micro-batching"):
        vllm_metadata([per_layer, per_layer])
    del md.slot_mapping
    with pytest.raises(kc.ValidationError, match="attribute 'slot_mapping'"):
        vllm_batch_from_metadata(per_layer, input_ids=ids, positions=pos, block_size=N)


def run_vllm_packed(layout, corrupt=None):
    """Prefill two requests (20 and 9 tokens) then two decode steps over packed caches; the forward
    writes K|V through the logical views. ``corrupt(step, caches, table)`` runs before each step."""
    _, caches = packed_caches(layout, seed=3)
    records = []
    canary = vllm_canary(caches, layout=layout, layers="all", hash_mode="partial", export=records.append, max_batch=4)
    table = np.array([[3, 5], [8, 0]], np.int32)
    lens = [20, 9]
    g = torch.Generator().manual_seed(4)
    for step in range(3):
        if corrupt is not None:
            corrupt(step, caches, table)
        new = lens if step == 0 else [1, 1]
        start = [0, 0] if step == 0 else [n + step - 1 for n in lens]
        pos = np.concatenate([np.arange(a, a + e) for a, e in zip(start, new)])
        slots = np.concatenate([table[r, p // N] * N + p % N for r, p in enumerate(np.split(pos, [new[0]]))])
        md = _metadata(table, [a + e for a, e in zip(start, new)], [0, new[0], new[0] + new[1]], slots)
        batch = vllm_batch_from_metadata({"layers.0.attn": md}, input_ids=torch.tensor(pos + 100),
                                         positions=torch.tensor(pos), block_size=N)
        canary.before_forward(batch)
        b, n = torch.tensor(slots // N), torch.tensor(slots % N)
        for cache in caches:
            cache[b, :, n] = torch.randn((len(slots), H, 2 * D), generator=g).to(cache.dtype)
        canary.after_forward(batch)
    canary.flush()
    return [r for r in records if r["type"] == "violation"]


@pytest.mark.parametrize("layout", ["LBNHC", "BLHNC", "LHBNC"])
def test_vllm_packed_run_reads_the_right_bytes(layout):
    assert run_vllm_packed(layout) == []
    hit = {}

    def flip(head, half):
        def corrupt(step, caches, table):
            if step == 1:   # request 0, position 13 (block 3, offset 13), layer 2
                row = caches[2][int(table[0, 0]), head, 13]
                byte = row.view(torch.uint8)[(0 if half == 0 else 2 * D) + 1:][:1]
                byte ^= 0x21
                hit["slot"] = int(table[0, 0]) * N + 13
        return corrupt
    rows = run_vllm_packed(layout, flip(0, 1))   # V of head 0: fingerprinted
    assert {(r["launch_tag"], tuple(r["fail_reason"]), r["slot_idx"]) for r in rows} == \
        {("TAIL_V_FULL", ("verify_real_kv_hash",), hit["slot"])}
    assert run_vllm_packed(layout, flip(1, 0)) == []   # K of head 1: not fingerprinted, not flagged


# ---- SGLang --------------------------------------------------------------------------------------------
def mha_pool(slots=64, layers=2, heads=2, dim=16, seed=0):
    """MHATokenToKVPool's buffers: k_buffer / v_buffer lists of [size + page_size, heads, dim] bf16."""
    g = torch.Generator().manual_seed(seed)
    make = lambda: [torch.randn((slots, heads, dim), generator=g).to(torch.bfloat16) for _ in range(layers)]  # noqa: E731
    return SimpleNamespace(k_buffer=make(), v_buffer=make(), page_size=1, layer_num=layers)


def verify_input(draft_token_num=4, topk=1, bs=2):
    """EagleVerifyInput's fields (speculative/eagle_info.py)."""
    return SimpleNamespace(draft_token=torch.zeros(bs * draft_token_num, dtype=torch.int64), custom_mask=None,
                           positions=None, retrieve_index=None, retrieve_next_token=None, retrieve_next_sibling=None,
                           retrieve_cum_len=None, spec_steps=draft_token_num - 1, topk=topk,
                           draft_token_num=draft_token_num, capture_hidden_mode=None, seq_lens_sum=0,
                           seq_lens_cpu=None, num_tokens_per_req=draft_token_num)


def forward_batch(mode, rows, seq_lens, ids, pos, loc, *, extend=None, prefix=None, spec_info=None):
    i64 = lambda x: None if x is None else torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return SimpleNamespace(forward_mode=mode, batch_size=len(rows), req_pool_indices=i64(rows),
                           seq_lens=i64(seq_lens), input_ids=i64(ids), positions=i64(pos), out_cache_loc=i64(loc),
                           extend_seq_lens=None if extend is None else torch.tensor(extend, dtype=torch.int32),
                           extend_prefix_lens=None if prefix is None else torch.tensor(prefix, dtype=torch.int32),
                           spec_info=spec_info, seq_lens_cpu=i64(seq_lens))


def test_sglang_lengths_per_forward_mode():
    rtt = torch.zeros((4, 32), dtype=torch.int32)
    v = forward_batch(ForwardMode.TARGET_VERIFY, [1, 2], [5, 3], list(range(8)), [5, 6, 7, 8, 3, 4, 5, 6],
                      list(range(10, 18)), spec_info=verify_input())
    b = sglang_batch(v, rtt)   # extend_seq_lens is None: draft_token_num tokens each after seq_lens
    assert (b.prefix_lens.tolist(), b.extend_lens.tolist(), b.out_cache_loc.tolist()) == ([5, 3], [4, 4], list(range(10, 18)))
    d = forward_batch(ForwardMode.DRAFT_EXTEND_V2, [1, 2], [7, 5], list(range(4)), [5, 6, 3, 4], [20, 21, 22, 23],
                      extend=[2, 2])
    assert sglang_batch(d, rtt).prefix_lens.tolist() == [5, 3]
    e = forward_batch(ForwardMode.MIXED, [1, 2], [7, 5], list(range(3)), [6, 3, 4], [20, 21, 22], extend=[1, 2],
                      prefix=[6, 3])
    assert sglang_batch(e, rtt).extend_lens.tolist() == [1, 2]
    idle = forward_batch(ForwardMode.IDLE, [], [], [], [], [])
    assert sglang_batch(idle, rtt).extend_lens.numel() == 0
    with pytest.raises(kc.ValidationError, match=r"topk=2.*fix: --speculative-eagle-topk 1"):
        sglang_batch(forward_batch(ForwardMode.TARGET_VERIFY, [1, 2], [5, 3], list(range(8)), list(range(8)),
                                   list(range(8)), spec_info=verify_input(topk=2)), rtt)
    with pytest.raises(kc.ValidationError, match="should carry 8 tokens, got 6"):
        sglang_batch(forward_batch(ForwardMode.TARGET_VERIFY, [1, 2], [5, 3], list(range(6)), list(range(6)),
                                   list(range(6)), spec_info=verify_input()), rtt)
    with pytest.raises(kc.ValidationError, match="forward_mode PREBUILT"):
        sglang_batch(forward_batch(ForwardMode.PREBUILT, [1], [3], [1], [2], [3]), rtt)
    with pytest.raises(kc.ValidationError, match="EXTEND ForwardBatch must carry extend_seq_lens"):
        sglang_batch(forward_batch(ForwardMode.EXTEND, [1], [3], [1], [2], [3]), rtt)
    broken = forward_batch(ForwardMode.DECODE, [1], [3], [1], [2], [3])
    del broken.forward_mode
    with pytest.raises(kc.ValidationError, match="attribute 'forward_mode'"):
        sglang_batch(broken, rtt)


def run_sglang_speculative(pool, runner, *, loc_of, corrupt=None):
    """Request rows 1, 2: prefill (EXTEND) 12 and 7 tokens, then a TARGET_VERIFY of 4 chain drafts
    each, then a DECODE after accepting 2 drafts. ``runner`` is what sglang_batch receives;
    ``loc_of(virtual)`` the ids the forward writes (kernel-facing). The forward writes fresh KV."""
    records = []
    canary = sglang_canary(pool, layers="all", hash_mode="partial", export=records.append, max_batch=4)
    rtt = runner.req_to_token_pool.req_to_token if hasattr(runner, "req_to_token_pool") else runner
    g = torch.Generator().manual_seed(1)
    virt = {1: list(range(4, 33)), 2: list(range(40, 69))}  # virtual ids per request position (page 0 is padding)

    def step(k, fb):
        if corrupt is not None:
            corrupt(k, pool)
        batch = sglang_batch(fb, runner)
        canary.before_forward(batch)
        for buf in pool.k_buffer + pool.v_buffer:
            buf[fb.out_cache_loc] = torch.randn((len(fb.out_cache_loc),) + tuple(buf.shape[1:]), generator=g).to(buf.dtype)
        canary.after_forward(batch)

    lens = {1: 12, 2: 7}
    for r, n in lens.items():
        rtt[r, :n] = torch.tensor(virt[r][:n], dtype=torch.int32)
    pos = [p for n in lens.values() for p in range(n)]
    step(0, forward_batch(ForwardMode.EXTEND, [1, 2], [12, 7], [p + 100 for p in pos], pos,
                          [loc_of(virt[r][p]) for r, n in lens.items() for p in range(n)], extend=[12, 7], prefix=[0, 0]))
    for r, n in lens.items():   # prepare_for_verify: drafts' slots at req_to_token[seq_lens : seq_lens + 4]
        rtt[r, n:n + 4] = torch.tensor(virt[r][n:n + 4], dtype=torch.int32)
    pos = [p for n in lens.values() for p in range(n, n + 4)]
    step(1, forward_batch(ForwardMode.TARGET_VERIFY, [1, 2], [12, 7], [p + 100 for p in pos], pos,
                          [loc_of(virt[r][p]) for r, n in lens.items() for p in range(n, n + 4)],
                          spec_info=verify_input()))
    lens = {1: 14, 2: 9}        # 2 drafts accepted each; the decode writes the bonus token
    pos = [lens[1], lens[2]]
    rtt[1, 14], rtt[2, 9] = virt[1][14], virt[2][9]
    step(2, forward_batch(ForwardMode.DECODE, [1, 2], [15, 10], [p + 100 for p in pos], pos,
                          [loc_of(virt[1][14]), loc_of(virt[2][9])]))
    canary.flush()
    return [r for r in records if r["type"] == "violation"]


def test_sglang_target_verify_run_checks_the_draft_slots():
    pool, rtt = mha_pool(), torch.zeros((3, 32), dtype=torch.int32)
    assert run_sglang_speculative(pool, rtt, loc_of=lambda v: v) == []

    def flip(slot, layer=1):
        def corrupt(step, pool):
            if step == 2:  # after the verify wrote the drafts
                pool.k_buffer[layer][slot].view(torch.uint8).view(-1)[2] ^= 0x10
        return corrupt
    rows = run_sglang_speculative(pool, rtt, loc_of=lambda v: v, corrupt=flip(16))   # request 1's accepted draft
    assert {(r["launch_tag"], tuple(r["fail_reason"]), r["slot_idx"], r["position"]) for r in rows} == \
        {("TAIL_K_FULL", ("verify_real_kv_hash",), 16, 12)}
    assert run_sglang_speculative(pool, rtt, loc_of=lambda v: v, corrupt=flip(19)) == []  # a rejected draft: unread


class Translator:
    """KVIndexTranslator's contract on a unified pool (mem_cache/kv_index_translator.py): reads come from a
    page-granular table of kernel-facing ids, ``token = entry * entry_page_size + pos % entry_page_size``."""

    def __init__(self, rtt, page, v2p):
        self.req_to_token, self.page, self.v2p, self.is_translating = rtt, page, v2p, True

    def kernel_id(self, virtual):
        return int(self.v2p[virtual // self.page]) * self.page + virtual % self.page

    def index_table_for_batch(self, fb):
        rows = fb.req_pool_indices
        pages = -(-self.req_to_token.shape[1] // self.page)
        first = self.req_to_token[rows][:, ::self.page].to(torch.int64)
        ids = torch.where(first == 0, first, self.v2p[first // self.page]).to(torch.int32)[:, :pages]
        return SimpleNamespace(ids=ids, row_ids=torch.arange(len(rows)), row_stride=ids.stride(0),
                               entry_page_size=self.page, is_translated=True, sliding_window_ids=None,
                               sliding_window_write_loc=None)


def test_sglang_unified_memory_compares_one_id_space():
    rtt = torch.zeros((3, 32), dtype=torch.int32)
    v2p = torch.tensor([0, 9, 4, 7, 2, 11, 5, 3, 10, 6, 8, 1, 12, 13, 14, 15, 16, 17], dtype=torch.int64)
    tr = Translator(rtt, 4, v2p)   # virtual page p lives in physical page v2p[p]
    runner = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=rtt), kv_index_translator=tr)
    pool = mha_pool(slots=80)
    assert run_sglang_speculative(pool, runner, loc_of=tr.kernel_id) == []
    # the array alone compares virtual reads with kernel-facing writes: every cached read is wrong
    rows = run_sglang_speculative(pool, rtt, loc_of=tr.kernel_id)
    assert rows and {"verify_position"} & {f for r in rows for f in r["fail_reason"]}


def test_sglang_swa_pool_needs_window_and_fp4_scale_rows_are_refused():
    mapping = torch.arange(65, dtype=torch.int64)
    mapping[-1] = -1
    swa = SimpleNamespace(size=63, size_swa=63, page_size=1, full_kv_pool=mha_pool(64), swa_kv_pool=mha_pool(64),
                          layers_mapping={0: (0, False), 1: (0, True)}, full_to_swa_index_mapping=mapping,
                          swa_loc=None)
    with pytest.raises(kc.ValidationError, match=r"SWAKVPool does not carry it; fix: pass window="):
        sglang_groups(swa)
    assert sglang_groups(swa, window=16)[1].window == 16
    # MLATokenToKVPoolFP4 for DeepSeek's 576-wide cache: kv_buffer [m, 1, 288] uint8, kv_scale_buffer [m, 36] uint8
    m = 33
    fp4 = SimpleNamespace(kv_buffer=[torch.randint(0, 256, (m, 1, 288), dtype=torch.uint8)],
                          kv_scale_buffer=[torch.randint(0, 256, (m, 36), dtype=torch.uint8)], kv_cache_dim=576)
    with pytest.raises(kc.ValidationError, match=re.escape("holds 36 bytes per token") + r".*fix: scales=False"):
        sglang_sources(fp4)
    (k,), v = sglang_sources(fp4, scales=False)
    assert v == []
    check_fingerprints([k], lambda s: [fp4.kv_buffer[0][s].numpy().tobytes()], m)
