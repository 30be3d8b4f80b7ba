"""Hugging Face transformers generations for the TransformersCanary benchmarks (issue 27), also a
profiling script.

The workload a Hugging Face user runs: ``generate_batch`` with continuous batching (paged KV,
``sdpa``) of a randomly initialised bf16 Llama, 32 requests of 64-256 prompt tokens, 64 new
tokens each, greedy. Engines: ``fast`` (CUDA graphs and async batching on, what transformers
turns on by default for a flash implementation) and ``plain`` (both off). Models: ``8x1024`` (8
layers, hidden 1024) and ``4x256``. Each generation builds its manager anew (warm-up and graph
captures included), as ``generate_batch`` does.

    python -m perf.transformers_workload [--model 8x1024] [--engine fast] [--layers first|all|none]
                                         [--mode log|fail_request] [--rounds 3] [--profile PATH]
                                         [--cprofile PATH]

prints the wall time of each round, the canary's steps and its host time by part
(``TransformersCanary.host_seconds``); ``--profile PATH`` runs the torch profiler (CPU and CUDA)
over the last round and writes its tables by self CPU and self CUDA time to PATH; ``--cprofile PATH``
runs cProfile in the generation loop's thread during the last round and writes its statistics (the
kvcanary functions by cumulative time, then every function by own time) to PATH.
"""

from __future__ import annotations

import argparse
import time

MODELS = {"8x1024": dict(num_hidden_layers=8, hidden_size=1024, intermediate_size=2816, num_attention_heads=16,
                         num_key_value_heads=8),
          "4x256": dict(num_hidden_layers=4, hidden_size=256, intermediate_size=704, num_attention_heads=4,
                        num_key_value_heads=2)}
ENGINES = {"fast": dict(use_cuda_graph=True, use_async_batching=True),
           "plain": dict(use_cuda_graph=False, use_async_batching=False, max_blocks_per_request=0)}
REQUESTS, NEW_TOKENS = 32, 64
# Every request fits at once (32 x 21 blocks of 16 tokens): a cache sized to the workload, not to the
# GPU's free memory (transformers' default; the sdpa attention mask of the plain engine spans every
# token the cache can hold, 512 x millions of entries on an H200)
NUM_BLOCKS = 1024


def build(model: str):
    """(the model on cuda:0 in bf16, the prompts): seeded, the same every call."""
    import numpy as np
    import torch
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, max_position_embeddings=4096, **MODELS[model])
    m = transformers.LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()
    m.set_attn_implementation("sdpa")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 32000, int(rng.integers(64, 257))).tolist() for _ in range(REQUESTS)]
    return m, prompts


LOOPS: list = []  # seconds of each generation loop run (the background thread's), appended by the wrapper
PROFILE: list = []  # a cProfile.Profile to run in the next generation loop's thread (--cprofile)
PARTS: dict = {}  # "Class.method" -> [calls, seconds] (--parts)


def time_parts() -> None:
    """Wrap the methods a canary step goes through (on their classes, once) to add up their calls
    and host seconds in :data:`PARTS`: where a step's host time goes, without cProfile's overhead."""
    from kvcanary.adapters import transformers_batch, transformers_fail, transformers_paged
    from kvcanary.manager.canary import KvCanary
    from kvcanary.reporting.monitor import Monitor
    targets = [(transformers_paged.TransformersCanary, ("_note_requests", "_step", "_step_around")),
               (transformers_batch.StepBatches, ("batch", "stage_expected", "shaped")),
               (transformers_batch._PinnedRing, ("take", "send")),
               (transformers_fail.RequestFailer, ("noted", "update")),
               (KvCanary, ("before_forward", "after_forward", "poll", "record_replay")),
               (Monitor, ("report",))]
    try:
        import torch
        targets.append((torch.cuda.CUDAGraph, ("replay",)))
    except ImportError:
        pass
    for cls, names in targets:
        for name in names:
            original = getattr(cls, name, None)
            if original is None or getattr(original, "_kvcanary_part", False):
                continue
            key = f"{cls.__name__}.{name}"

            def part(*args, _original=original, _key=key, **kwargs):
                t0 = time.perf_counter()
                try:
                    return _original(*args, **kwargs)
                finally:
                    entry = PARTS.setdefault(_key, [0, 0.0])
                    entry[0] += 1
                    entry[1] += time.perf_counter() - t0
            part._kvcanary_part = True
            setattr(cls, name, part)


def time_the_loop() -> None:
    """Wrap ``ContinuousBatchingManager._run_generation_loop`` (once, on the class) to record how
    long each generation loop runs: every step of the generation, without the manager's set-up,
    cache allocation and warm-up (graph captures), whose time varies from run to run by more than
    the canary costs."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager as M
    if getattr(M._run_generation_loop, "_kvcanary_timed", False):
        return
    original = M._run_generation_loop

    def timed(self, *args, **kwargs):
        prof = PROFILE.pop() if PROFILE else None
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            LOOPS.append(time.perf_counter() - t0)
            if prof is not None:
                prof.disable()
    timed._kvcanary_timed = True
    M._run_generation_loop = timed


def generate(model, prompts, engine: str, canary=None) -> tuple[float, float, list]:
    """(wall seconds of the whole generate_batch, seconds of its generation loop, generated tokens
    in request order), ``canary`` attached (a TransformersCanary) or not."""
    import torch
    import transformers
    time_the_loop()
    gen = transformers.GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1)
    cb = transformers.ContinuousBatchingConfig(page_size=16, num_blocks=NUM_BLOCKS, max_batch_tokens=512,
                                               max_requests_per_batch=REQUESTS, **ENGINES[engine])
    torch.cuda.synchronize()
    loops = len(LOOPS)
    t0 = time.perf_counter()
    if canary is None:
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    else:
        with canary:
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    torch.cuda.synchronize()
    t = time.perf_counter() - t0
    assert all(o.error is None for o in out.values()), [o.error for o in out.values() if o.error][:1]
    assert len(LOOPS) == loops + 1, "expected one generation loop per generate_batch"
    return t, LOOPS[-1], [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.split("_")[-1]))]


def canary_for(model, layers: str | None, mode: str = "log"):
    """A TransformersCanary with ``layers`` fingerprinted (PARTIAL) in ``mode``, or None for ``layers=None``."""
    if layers is None:
        return None
    from kvcanary.adapters import TransformersCanary
    return TransformersCanary(model, layers=layers, hash_mode="partial", mode=mode)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="8x1024", choices=MODELS)
    ap.add_argument("--engine", default="fast", choices=ENGINES)
    ap.add_argument("--layers", default="first", choices=["first", "all", "none"])
    ap.add_argument("--mode", default="log", choices=["log", "fail_request"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", default=None, help="write the torch profiler's tables of the last round here")
    ap.add_argument("--cprofile", default=None, help="write cProfile stats of the last round's loop thread here")
    ap.add_argument("--parts", action="store_true", help="print each round's host time by canary method")
    a = ap.parse_args()
    if a.parts:
        time_parts()
    model, prompts = build(a.model)
    tc = canary_for(model, None if a.layers == "none" else a.layers, mode=a.mode)
    generate(model, prompts, a.engine, tc)  # warm-up: kernels, allocator, compiles
    for i in range(a.rounds):
        last = i == a.rounds - 1 and a.profile
        prof = None
        if last:
            import torch
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            prof = torch.profiler.profile(activities=acts)
            prof.__enter__()
        cprof = None
        if i == a.rounds - 1 and a.cprofile:
            import cProfile
            cprof = cProfile.Profile()
            PROFILE.append(cprof)
        steps0 = tc.steps if tc is not None else 0
        host0 = dict(tc.host_seconds) if tc is not None else {}
        t, loop, _ = generate(model, prompts, a.engine, tc)
        if prof is not None:
            prof.__exit__(None, None, None)
            with open(a.profile, "w") as f:
                for key in ("self_cpu_time_total", "self_cuda_time_total"):
                    f.write(prof.key_averages().table(sort_by=key, row_limit=40) + "\n")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        steps = (tc.steps - steps0) if tc is not None else 0
        host = {k: v - host0.get(k, 0.0) for k, v in (tc.host_seconds.items() if tc is not None else ())}
        per_step = sum(host.get(k, 0.0) for k in ("notes", "batch", "head", "tail")) / max(steps, 1)
        print(f"round {i}: {a.model} {a.engine} layers={a.layers} mode={a.mode}: {t:.3f} s ({loop:.3f} s in the "
              f"loop), {steps} canary steps, hooks {per_step * 1e6:.1f} us/step; canary host "
              + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in host.items()))
        if a.parts:
            print("  parts (calls, us per step): " + ", ".join(
                f"{k} {n} {sec / max(steps, 1) * 1e6:.1f}" for k, (n, sec) in sorted(PARTS.items())))
            PARTS.clear()
        if cprof is not None:
            import io
            import pstats
            text = io.StringIO()
            stats = pstats.Stats(cprof, stream=text)
            stats.sort_stats("cumulative").print_stats("kvcanary", 45)
            stats.sort_stats("tottime").print_stats(45)
            with open(a.cprofile, "w") as f:
                f.write(text.getvalue())

if __name__ == "__main__":
    main()
