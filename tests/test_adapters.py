"""Engine adapters on the CPU: sources built from numpy stand-ins of SGLang- and vLLM-style pools
fingerprint exactly the bytes of each slot (checked against fingerprints computed by hand from
docs/format.md §3 through the reference), the block table expands to a hand-computed slot map, and whole
prefill + decode runs through a host KvCanary stay clean until a byte, a scale or a block table
is corrupted, which is reported with the right tag and reason.

The simulations take an array backend (``Host``: numpy); tests/gpu/device/test_adapters_gpu.py runs the
same simulations with torch CUDA tensors and compares the outcome with this host run.
"""

from __future__ import annotations

import enum
from types import SimpleNamespace

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import abi
from kvcanary.adapters import (
    block_table_to_req_to_token,
    select_layers,
    sglang_batch,
    sglang_canary,
    sglang_groups,
    sglang_sources,
    vllm_batch,
    vllm_canary,
    vllm_layer_sources,
    vllm_pool_group,
)
from kvcanary.ops.sources import marshal_sources
from kvcanary.reference import canary as reference
from kvcanary.reference.hashing import sm

ALL, PARTIAL = abi.HashMode.ALL, abi.HashMode.PARTIAL
# SGLang's ForwardMode (forward_batch_info.py): the same members in the same order (IntEnum, auto()).
ForwardMode = enum.IntEnum("ForwardMode", ["EXTEND", "DECODE", "MIXED", "IDLE", "TARGET_VERIFY", "DRAFT_EXTEND_V2",
                                           "PREBUILT", "SPLIT_PREFILL", "DLLM_EXTEND"])
LENS = (20, 33, 7)   # prompt lengths of the simulated requests
WINDOW = 8           # SWA window of the simulated hybrid pool


# ---- fingerprints: by hand (docs/format.md §3) and through the adapters' sources ------------------------------
def by_hand(strips: list[bytes]) -> int:
    total = 0
    for strip in strips:
        h = 0
        for w in np.frombuffer(strip, "<u8"):
            h = sm(h ^ int(w))
        total = sm(total ^ h)
    return total


def through_sources(sources, slots, mode, num_slots) -> list[int]:
    refs = [reference.RefSource(m.view.host, m.page_size, m.bytes_per_token, m.hash_bytes)
            for m in marshal_sources(sources, mode, num_slots)]
    return [int(x) for x in reference.fingerprint(np.asarray(slots, np.int64), refs)]


def check_fingerprints(sources, strips_of, num_slots, modes=(ALL, PARTIAL)):
    slots = list(range(num_slots))
    for mode in modes:
        cut = (lambda b: b[:16]) if mode == PARTIAL else (lambda b: b)
        want = [by_hand([cut(s) for s in strips_of(slot)]) for slot in slots]
        assert through_sources(sources, slots, mode, num_slots) == want, mode


def rand(rng, shape, dtype=np.int16):
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, shape, dtype=dtype, endpoint=True)


def test_select_layers():
    assert select_layers(5) == [0] and select_layers(5, "first") == [0]
    assert select_layers(5, "all") == [0, 1, 2, 3, 4] and select_layers(5, [3, 1]) == [3, 1]
    assert select_layers(5, 2) == [2]
    with pytest.warns(RuntimeWarning, match="first 32 of 40"):
        assert select_layers(40, "all", sources_per_layer=2) == list(range(32))
    for bad in ([5], [1, 1], "some", []):
        with pytest.raises(kc.ValidationError):
            select_layers(5, bad)
    with pytest.raises(kc.ValidationError, match="at most 32 layers"):
        select_layers(40, list(range(33)), sources_per_layer=2)


# ---- SGLang-style pools -------------------------------------------------------------------------------
def test_sglang_mha_sources_fingerprint_each_layer_slot():
    rng = np.random.default_rng(0)
    k = [rand(rng, (40, 2, 16)) for _ in range(3)]
    v = [rand(rng, (40, 2, 16)) for _ in range(3)]
    ks, vs = sglang_sources(SimpleNamespace(k_buffer=k, v_buffer=v), layers=[2, 0])
    check_fingerprints(ks, lambda s: [k[2][s].tobytes(), k[0][s].tobytes()], 40)
    check_fingerprints(vs, lambda s: [v[2][s].tobytes(), v[0][s].tobytes()], 40)
    first, _ = sglang_sources(SimpleNamespace(k_buffer=k, v_buffer=v))  # default: layer 0 only
    check_fingerprints(first, lambda s: [k[0][s].tobytes()], 40, modes=(ALL,))


def test_sglang_stacked_and_strided_layers_are_live_views():
    rng = np.random.default_rng(1)
    big = rand(rng, (32, 4, 2, 8))          # [slots, layers, heads, dim]: layer i is a strided view
    stacked = np.ascontiguousarray(big.transpose(1, 0, 2, 3))  # one [layers, slots, ...] array
    pool = SimpleNamespace(k_buffer=[big[:, i] for i in range(4)], v_buffer=stacked)
    ks, vs = sglang_sources(pool, layers="all")
    check_fingerprints(ks, lambda s: [big[s, i].tobytes() for i in range(4)], 32, modes=(ALL,))
    check_fingerprints(vs, lambda s: [big[s, i].tobytes() for i in range(4)], 32, modes=(ALL,))
    before = through_sources(ks, [5], ALL, 32)
    big[5, 3, 1, 7] ^= 1                     # the source reads the live buffer, not a copy
    assert through_sources(ks, [5], ALL, 32) != before


def test_sglang_mla_is_one_half():
    rng = np.random.default_rng(2)
    kv = [rand(rng, (24, 1, 72)) for _ in range(2)]   # 144 bytes per token
    full, swa = sglang_groups(SimpleNamespace(kv_buffer=kv), layers="all")
    assert swa is None and full.resolved_halves() == ("K",) and full.num_slots == 24 and not full.v_sources
    check_fingerprints(full.k_sources, lambda s: [kv[0][s].tobytes(), kv[1][s].tobytes()], 24)


def test_sglang_quantised_pool_adds_scale_sources():
    rng = np.random.default_rng(3)
    k = [rand(rng, (30, 2, 64), np.uint8) for _ in range(2)]          # fp8 values stored as bytes
    ks_ = [rand(rng, (30, 2 * 64 // 8), np.uint8) for _ in range(2)]   # 16 scale bytes per token
    v = [rand(rng, (30, 2, 64), np.uint8) for _ in range(2)]
    vs_ = [rand(rng, (30, 16), np.uint8) for _ in range(2)]
    pool = SimpleNamespace(k_buffer=k, v_buffer=v, k_scale_buffer=ks_, v_scale_buffer=vs_)
    ks, vs = sglang_sources(pool, layers="all")
    assert len(ks) == len(vs) == 4
    check_fingerprints(ks, lambda s: [b[i][s].tobytes() for i in (0, 1) for b in (k, ks_)], 30)
    check_fingerprints(vs, lambda s: [b[i][s].tobytes() for i in (0, 1) for b in (v, vs_)], 30)
    assert len(sglang_sources(pool, scales=False)[0]) == 1
    with pytest.raises(kc.ValidationError, match="scales=True"):
        sglang_sources(SimpleNamespace(k_buffer=k, v_buffer=v), scales=True)
    narrow = SimpleNamespace(k_buffer=k, v_buffer=v, k_scale_buffer=[rand(rng, (30, 4), np.uint8)] * 2)
    with pytest.raises(kc.ValidationError, match="K scales of layer 0"):
        sglang_sources(narrow)


def mha(rng, slots, layers=3, heads=2, dim=16):
    return SimpleNamespace(k_buffer=[rand(rng, (slots, heads, dim)) for _ in range(layers)],
                           v_buffer=[rand(rng, (slots, heads, dim)) for _ in range(layers)])


def test_sglang_swa_groups():
    rng = np.random.default_rng(4)
    mapping = np.zeros(65, np.int64)
    mapping[1:64] = rng.integers(1, 40, 63)
    mapping[-1] = -1
    pool = SimpleNamespace(full_kv_pool=mha(rng, 64), swa_kv_pool=mha(rng, 40), full_to_swa_index_mapping=mapping)
    full, swa = sglang_groups(pool, window=WINDOW, swa_layers="all")
    assert (full.num_slots, swa.num_slots, swa.window) == (64, 40, WINDOW)
    assert (len(full.k_sources), len(swa.k_sources)) == (1, 3)
    assert swa.full_to_swa is mapping
    check_fingerprints(swa.k_sources, lambda s: [b[s].tobytes() for b in pool.swa_kv_pool.k_buffer], 40, modes=(ALL,))
    with pytest.raises(kc.ValidationError, match="window="):
        sglang_groups(pool)
    pool.full_to_swa_index_mapping = None
    with pytest.raises(kc.ValidationError, match="register_mapping"):
        sglang_groups(pool, window=WINDOW)
    fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, req_pool_indices=np.array([1, 1]), seq_lens=np.array([3, 4]),
                         extend_seq_lens=None,
                         input_ids=np.array([7, 8], np.int32), positions=np.array([2, 3]),
                         out_cache_loc=np.array([-1, 3]))
    swa_loc = sglang_batch(fb, np.zeros((2, 4), np.int32), full_to_swa=np.arange(10, 20)).swa_out_cache_loc
    assert swa_loc.tolist() == [-1, 13]  # a skipped entry stays -1 whatever the map's last entry is


def test_sglang_batch_extend_and_decode():
    rtt = np.zeros((3, 8), np.int32)
    ext = SimpleNamespace(forward_mode=ForwardMode.EXTEND, req_pool_indices=np.array([1, 2]), seq_lens=np.array([5, 3], np.int32),
                          extend_prefix_lens=np.array([2, 0], np.int32), extend_seq_lens=np.array([3, 3], np.int32),
                          input_ids=np.arange(6, dtype=np.int32), positions=np.array([2, 3, 4, 0, 1, 2]),
                          out_cache_loc=np.arange(10, 16))
    b = sglang_batch(ext, SimpleNamespace(req_to_token=rtt))
    assert (b.prefix_lens.tolist(), b.extend_lens.tolist(), b.input_ids.dtype, b.req_to_token is rtt) == \
        ([2, 0], [3, 3], np.int64, True)
    dec = SimpleNamespace(forward_mode=ForwardMode.DECODE, req_pool_indices=np.array([1, 2]), seq_lens=np.array([6, 4]), input_ids=np.array([1, 2]),
                          positions=np.array([5, 3]), out_cache_loc=np.array([16, 17]))
    b = sglang_batch(dec, rtt)
    assert (b.prefix_lens.tolist(), b.extend_lens.tolist()) == ([5, 3], [1, 1])


# ---- vLLM-style caches ----------------------------------------------------------------------------
def vllm_cache(rng, layout: str, nb=12, bs=4, heads=2, dim=16):
    """(raw int16 array, the cache as the engine shows it, token(half, slot) -> bytes of the source)."""
    if layout == "nhd":
        raw = rand(rng, (2, nb, bs, heads, dim))
        return raw, raw, lambda h, s: raw[h, s // bs, s % bs].tobytes()
    if layout == "flashinfer":
        raw = rand(rng, (nb, 2, bs, heads, dim))
        return raw, raw, lambda h, s: raw[s // bs, h, s % bs].tobytes()
    if layout == "hnd":  # physical [2, nb, heads, bs, dim], shown as [2, nb, bs, heads, dim]: head 0 only
        raw = rand(rng, (2, nb, heads, bs, dim))
        return raw, raw.transpose(0, 1, 3, 2, 4), lambda h, s: raw[h, s // bs, 0, s % bs].tobytes()
    if layout == "mla":
        raw = rand(rng, (nb, bs, 40))
        return raw, raw, lambda h, s: raw[s // bs, s % bs].tobytes()
    raise AssertionError(layout)


@pytest.mark.parametrize("layout", ["nhd", "flashinfer", "hnd", "mla"])
def test_vllm_layer_sources(layout):
    rng = np.random.default_rng(5)
    raw, cache, token = vllm_cache(rng, layout)
    k, v = vllm_layer_sources(cache)
    check_fingerprints([k], lambda s: [token(0, s)], 48)
    if layout == "mla":
        assert v is None
    else:
        check_fingerprints([v], lambda s: [token(1, s)], 48)


def test_vllm_pool_group_and_layout_errors():
    rng = np.random.default_rng(6)
    caches = [vllm_cache(rng, "nhd")[1] for _ in range(3)]
    g = vllm_pool_group({f"layers.{i}.attn": c for i, c in enumerate(caches)}, layers=[1, 2])
    assert (g.num_slots, len(g.k_sources), g.resolved_halves()) == (48, 2, ("K", "V"))
    check_fingerprints(g.v_sources, lambda s: [caches[i][1, s // 4, s % 4].tobytes() for i in (1, 2)], 48)
    with pytest.raises(kc.ValidationError, match="kv_dim=0"):
        vllm_layer_sources(np.zeros((2, 2, 4, 2, 16), np.int16))
    k, v = vllm_layer_sources(np.zeros((2, 2, 4, 2, 16), np.int16), kv_dim=1)
    assert k.page_size == 4 and v is not None
    with pytest.raises(kc.ValidationError, match="same number of slots"):
        vllm_pool_group([caches[0], vllm_cache(rng, "nhd", nb=5)[1]], layers="all")


def test_block_table_to_req_to_token_by_hand():
    bt = np.array([[3, 7, 1], [5, 2, 0]], np.int32)
    seq = np.array([40, 20], np.int32)
    want = np.zeros((3, 48), np.int32)
    want[1, :16] = list(range(48, 64))     # block 3
    want[1, 16:32] = list(range(112, 128))  # block 7
    want[1, 32:40] = list(range(16, 24))    # block 1, 8 of its 16 slots
    want[2, :16] = list(range(80, 96))      # block 5
    want[2, 16:20] = [32, 33, 34, 35]       # block 2, 4 slots
    got = block_table_to_req_to_token(bt, seq, 16)
    assert got.dtype == np.int32 and np.array_equal(got, want)
    out = np.full((4, 40), 99, np.int32)
    assert block_table_to_req_to_token(bt, seq, 16, max_len=40, out=out) is out
    assert np.array_equal(out[:3], want[:, :40]) and (out[3] == 99).all()
    with pytest.raises(kc.ValidationError, match="max_len"):
        block_table_to_req_to_token(bt, seq, 16, max_len=49)
    with pytest.raises(kc.ValidationError, match="out must have shape"):
        block_table_to_req_to_token(bt, seq, 16, out=np.zeros((2, 48), np.int32))


def test_vllm_batch_fields():
    bt = np.array([[3, 7], [5, 0], [0, 0]], np.int32)
    b = vllm_batch(block_table=bt, seq_lens=np.array([6, 2, 0], np.int32),
                   query_start_loc=np.array([0, 1, 3, 3, 3], np.int32),
                   slot_mapping=np.array([13, 20, 21, -1]), input_ids=np.array([4, 5, 6, 0], np.int32),
                   positions=np.array([5, 0, 1, 0]), block_size=4, num_reqs=3)
    assert b.req_pool_indices.tolist() == [1, 2, 3] and b.prefix_lens.tolist() == [5, 0, 0]
    assert b.extend_lens.tolist() == [1, 2, 0] and b.out_cache_loc.tolist() == [13, 20, 21, -1]
    assert b.req_to_token[1, :6].tolist() == [12, 13, 14, 15, 28, 29] and b.input_ids.dtype == np.int64
    with pytest.raises(kc.ValidationError, match=r"query_start_loc must hold num_reqs \+ 1 offsets .* got an empty"):
        vllm_batch(block_table=bt, seq_lens=np.array([6, 2, 0], np.int32), query_start_loc=np.zeros(0, np.int32),
                   slot_mapping=np.array([13]), input_ids=np.array([4]), positions=np.array([5]), block_size=4)


# ---- whole runs through a host KvCanary -----------------------------------------------------------
class Host:
    """Array backend of the simulations (numpy); tests/gpu swaps in torch CUDA tensors."""

    @staticmethod
    def arr(a):
        return a

    @staticmethod
    def flip(token, byte: int) -> None:
        token.view(np.uint8).reshape(-1)[byte] ^= 0x5A

    @staticmethod
    def sync() -> None:
        """Device backends wait here after each step, so the asynchronous violation pump reports
        every step's rows with that step (as a serving loop that syncs each step would)."""


def _requests(rng, steps):
    """(step, prefix_lens, extend_lens, tokens): a prefill of the three requests, then decodes."""
    tokens = [rng.integers(0, 30000, n + steps) for n in LENS]
    for k in range(steps):
        prefix = [0] * 3 if k == 0 else [n + k - 1 for n in LENS]
        extend = list(LENS) if k == 0 else [1, 1, 1]
        yield k, prefix, extend, tokens


BUFFERS = ("k_buffer", "v_buffer", "kv_buffer", "k_scale_buffer", "v_scale_buffer")


def sglang_pool(kind, rng, slots=96):
    if kind == "mha":
        return mha(rng, slots)
    if kind == "mla":
        return SimpleNamespace(kv_buffer=[rand(rng, (slots, 1, 24)) for _ in range(3)])
    if kind == "fp8":  # fp8 values and 16 scale bytes per token, all stored as uint8
        return SimpleNamespace(**{f"{h}{part}": [rand(rng, shape, np.uint8) for _ in range(3)] for h in "kv"
                                  for part, shape in (("_buffer", (slots, 2, 32)), ("_scale_buffer", (slots, 16)))})
    mapping = np.full(slots + 1, -1, np.int64)  # SGLang's map ends with -1 so that -1 maps to -1
    mapping[:slots] = np.concatenate([[0], rng.permutation(np.arange(1, slots))])
    return SimpleNamespace(full_kv_pool=mha(rng, slots), swa_kv_pool=mha(rng, slots), full_to_swa_index_mapping=mapping)


def pool_buffers(pool) -> dict[str, list]:
    """{"k_buffer": layers, ...}; a hybrid pool's names get a "full." / "swa." prefix."""
    if hasattr(pool, "full_kv_pool"):
        return {f"{p}.{k}": v for p in ("full", "swa") for k, v in pool_buffers(getattr(pool, f"{p}_kv_pool")).items()}
    return {name: getattr(pool, name) for name in BUFFERS if getattr(pool, name, None) is not None}


def to_backend(pool, be):
    if be is Host:
        return pool
    return SimpleNamespace(**{k: to_backend(v, be) if isinstance(v, SimpleNamespace)
                              else [be.arr(x) for x in v] if isinstance(v, list) else be.arr(v)
                              for k, v in vars(pool).items()})


def run_sglang(kind, be=Host, *, steps=4, corrupt=None, seed=0, **kw):
    """Prefill three requests then decode, writing fresh KV for each new token between the HEAD and
    TAIL stages (what the model's forward does). ``corrupt(step, ctx)`` runs before each step with
    ``ctx.bufs`` (backend buffers by name), ``ctx.slot(r, pos)``, ``ctx.swa_slot(r, pos)``, ``ctx.be``.
    Returns (violation records, canary)."""
    rng = np.random.default_rng(seed)
    host = sglang_pool(kind, rng)
    dev = to_backend(host, be)
    records = []
    canary = sglang_canary(dev, window=WINDOW if kind == "swa" else None, export=records.append, max_batch=4, **kw)
    rtt = np.zeros((4, 64), np.int32)
    perm, used = rng.permutation(np.arange(1, 96)), 0
    for r, n in enumerate(LENS):
        rtt[r + 1, :n + steps], used = perm[used:used + n + steps], used + n + steps
    mapping = getattr(host, "full_to_swa_index_mapping", None)
    ctx = SimpleNamespace(bufs=pool_buffers(dev), be=be, slot=lambda r, p: int(rtt[r + 1, p]),
                          swa_slot=lambda r, p: int(mapping[rtt[r + 1, p]]))
    for k, prefix, extend, tokens in _requests(rng, steps):
        if corrupt is not None:
            corrupt(k, ctx)
        pos = np.concatenate([np.arange(p, p + e) for p, e in zip(prefix, extend)])
        ids = np.concatenate([t[p:p + e] for t, p, e in zip(tokens, prefix, extend)]).astype(np.int32)
        loc = np.concatenate([rtt[r + 1, p:p + e] for r, (p, e) in enumerate(zip(prefix, extend))]).astype(np.int64)
        fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND if k == 0 else ForwardMode.DECODE,
                             req_pool_indices=be.arr(np.arange(1, 4)), seq_lens=be.arr(np.add(prefix, extend)),
                             extend_seq_lens=be.arr(np.array(extend, np.int32)) if k == 0 else None,
                             extend_prefix_lens=be.arr(np.array(prefix, np.int32)), input_ids=be.arr(ids),
                             positions=be.arr(pos), out_cache_loc=be.arr(loc))
        batch = sglang_batch(fb, be.arr(rtt), full_to_swa=getattr(dev, "full_to_swa_index_mapping", None))
        canary.before_forward(batch)
        for name, layers in ctx.bufs.items():
            rows = mapping[loc] if name.startswith("swa.") else loc
            for buf in layers:
                values = rand(rng, (len(rows),) + tuple(buf.shape[1:]), np.uint8 if kind == "fp8" else np.int16)
                buf[be.arr(rows)] = be.arr(values)
        canary.after_forward(batch)
        be.sync()
    canary.flush()
    return [r for r in records if r["type"] == "violation"], canary


def tags_reasons(records):
    return sorted({(r["launch_tag"], "+".join(r["fail_reason"])) for r in records})


@pytest.mark.parametrize("kind", ["mha", "mla", "fp8", "swa"])
def test_sglang_run_is_clean(kind):
    records, canary = run_sglang(kind, layers="all", swa_layers="all", hash_mode="all")
    assert records == [] and canary.stats()["verified_slots"] > 0


SGLANG_FAULTS = [  # kind, buffer, layers, launch tag expected (None: the byte is not fingerprinted)
    ("mha", "k_buffer", "all", "TAIL_K_FULL"), ("mha", "v_buffer", "all", "TAIL_V_FULL"),
    ("mha", "k_buffer", None, None), ("mla", "kv_buffer", "all", "TAIL_K_FULL"),
    ("fp8", "k_scale_buffer", "all", "TAIL_K_FULL"), ("fp8", "v_buffer", "all", "TAIL_V_FULL"),
    ("swa", "swa.k_buffer", "all", "TAIL_K_SWA"), ("swa", "full.v_buffer", "all", "TAIL_V_FULL"),
]


def flip_layer2(buffer, hit, *, at=2, request=1, position=30):
    """A corrupt callback: before step ``at``, flip byte 1 of layer 2 of ``buffer`` for the token at
    ``position`` of ``request`` (inside the SWA window of its next steps)."""
    def corrupt(step, ctx):
        if step == at:
            row = ctx.swa_slot(request, position) if buffer.startswith("swa.") else ctx.slot(request, position)
            ctx.be.flip(ctx.bufs[buffer][2][row], 1)
            hit["slot"] = row
    return corrupt


@pytest.mark.parametrize("kind,buffer,layers,tag", SGLANG_FAULTS)
def test_sglang_run_reports_a_corrupted_byte(kind, buffer, layers, tag):
    hit = {}
    records, _ = run_sglang(kind, corrupt=flip_layer2(buffer, hit), layers=layers, swa_layers=layers,
                            hash_mode="partial")
    if tag is None:
        assert records == []
        return
    assert {r["step"] for r in records} == {2, 3} and tags_reasons(records) == [(tag, "verify_real_kv_hash")]
    assert {r["slot_idx"] for r in records} == {hit["slot"]}


def test_sglang_swa_window_ignores_old_tokens():
    hit = {}
    records, _ = run_sglang("swa", corrupt=flip_layer2("swa.k_buffer", hit, position=3), swa_layers="all")
    assert records == []  # position 3 of a 34+ token request is outside the window of 8


# ---- vLLM runs --------------------------------------------------------------------------------------
def run_vllm(be=Host, *, steps=4, corrupt=None, seed=0, nb=40, bs=4, **kw):
    """Like :func:`run_sglang` for per-layer ``[2, blocks, block_size, heads, dim]`` caches and a
    block table; ``ctx.table`` is the host block table the step's metadata is made from."""
    rng = np.random.default_rng(seed)
    caches = [be.arr(rand(rng, (2, nb, bs, 2, 16))) for _ in range(3)]
    records = []
    canary = vllm_canary(caches, export=records.append, max_batch=4, **kw)
    need = [-(-(n + steps) // bs) for n in LENS]
    perm = rng.permutation(np.arange(1, nb))
    table = np.zeros((3, max(need)), np.int32)
    for r, n in enumerate(need):
        table[r, :n] = perm[sum(need[:r]):sum(need[:r]) + n]
    clean = table.copy()
    ctx = SimpleNamespace(caches=caches, be=be, table=table, bs=bs,
                          token=lambda layer, half, s: caches[layer][half, s // bs, s % bs])
    for k, prefix, extend, tokens in _requests(rng, steps):
        table[...] = clean
        if corrupt is not None:
            corrupt(k, ctx)
        slots = np.concatenate([clean[r, p // bs] * bs + p % bs for r, (a, e) in enumerate(zip(prefix, extend))
                                for p in [np.arange(a, a + e)]]).astype(np.int64)
        pos = np.concatenate([np.arange(p, p + e) for p, e in zip(prefix, extend)])
        ids = np.concatenate([t[p:p + e] for t, p, e in zip(tokens, prefix, extend)]).astype(np.int32)
        qsl = np.concatenate([[0], np.cumsum(extend)]).astype(np.int32)
        batch = vllm_batch(block_table=be.arr(table.copy()), seq_lens=be.arr(np.add(prefix, extend).astype(np.int32)),
                           query_start_loc=be.arr(qsl), slot_mapping=be.arr(slots), input_ids=be.arr(ids),
                           positions=be.arr(pos), block_size=bs)
        canary.before_forward(batch)
        b, o = be.arr(slots // bs), be.arr(slots % bs)
        for c in caches:
            for half in (0, 1):
                c[half, b, o] = be.arr(rand(rng, (len(slots), 2, 16)))
        canary.after_forward(batch)
        be.sync()
    canary.flush()
    return [r for r in records if r["type"] == "violation"], canary


def test_vllm_run_is_clean():
    records, canary = run_vllm(layers="all", hash_mode="all")
    assert records == [] and canary.stats()["verified_slots"] > 0


def vllm_flip(hit):
    """Before step 2, flip byte 0 of layer 1's V for position 13 of request 1."""
    def corrupt(step, ctx):
        if step == 2:
            s = int(ctx.table[1, 3]) * ctx.bs + 1
            ctx.be.flip(ctx.token(1, 1, s), 0)
            hit["slot"] = s
    return corrupt


def vllm_bad_table(step, ctx):
    """Step 2 only: request 1's positions 8..11 read the slots of positions 0..3."""
    if step == 2:
        ctx.table[1, 2] = ctx.table[1, 0]


def test_vllm_run_reports_a_corrupted_byte():
    hit = {}
    records, _ = run_vllm(corrupt=vllm_flip(hit), layers=[0, 1])
    assert {r["step"] for r in records} == {2, 3} and tags_reasons(records) == [("TAIL_V_FULL", "verify_real_kv_hash")]
    assert {r["slot_idx"] for r in records} == {hit["slot"]}


def test_vllm_run_reports_a_corrupted_block_table():
    records, _ = run_vllm(corrupt=vllm_bad_table)
    assert {r["step"] for r in records} == {2}
    assert {r["launch_tag"] for r in records} == {"HEAD_K_FULL", "HEAD_V_FULL", "TAIL_K_FULL", "TAIL_V_FULL"}
    head_k = sorted((r["position"], "+".join(r["fail_reason"])) for r in records if r["launch_tag"] == "HEAD_K_FULL")
    assert head_k == [(0, "verify_chain_hash+verify_position"), (1, "verify_position"), (2, "verify_position"),
                      (3, "verify_position"), (12, "verify_chain_hash")]
