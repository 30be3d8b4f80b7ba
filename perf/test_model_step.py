"""Issue 13: the overhead users feel, in a real model step.

A Llama-shaped decoder of about 1 B parameters (22 layers, hidden 2048, GQA 32 query / 8 KV heads
of 64, MLP 5632, vocab 32000; random bf16 weights) runs a decode step over a paged KV pool: each
layer writes the new token's K and V into its pool at ``out_cache_loc`` and gathers every cached
token through ``req_to_token`` for torch SDPA. The whole step is captured in one CUDA graph, the
canary's ``before_forward`` / ``after_forward`` inside it (``kvcanary.adapters.sglang_canary``
over the per-layer K/V buffers), and replayed; its GPU time is measured with CUDA events (no L2
flush: the step streams gigabytes); the canary's added time is the difference of the medians of
20 rounds with and 20 without it, interleaved. Rows: the step without the canary, then its overhead with
``layers="first"`` and ``layers="all"`` (PARTIAL; and all with the fingerprint budget
``fingerprint_every=8``, against all every step), bs 1 / 8 x 4096 and 64 / 256 x 2048 cached
tokens; at bs 1 and 8 the added time against the same canary launched without programmatic
dependent launch, timed beside it; the ``all`` rows also against the bytes the canary must touch (per verify entry its
req_to_token entry, four records and a 32-byte sector per fingerprinted strip; per new token its
stamps). Targets (issue 13): first <= 0.5 % at bs >= 64, <= 1 % at bs 1-8; all: added time
<= 1.5x its bytes bound at bs >= 64 and <= 15 us at bs 1; issue 29: all <= 1.5 % of the step at
every batch size. And an eager prefill chunk of 8192
tokens, with and without the canary.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from .clocks import gpu_timed

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 22, 2048, 32, 8, 64, 5632, 32000
SHAPES = {"bs1x4096": (1, 4096), "bs8x4096": (8, 4096), "bs64x2048": (64, 2048), "bs256x2048": (256, 2048)}
FIRST_TARGET = {1: 0.01, 8: 0.01, 64: 0.005, 256: 0.005}
ALL_TARGET = 0.015  # issue 29: layers=all within 1.5 % of the step at every batch size
BUDGET = 8  # fingerprint_every of the budget rows: a corrupted byte reported <= 7 steps after its first read
_ALL_ADDED: dict = {}  # shape -> added time of layers=all every step, measured earlier in this run


def t_all_cached(shape: str) -> float | None:
    """The layers=all row's added time of this run (parametrisation runs it before the budget row)."""
    return _ALL_ADDED.get(shape)


class Model:
    """The decoder's weights and paged KV pools (one per layer and half), and one forward."""

    def __init__(self, torch, num_slots: int, seed: int = 0):
        self.torch = torch
        g = torch.Generator(device="cuda").manual_seed(seed)
        w = lambda *s: (torch.randn(*s, device="cuda", generator=g, dtype=torch.bfloat16) / s[0] ** 0.5)  # noqa: E731
        self.embed, self.head = w(VOCAB, HIDDEN), w(HIDDEN, VOCAB)
        self.layers = [dict(q=w(HIDDEN, HEADS * HEAD_DIM), k=w(HIDDEN, KV_HEADS * HEAD_DIM),
                            v=w(HIDDEN, KV_HEADS * HEAD_DIM), o=w(HEADS * HEAD_DIM, HIDDEN),
                            gate=w(HIDDEN, MLP), up=w(HIDDEN, MLP), down=w(MLP, HIDDEN)) for _ in range(LAYERS)]
        shape = (num_slots, KV_HEADS, HEAD_DIM)
        self.k_pool = [torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(LAYERS)]
        self.v_pool = [torch.randn(shape, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(LAYERS)]
        inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, device="cuda", dtype=torch.float32) / HEAD_DIM))
        self.inv_freq = inv

    def rope(self, x, positions):
        t = self.torch
        ang = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = t.cos(ang)[:, None, :].to(x.dtype), t.sin(ang)[:, None, :].to(x.dtype)
        a, b = x[..., ::2], x[..., 1::2]
        return t.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)

    def forward(self, ids, positions, loc, rtt_rows, bs: int, q_len: int, ctx: int):
        """Tokens [bs * q_len] of bs requests, each attending to its first ``ctx`` slots."""
        t = self.torch
        F = t.nn.functional
        x = self.embed[ids]
        for i, L in enumerate(self.layers):
            h = F.rms_norm(x, (HIDDEN,))
            q = self.rope((h @ L["q"]).view(-1, HEADS, HEAD_DIM), positions)
            k = self.rope((h @ L["k"]).view(-1, KV_HEADS, HEAD_DIM), positions)
            v = (h @ L["v"]).view(-1, KV_HEADS, HEAD_DIM)
            self.k_pool[i][loc] = k
            self.v_pool[i][loc] = v
            K = self.k_pool[i][rtt_rows[:, :ctx]].transpose(1, 2)   # [bs, kv heads, ctx, dim]
            V = self.v_pool[i][rtt_rows[:, :ctx]].transpose(1, 2)
            Q = q.view(bs, q_len, HEADS, HEAD_DIM).transpose(1, 2)
            a = F.scaled_dot_product_attention(Q, K, V, is_causal=q_len > 1, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(-1, HEADS * HEAD_DIM) @ L["o"]
            h = F.rms_norm(x, (HIDDEN,))
            x = x + (F.silu(h @ L["gate"]) * (h @ L["up"])) @ L["down"]
        return F.rms_norm(x, (HIDDEN,)) @ self.head


def setup_step(torch, bs: int, ctx: int, q_len: int = 1, seed: int = 0):
    """(model, batch tensors) of a decode (q_len 1) or a prefill chunk over a random slot layout."""
    import kvcanary as kc
    rng = np.random.default_rng(seed)
    length = ctx + q_len if q_len == 1 else q_len
    num_slots = bs * length + 1
    slots = (rng.permutation(bs * length) + 1).reshape(bs, length)
    rtt = np.zeros((bs + 1, length), np.int32)
    rtt[1:] = slots
    model = Model(torch, num_slots, seed)
    T = lambda a, dt=torch.int64: torch.as_tensor(np.ascontiguousarray(a), device="cuda").to(dt)  # noqa: E731
    prefix = ctx if q_len == 1 else 0
    cols = slice(prefix, prefix + q_len)
    step = dict(rows=T(np.arange(1, bs + 1)), prefix=T(np.full(bs, prefix)), extend=T(np.full(bs, q_len)),
                rtt=T(rtt, torch.int32), ids=T(rng.integers(0, VOCAB, (bs, q_len)).reshape(-1)),
                pos=T(np.tile(np.arange(prefix, prefix + q_len), bs)), loc=T(slots[:, cols].reshape(-1)))
    batch = kc.Batch(step["rows"], step["prefix"], step["extend"], step["rtt"], input_ids=step["ids"],
                     positions=step["pos"], out_cache_loc=step["loc"])
    setup = None
    if prefix:  # the cached prefix's records, stamped over the pools' (random) bytes
        setup = kc.Batch(step["rows"], T(np.zeros(bs)), T(np.full(bs, prefix)), step["rtt"],
                         input_ids=T(rng.integers(0, VOCAB, (bs, prefix)).reshape(-1)),
                         positions=T(np.tile(np.arange(prefix), bs)), out_cache_loc=T(slots[:, :prefix].reshape(-1)))
    return model, step, batch, setup


def make_canary(model, bs: int, ctx: int, layers: str, setup, stream: int, fingerprint_every: int = 1):
    import types

    from kvcanary.adapters import sglang_canary
    pool = types.SimpleNamespace(k_buffer=model.k_pool, v_buffer=model.v_pool)
    canary = sglang_canary(pool, layers=layers, hash_mode="partial", mode="log", max_batch=bs,
                           verify_capacity=max(1, bs * ctx), fingerprint_every=fingerprint_every)
    if setup is not None:
        canary.before_forward(setup, stream=stream)
        canary.after_forward(setup, stream=stream)
        import torch
        torch.cuda.synchronize()  # the graph's warm-up runs on another stream: an engine orders its steps, so do we
    return canary


def graphed(torch, model, step, bs, ctx, canary, batch, timer):
    """fn(stream) replaying one captured decode step (the canary inside the graph, if any)."""
    def body():
        s = torch.cuda.current_stream().cuda_stream
        if canary is not None:
            canary.before_forward(batch, stream=s)
        model.forward(step["ids"], step["pos"], step["loc"], step["rtt"][step["rows"]], bs, 1, ctx + 1)
        if canary is not None:
            canary.after_forward(batch, stream=s)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        body()  # warm: kernels loaded, canary launches packed, outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=stream):
        body()
    ext = torch.cuda.ExternalStream(timer.handle)

    def replay(s):
        with torch.cuda.stream(ext):
            g.replay()
        if canary is not None:
            canary.record_replay()
    replay.graph = g
    return replay


@contextlib.contextmanager
def plain_launches():
    """Launches packed inside the block use no programmatic dependent launch (as KVCANARY_PDL=0):
    the A/B of the PDL rows, in one process."""
    from kvcanary.runtime import devices
    rt = devices.runtime(0)
    old, rt.pdl = rt.pdl, False  # the runtime's launch configs are keyed by their PDL flag
    try:
        yield
    finally:
        rt.pdl = old


def canary_bytes(bs: int, ctx: int, sources: int) -> int:
    """What the canary must touch per decode step: per verify entry (HEAD K, V and TAIL K, V) its
    req_to_token int32, four 32-byte records and a 32-byte sector per fingerprinted strip; per
    new token four records written and its strips read."""
    entries = bs * ctx
    return entries * (4 + 4 * 32 + sources * 32) + bs * (4 * 32 + sources * 32)


@gpu_timed
@pytest.mark.parametrize("layers", ["none", "first", "all", f"all-every{BUDGET}"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_model_decode_step(report, timer, bounds, shape, layers):
    torch = pytest.importorskip("torch")
    bs, ctx = SHAPES[shape]
    model, step, batch, setup = setup_step(torch, bs, ctx)
    layers, _, every = layers.partition("-every")
    canary = None if layers == "none" else make_canary(model, bs, ctx, layers, setup, timer.handle,
                                                       int(every or 1))
    run = graphed(torch, model, step, bs, ctx, canary, batch, timer)
    t = report.gpu(run, rounds=20, warmup=3, flush=False)
    name = f"model decode step (1.1B Llama-shaped, graph), {shape}"
    if canary is None:
        report.row(f"{name}, no canary", t, "s", series="model step", size=bs)
        return
    canary.poll(timer.handle)  # a snapshot behind the replays (the pump is never captured)
    canary.flush()
    assert canary.stats()["violations"] == 0, "the model step must run clean"
    canary.health_check()
    # the added time from rounds of the step with and without the canary interleaved (one after
    # the other, a clock drift between the two runs of 20 rounds moved bs 64's overhead 0.35 -> 0.55 %)
    runs = {"with": run, "without": graphed(torch, model, step, bs, ctx, None, batch, timer)}
    if bs <= 8 and not every:  # the same canary launched without programmatic dependent launch, beside it
        with plain_launches():
            off = make_canary(model, bs, ctx, layers, setup, timer.handle, 1)
            runs["with, PDL off"] = graphed(torch, model, step, bs, ctx, off, batch, timer)
    both = timer.gpu_time_interleaved(runs, warmup=3, repeat=20, flush=False)
    t, t0 = both["with"], both["without"]
    added = t - t0
    if "with, PDL off" in both:
        off.poll(timer.handle)
        off.flush()
        assert off.stats()["violations"] == 0, "the model step must run clean"
        off_added = both["with, PDL off"] - t0
        report.row(f"{name}: canary layers={layers} PARTIAL, added time with PDL / PDL off", added, "s",
                   bound=off_added, bound_name="the same canary, plain launches (same run)", ratio=added / off_added,
                   step_s=t, step_without_s=t0)
    if every:  # the fingerprint budget: identity every step, each token's bytes once every BUDGET steps
        report.row(f"{name}: canary layers=all PARTIAL fingerprint_every={every}, added time", added, "s",
                   bound=t_all_cached(shape), bound_name="layers=all PARTIAL, every step (same run)",
                   step_s=t, step_without_s=t0, overhead=added / t0,
                   worst_detection_latency_steps=int(every) - 1)
        return
    if layers == "first":
        report.row(f"{name}: canary layers=first PARTIAL, overhead", added / t0, "of the step", bound=FIRST_TARGET[bs],
                   bound_name="issue 13 target", target=("<=", 1.0), step_s=t, step_without_s=t0)
    else:
        sources = 2 * LAYERS
        nbytes = canary_bytes(bs, ctx, sources)
        bound = nbytes / bounds.copy_bandwidth
        _ALL_ADDED[shape] = added
        report.row(f"{name}: canary layers=all PARTIAL, added time", added, "s", bound=bound,
                   bound_name="bytes it must touch / copy bw", target=("<=", 1.5) if bs >= 64 else None,
                   step_s=t, step_without_s=t0, overhead=added / t0)
        report.row(f"{name}: canary layers=all PARTIAL, overhead", added / t0, "of the step", bound=ALL_TARGET,
                   bound_name="issue 29 target", target=("<=", 1.0), step_s=t, step_without_s=t0)
        if bs == 1:
            report.row(f"{name}: canary layers=all PARTIAL, added time vs 15 us", added, "s", bound=15e-6,
                       bound_name="issue 13 target", target=("<=", 1.0))


@contextlib.contextmanager
def l2_fetch_granularity(nbytes: int):
    """The current context's CU_LIMIT_MAX_L2_FETCH_GRANULARITY set to ``nbytes`` (a hint: how many
    bytes L2 fetches from DRAM per miss), the previous value restored after."""
    from cuda.bindings import driver as cu

    from kvcanary.runtime.driver import check
    limit = cu.CUlimit.CU_LIMIT_MAX_L2_FETCH_GRANULARITY
    old = int(check(cu.cuCtxGetLimit(limit), "cuCtxGetLimit(MAX_L2_FETCH_GRANULARITY)"))
    check(cu.cuCtxSetLimit(limit, nbytes), "cuCtxSetLimit(MAX_L2_FETCH_GRANULARITY)")
    try:
        yield old
    finally:
        check(cu.cuCtxSetLimit(limit, old), "cuCtxSetLimit(MAX_L2_FETCH_GRANULARITY)")


@gpu_timed
@pytest.mark.parametrize("shape", ["bs64x2048", "bs256x2048"])
def test_model_step_l2_granularity(report, timer, shape):
    """Issue 29 experiment: layers=all fingerprints a 16-byte strip of 44 pools per cached token at
    random slots, and ncu counts about 2.5x the DRAM bytes of a 32-byte sector per strip (L2
    fetches more than the sector a strip needs). The step with and without the canary, interleaved,
    at the context's default L2 fetch granularity and at 32 bytes: the canary's added time and the
    engine's own step (no canary) at 32 bytes against the default, same run."""
    torch = pytest.importorskip("torch")
    bs, ctx = SHAPES[shape]
    model, step, batch, setup = setup_step(torch, bs, ctx)
    canary = make_canary(model, bs, ctx, "all", setup, timer.handle)
    runs = {"with": graphed(torch, model, step, bs, ctx, canary, batch, timer),
            "without": graphed(torch, model, step, bs, ctx, None, batch, timer)}
    report.gpu(runs["with"], rounds=10, warmup=2, flush=False)
    base = timer.gpu_time_interleaved(runs, warmup=3, repeat=15, flush=False)
    with l2_fetch_granularity(32) as default:
        small = timer.gpu_time_interleaved(runs, warmup=3, repeat=15, flush=False)
    canary.poll(timer.handle)
    canary.flush()
    assert canary.stats()["violations"] == 0, "the model step must run clean"
    name = f"model decode step (1.1B Llama-shaped, graph), {shape}"
    added, added_small = base["with"] - base["without"], small["with"] - small["without"]
    report.row(f"{name}: canary layers=all PARTIAL added time, L2 fetch granularity 32 B / default ({default} B)",
               added_small, "s", bound=added, bound_name="the default granularity (same run)",
               step_without_s=base["without"], step_without_32_s=small["without"])
    report.row(f"{name}: the step without the canary, L2 fetch granularity 32 B / default ({default} B)",
               small["without"], "s", bound=base["without"], bound_name="the default granularity (same run)")


@gpu_timed
@pytest.mark.parametrize("canary_on", [False, True])
def test_model_prefill_chunk_eager(report, timer, bounds, canary_on):
    torch = pytest.importorskip("torch")
    chunk = 8192
    model, step, batch, _ = setup_step(torch, 1, 0, q_len=chunk)
    canary = make_canary(model, 1, chunk, "first", None, timer.handle) if canary_on else None
    ext = torch.cuda.ExternalStream(timer.handle)

    def run(s):
        with torch.cuda.stream(ext):
            if canary is not None:
                canary.before_forward(batch, stream=s)
            model.forward(step["ids"], step["pos"], step["loc"], step["rtt"][step["rows"]], 1, chunk, chunk)
            if canary is not None:
                canary.after_forward(batch, stream=s)

    t = report.gpu(run, rounds=10, warmup=2, flush=False)
    report.row(f"model prefill chunk (1.1B Llama-shaped, eager), 1x{chunk} new tokens, canary "
               f"{'layers=first PARTIAL' if canary_on else 'off'}", t, "s", series="model prefill", size=chunk)
