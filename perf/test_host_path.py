"""Issue 12: host time per eager step when an engine hands over new tensors every step.

An engine never passes the same tensor objects twice: SGLang builds a new ForwardBatch per step,
vLLM slices its persistent buffers per step, and the adapters create tensors of their own. Each
row times one eager ``before_forward`` + ``after_forward`` (host seconds, the stream idle at each
round's start) against the floor: the launches the canary made per step (counted, the pump's
snapshot included) x the raw ``cuLaunchKernel`` floor measured in this run; target <= 1.5x. Python
runs at different speeds on different lent hosts, more than their launch floors differ: a
calibration row times a fixed pure-Python workload (``perf/timing.py``) in the same run, and every
host row carries its time in units of it (``python_calibrations``), so two runs compare through it.

- ``fresh Batch``: a ``kvcanary.Batch`` of new torch tensors every step (prebuilt, so the
  engine's own allocations stay out of the timed region; the addresses differ step to step);
- ``reused Batch``: one Batch object every step (no regression of the hot path);
- ``SglangBatchStager``: the same ForwardBatches staged in one launch into persistent buffers (the
  canary's launches then replay without keying the step's tensors);
- ``sglang_batch``: an SGLang-shaped ForwardBatch (forward_mode, req_pool_indices, seq_lens,
  input_ids, positions, out_cache_loc; EXTEND adds extend_prefix_lens / extend_seq_lens) of new
  tensors every step through ``kvcanary.adapters.sglang_batch`` (its casts and arithmetic
  included: they are what the adapter costs);
- ``vllm_batch``: vLLM-style persistent buffers (block table, seq_lens, query_start_loc,
  slot_mapping) sliced per step, through ``kvcanary.adapters.vllm_batch`` with a persistent
  ``req_to_token`` output;
- ``ops``: ``build_plan`` + ``fused_verify`` + ``write`` called eagerly on a fresh Batch;
- ``TransformersCanary``: ``generate_batch`` runs of a small bf16 Llama (3 layers, hidden 128: a
  host-bound step, so the canary's host time shows) with continuous batching, with and without the
  canary in turn, timing each generation's loop (not the manager's set-up); the added time per
  step against the launches the canary made per step x the floor.
Shapes: decode bs 1 / 64 / 256 x 1024 cached tokens, and an extend batch (4 requests x 512 new
tokens after 1024 cached: a chunk of a chunked prefill). Pools: K and V halves of one layer,
PARTIAL fingerprints, a paged layout for the vLLM rows.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import kvcanary as kc

from .clocks import reported
from .timing import python_workload
from .workloads import settle, sglang_forward_batches

TARGET = ("<=", 1.5)
SHAPES = {"decode-bs1": (1, 1024, 1), "decode-bs64": (64, 1024, 1), "decode-bs256": (256, 1024, 1),
          "extend-4x512": (4, 1024, 512)}
PREBUILT = 32  # distinct fresh batches cycled through (new addresses every step)


def torch_or_skip():
    return pytest.importorskip("torch")


def as_torch(torch, a):
    return torch.as_tensor(a, device="cuda")


def make_canary(w, torch):
    pool = as_torch(torch, w.pool)
    src = kc.source_from_slots(pool)
    canary = kc.KvCanary(kc.PoolGroup(w.num_slots, k_sources=[src], v_sources=[src]), device=0,
                         hash_mode="partial", mode="log", max_batch=w.bs, verify_capacity=max(1, w.entries))
    settle()
    canary.before_forward(w.setup, stream=w.stream)  # stamp the cached prefix into HEAD and TAIL
    canary.after_forward(w.setup, stream=w.stream)
    return canary


def fresh_batches(torch, w):
    """PREBUILT Batches of new torch tensors holding the workload's timed step."""
    fields = {k: v for k, v in w.batch.__dict__.items() if hasattr(v, "__cuda_array_interface__")}
    base = {k: as_torch(torch, v) for k, v in fields.items()}
    out = []
    for _ in range(PREBUILT):
        out.append(kc.Batch(**{k: t.clone() for k, t in base.items()}))
    return out


def forward_batches(torch, w, mode: str):
    """PREBUILT SGLang-style ForwardBatches (new tensors each) of the workload's timed step."""
    b = {k: as_torch(torch, v) for k, v in w.batch.__dict__.items() if hasattr(v, "__cuda_array_interface__")}
    return sglang_forward_batches(torch, b, mode, PREBUILT)


def time_steps(report, timer, bounds, canary, make_batch, name: str, other_launches=lambda: 0) -> float:
    """Host time per eager step of make_batch() + before_forward + after_forward, against the
    launches per step (the canary's, plus ``other_launches()`` counted by the batch's maker)."""
    t, n = measure_steps(report, timer, canary, make_batch, other_launches)
    report.row(f"host path: {name}", t, "s", bound=n * bounds.launch_floor,
               bound_name=f"{n:.3g} launches per step x raw launch floor", target=TARGET, launches_per_step=n,
               python_calibration_s=bounds.python_speed, python_calibrations=t / bounds.python_speed)
    return t


def measure_steps(report, timer, canary, make_batch, other_launches=lambda: 0) -> tuple[float, float]:
    """(host seconds per eager step of make_batch() + before_forward + after_forward, launches per step)."""
    calls = [0]

    def step():
        calls[0] += 1
        batch = make_batch()
        canary.before_forward(batch, stream=timer.handle)
        canary.after_forward(batch, stream=timer.handle)

    for _ in range(3):  # packed once per layout, outside the timed rounds
        step()
    n0, c0 = canary.launch_count + other_launches(), calls[0]
    t = report.host(step, batch=10, rounds=15, sync=timer.sync)
    n = (canary.launch_count + other_launches() - n0) / (calls[0] - c0)
    canary.flush()
    assert canary.stats()["violations"] == 0, "the benchmark workload must step clean"
    return t, n


STAGER_TARGET = ("<=", 2.0)  # issue 46: a stager's step <= 2x the manager's own step, same canary, same run


def canary_step(canary, make_batch, stream: int):
    """One eager step of the canary on make_batch()'s Batch (what every host row times)."""
    def step():
        batch = make_batch()
        canary.before_forward(batch, stream=stream)
        canary.after_forward(batch, stream=stream)
    return step


def stager_against_manager(report, timer, bounds, canary, staged_step, name: str):
    """Issue 46's row: the stager's step on fresh engine tensors against the manager's step on one
    reused Batch (the stager's own: the manager's host path alone), both on this canary, timed
    interleaved in this run (``timer.host_time``)."""
    reused = staged_step()
    t = timer.host_time({"staged": canary_step(canary, staged_step, timer.handle),
                         "manager": canary_step(canary, lambda: reused, timer.handle)}, batch=10, repeat=15)
    canary.flush()
    assert canary.stats()["violations"] == 0, "the benchmark workload must step clean"
    report.row(f"host path: {name} step vs the manager step", t["staged"], "s", bound=t["manager"],
               bound_name="the manager's step on one reused Batch, same canary, interleaved", target=STAGER_TARGET,
               manager_s=t["manager"], launch_floor_s=bounds.launch_floor)


def test_python_speed_calibration(report, bounds):
    """This host's speed at a fixed pure-Python workload, beside its raw launch floor: host rows of two
    runs compare through it (each host row carries ``python_calibrations``: its time in units of it)."""
    t = report.host(python_workload, batch=20, rounds=30)
    report.row("host path: calibration, a fixed pure-Python workload (perf/timing.py)", t, "s",
               bound=bounds.launch_floor, bound_name="raw launch floor, same run")


@pytest.mark.parametrize("how", ["fresh Batch", "reused Batch", "sglang_batch", "SglangBatchStager"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_manager_host_path(report, workloads, timer, bounds, shape, how):
    torch = torch_or_skip()
    from kvcanary.adapters import SglangBatchStager, sglang_batch
    w = workloads.get(*SHAPES[shape])
    canary = make_canary(w, torch)
    staged = lambda: 0  # noqa: E731  (launches a stager made)
    if how == "reused Batch":
        batch = w.batch
        make = lambda: batch  # noqa: E731
    elif how == "fresh Batch":
        make = itertools.cycle(fresh_batches(torch, w)).__next__
    elif how == "sglang_batch":
        rtt = as_torch(torch, w.rtt)
        fbs = itertools.cycle(forward_batches(torch, w, "DECODE" if w.extend == 1 else "EXTEND"))
        make = lambda: sglang_batch(next(fbs), rtt)  # noqa: E731
    else:
        stager = SglangBatchStager(as_torch(torch, w.rtt), max_reqs=w.bs, max_tokens=w.bs * w.extend)
        fbs = itertools.cycle(forward_batches(torch, w, "DECODE" if w.extend == 1 else "EXTEND"))
        make = lambda: stager(next(fbs))  # noqa: E731
        staged = lambda: stager.launches  # noqa: E731
    time_steps(report, timer, bounds, canary, make, f"manager, {how}, {w.label}", other_launches=staged)
    if how == "SglangBatchStager":
        stager_against_manager(report, timer, bounds, canary, make, f"SglangBatchStager (a new ForwardBatch's "
                               f"tensors every step), {w.label}")


@pytest.mark.parametrize("how", ["vllm_batch", "VllmBatchStager"])
@pytest.mark.parametrize("shape", ["decode-bs1", "decode-bs64", "decode-bs256"])
def test_vllm_persistent_buffers_sliced_per_step(report, workloads, timer, bounds, shape, how):
    """vLLM's persistent metadata buffers sliced per step, turned into the canary's Batch by
    ``vllm_batch`` (torch ops, new tensors) or by a ``VllmBatchStager`` (one staging launch into
    its own buffers, counted among the step's launches)."""
    torch = torch_or_skip()
    from kvcanary.adapters import VllmBatchStager, vllm_batch
    bs, prefix, extend = SHAPES[shape]
    w = workloads.get(bs, prefix, extend, layout="paged")
    canary = make_canary(w, torch)
    block = 16
    blocks = torch.as_tensor(np.ascontiguousarray(w.slots[:, ::block] // block).astype(np.int32), device="cuda")
    max_reqs = 2 * bs  # persistent buffers are larger than the batch; the step slices them
    table = torch.zeros((max_reqs, blocks.shape[1]), dtype=torch.int32, device="cuda")
    table[:bs] = blocks
    seq = torch.zeros(max_reqs, dtype=torch.int32, device="cuda")
    seq[:bs] = prefix + extend
    qsl = torch.arange(max_reqs + 1, dtype=torch.int32, device="cuda") * extend
    b = {k: as_torch(torch, v) for k, v in w.batch.__dict__.items() if hasattr(v, "__cuda_array_interface__")}
    slot_mapping = torch.full((2 * bs * extend,), -1, dtype=torch.int64, device="cuda")
    slot_mapping[:bs * extend] = b["out_cache_loc"]
    ids = torch.zeros(2 * bs * extend, dtype=torch.int32, device="cuda")
    ids[:bs * extend] = b["input_ids"]
    pos = torch.zeros(2 * bs * extend, dtype=torch.int64, device="cuda")
    pos[:bs * extend] = b["positions"]
    rtt_out = torch.zeros((max_reqs + 1, blocks.shape[1] * block), dtype=torch.int32, device="cuda")
    t = bs * extend

    def make():
        return vllm_batch(block_table=table[:bs], seq_lens=seq[:bs], query_start_loc=qsl[:bs + 1],
                          slot_mapping=slot_mapping[:t], input_ids=ids[:t], positions=pos[:t], block_size=block,
                          req_to_token=rtt_out)

    if how == "vllm_batch":
        time_steps(report, timer, bounds, canary, make, f"manager, vllm_batch (persistent buffers sliced), {w.label}")
        return
    stager = VllmBatchStager(max_reqs=max_reqs, max_tokens=2 * bs * extend, max_len=blocks.shape[1] * block,
                             block_size=block)
    h = timer.handle

    def staged():
        return stager(block_table=table[:bs], seq_lens=seq[:bs], query_start_loc=qsl[:bs + 1],
                      slot_mapping=slot_mapping[:t], input_ids=ids[:t], positions=pos[:t], stream=h)

    time_steps(report, timer, bounds, canary, staged, f"manager, VllmBatchStager (persistent buffers sliced), "
               f"{w.label}", other_launches=lambda: stager.launches)
    # The engine slices its buffers for its own attention metadata every step: the slices are the
    # engine's (new tensor objects every step, prebuilt here), the stager's cost is what it does with them.
    slices = itertools.cycle([dict(block_table=table[:bs], seq_lens=seq[:bs], query_start_loc=qsl[:bs + 1],
                                   slot_mapping=slot_mapping[:t], input_ids=ids[:t], positions=pos[:t])
                              for _ in range(PREBUILT)])
    stager_against_manager(report, timer, bounds, canary, lambda: stager(**next(slices), stream=h),
                           f"VllmBatchStager (the engine's per-step slices of its persistent buffers), {w.label}")


@pytest.mark.parametrize("shape", ["decode-bs1", "decode-bs64", "decode-bs256"])
def test_ops_path_eager(report, workloads, timer, bounds, shape):
    torch = torch_or_skip()
    w = workloads.get(*SHAPES[shape])
    ctx, plan = w.context("partial"), w.plan()
    batches = itertools.cycle(fresh_batches(torch, w))
    h = timer.handle

    def step():
        b = next(batches)
        kc.build_plan(b, plan, stream=h)
        kc.fused_verify(ctx, b, plan, stream=h)
        kc.write(ctx, plan, b.input_ids, b.positions, b.out_cache_loc, stream=h)

    for _ in range(3):
        step()
    t = report.host(step, batch=10, rounds=15, sync=timer.sync)
    assert w.violations() == 0, "the benchmark workload must step clean"
    report.row(f"host path: ops build_plan + fused_verify + write, fresh Batch, {w.label}", t, "s",
               bound=3 * bounds.launch_floor, bound_name="3 launches x raw launch floor", target=TARGET,
               launches_per_step=3)


@reported
@pytest.mark.parametrize("how", ["staged", "torch ops"])
def test_transformers_canary_generation(report, bounds, how):
    """Issue 12: TransformersCanary in continuous batching, each step's Batch staged in one launch
    (PagedBatchStager) or built with torch ops (stage_on_device=False); the expected tokens are
    staged in pinned memory either way. 16 requests of 40-120 prompt tokens, 24 new tokens each,
    greedy. Timed: the generation loop (perf/transformers_workload.py), with and without the canary
    in turn; a whole generate_batch also builds the manager and the cache, whose time varied more
    than the canary costs (issue 27)."""
    import statistics
    torch = torch_or_skip()
    transformers = pytest.importorskip("transformers")
    from kvcanary.adapters import TransformersCanary
    from kvcanary.adapters.transformers_layout import check_transformers_version

    from .transformers_workload import LOOPS, time_the_loop
    try:
        check_transformers_version(transformers.__version__)
    except kc.ValidationError as exc:
        pytest.skip(str(exc).splitlines()[0])
    time_the_loop()
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = transformers.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    model.set_attn_implementation("sdpa")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 512, int(rng.integers(40, 120))).tolist() for _ in range(16)]
    gen = transformers.GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=-1)
    cb = transformers.ContinuousBatchingConfig(page_size=16, num_blocks=512, max_batch_tokens=256,
                                               max_requests_per_batch=16, use_cuda_graph=False,
                                               use_async_batching=False, max_blocks_per_request=0)
    seen = []  # the canary's launches so far at each step's end (a generation's canary counts from 0)
    canary = TransformersCanary(model, after_step=lambda info: seen.append(tc_launches()),
                                stage_on_device=how == "staged")

    def tc_launches() -> int:
        return canary.canary.launch_count if canary.canary is not None else 0

    def generate(with_canary: bool) -> float:
        """Seconds of one generation's loop."""
        n = len(LOOPS)
        if with_canary:
            with canary:
                model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
        else:
            model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
        torch.cuda.synchronize()
        assert len(LOOPS) == n + 1
        return LOOPS[-1]

    generate(False)  # warm: kernels, allocator, the canary's compile and packing
    generate(True)
    seen.clear()
    steps0, without = canary.steps, []

    def one_round() -> float:
        without.append(generate(False))
        return generate(True)
    t = report.reported(one_round, rounds=5)
    t0 = statistics.median(without)
    runs = len(without)
    steps = (canary.steps - steps0) / runs
    staging = 1 if how == "staged" else 0  # the stager's launch per step, beside the canary's
    launches = sum(_last_of_each_run(seen)) / runs + staging * steps
    assert canary.summary()["detections"] == 0, "the benchmark generation must run clean"
    per_step = launches / steps
    label = "" if how == "staged" else ", torch ops"
    report.row(f"host path: TransformersCanary (continuous batching, 16 requests, 3-layer bf16 Llama{label}), added "
               "time per step of the generation loop", (t - t0) / steps, "s", bound=per_step * bounds.launch_floor,
               bound_name=f"{per_step:.3g} launches per step x raw launch floor", target=TARGET,
               steps_per_generation=steps, loop_s=t, loop_without_s=t0)
    report.row(f"host path: TransformersCanary (continuous batching, 16 requests, 3-layer bf16 Llama{label}), "
               "generation loop overhead", (t - t0) / t0, "of the loop", loop_s=t, loop_without_s=t0)


def _last_of_each_run(seen: list) -> list:
    """The launch count at the last step of each generation (each generation's canary counts from 0)."""
    return [n for i, n in enumerate(seen) if i + 1 == len(seen) or seen[i + 1] < n]


def test_step_keying_against_cuda_core_views(report, timer):
    """Issue 46: what the per-step path pays to key an engine's fresh tensors (a stager's inputs:
    ``kvcanary.ops.packing.arg_keys`` reads each tensor's layout and address) against what
    cuda-python's own ``cuda.core`` view would cost (``StridedMemoryView``, through DLPack, with
    stream ordering), for the 7 tensors of an SGLang decode step, timed interleaved. The bound is
    the cuda.core side: a ratio below 1 says kvcanary's keying is the cheaper per step."""
    torch = torch_or_skip()
    core = pytest.importorskip("cuda.core.utils")
    from kvcanary.ops.packing import arg_keys
    tensors = [torch.zeros(64, dtype=torch.int64, device="cuda") for _ in range(7)]
    s = timer.handle
    keys, views = report.host(lambda: arg_keys(tensors), batch=50, rounds=15,
                              interleave=lambda: [core.StridedMemoryView(x, stream_ptr=s) for x in tensors])
    report.row("host path: keying a step's 7 fresh tensors (arg_keys) vs cuda.core StridedMemoryView of them",
               keys, "s", bound=views, bound_name="cuda.core.utils.StridedMemoryView x 7, interleaved",
               target=("<=", 1.0))
