"""Host time per eager step of perf/test_host_path.py's workloads, on the CPU, launches as no-ops.

No GPU: kvcanary's driver layer runs on tests/support/fake_cuda.py ("device memory" is host memory) and
``cuLaunchKernelEx`` returns at once, so what is timed is kvcanary's own Python per step plus the
adapters' torch ops (CPU torch here: cheaper than CUDA torch ops, whose host cost is the launch).
CPU torch tensors stand in for CUDA ones: their views say device 0 (``--emulate`` instead runs
the emulated kernels, to check that the patched launches still read the right arrays).

    python -m perf.host_profile [--steps N] [--profile PATH] [--only SUBSTRING] [--device]

Prints µs per step for each path; ``--profile`` runs cProfile over the timed steps of one row.
``--device`` runs the same rows on CUDA tensors and the real driver (a GPU machine): the launches
are real, so the profile shows what a step's host time is made of there.
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import time

import numpy as np

SHAPES = {"decode-bs1": (1, 1024, 1), "decode-bs64": (64, 1024, 1), "decode-bs256": (256, 1024, 1),
          "extend-4x512": (4, 1024, 512)}
PREBUILT = 32
DEV = ["cpu"]  # where the workloads' torch tensors live ("cuda" with --device)


def install():
    """The fake driver (no-op launches) and CPU torch tensors seen as cuda:0 arrays."""
    import pytest

    from kvcanary.interop import arrays
    from tests.support import fake_cuda
    mp = pytest.MonkeyPatch()
    fake = fake_cuda.install(mp)
    fake.cuLaunchKernel = fake.cuLaunchKernelEx = lambda *a: (fake_cuda.OK,)
    mp.setattr(arrays, "_torch_ordinal", lambda obj: 0)
    return fake, mp


class Work:
    """perf/workloads.py's decode layout on host memory: bs requests, prefix cached, extend new."""

    def __init__(self, torch, bs, prefix, extend, layout="decode"):
        import kvcanary as kc
        self.bs, self.prefix, self.extend = bs, prefix, extend
        rng = np.random.default_rng(0)
        length = prefix + extend
        if layout == "paged":
            per_req = -(-length // 16)
            pages = (rng.choice(4 * bs * per_req, bs * per_req, replace=False) + 1).reshape(bs, per_req)
            pos = np.arange(length)
            slots, self.num_slots = pages[:, pos // 16] * 16 + pos % 16, (4 * bs * per_req + 1) * 16
        else:
            slots = 1 + np.arange(length)[None, :] * bs + np.arange(bs)[:, None]
            self.num_slots = bs * length + 1
        self.slots = slots.astype(np.int64)
        rtt = np.zeros((bs + 1, length), np.int32)
        rtt[1:] = slots
        tokens = rng.integers(0, 1 << 17, (bs, length)).astype(np.int64)
        T = lambda a: torch.from_numpy(a).to(DEV[0])  # noqa: E731
        self.rtt = T(rtt)
        lo, hi = np.full(bs, prefix), np.full(bs, prefix + extend)
        self.fields = dict(req_pool_indices=T(np.arange(1, bs + 1, dtype=np.int64)), prefix_lens=T(lo.astype(np.int64)),
                           extend_lens=T((hi - lo).astype(np.int64)), req_to_token=self.rtt,
                           input_ids=T(tokens[:, prefix:].reshape(-1).copy()),
                           positions=T(np.tile(np.arange(prefix, prefix + extend), bs).astype(np.int64)),
                           out_cache_loc=T(self.slots[:, prefix:].reshape(-1).copy()))
        self.batch = kc.Batch(**self.fields)
        self.setup = kc.Batch(self.fields["req_pool_indices"], T(np.zeros(bs, np.int64)), T(lo.astype(np.int64)),
                              self.rtt, input_ids=T(tokens[:, :prefix].reshape(-1).copy()),
                              positions=T(np.tile(np.arange(prefix), bs).astype(np.int64)),
                              out_cache_loc=T(self.slots[:, :prefix].reshape(-1).copy()))
        self.pool = torch.zeros((self.num_slots, 1024), dtype=torch.uint8, device=DEV[0])

    def canary(self):
        """The workload's canary; on a device, the cached prefix stamped first (the timed steps run clean)."""
        import kvcanary as kc
        src = kc.source_from_slots(self.pool)
        canary = kc.KvCanary(kc.PoolGroup(self.num_slots, k_sources=[src], v_sources=[src]), device=0,
                             hash_mode="partial", mode="log", max_batch=self.bs, verify_capacity=self.bs * self.prefix)
        if DEV[0] == "cuda":
            canary.before_forward(self.setup)
            canary.after_forward(self.setup)
        return canary

    def fresh(self):
        import kvcanary as kc
        return [kc.Batch(**{k: t.clone() for k, t in self.fields.items()}) for _ in range(PREBUILT)]

    def forward_batches(self, torch, mode):
        from perf.workloads import sglang_forward_batches
        return sglang_forward_batches(torch, self.fields, mode, PREBUILT)


def rows(torch, only):
    """(name, step function) of every timed path."""
    import kvcanary as kc
    from kvcanary.adapters import VllmBatchStager, sglang_batch, vllm_batch
    s = torch.cuda.current_stream().cuda_stream if DEV[0] == "cuda" else 0x5000
    for shape, (bs, prefix, extend) in SHAPES.items():
        for how in ("fresh Batch", "reused Batch", "sglang_batch", "SglangBatchStager"):
            name = f"manager, {how}, {shape}"
            if only and only not in name:
                continue
            w = Work(torch, bs, prefix, extend)
            canary = w.canary()
            if how == "reused Batch":  # kvcanary DeviceArrays, as perf/workloads.py's batches
                from kvcanary.runtime import memory
                reused = kc.Batch(**{k: memory.to_device(t.cpu().numpy()) for k, t in w.fields.items()})
                make = lambda b=reused: b  # noqa: E731
            elif how == "fresh Batch":
                make = itertools.cycle(w.fresh()).__next__
            elif how == "SglangBatchStager":
                stager = kc.adapters.SglangBatchStager(w.rtt, max_reqs=bs, max_tokens=bs * extend)
                fbs = itertools.cycle(w.forward_batches(torch, "DECODE" if extend == 1 else "EXTEND"))
                make = lambda fbs=fbs, stager=stager: stager(next(fbs), stream=s)  # noqa: E731
            else:
                fbs = itertools.cycle(w.forward_batches(torch, "DECODE" if extend == 1 else "EXTEND"))
                make = lambda fbs=fbs, rtt=w.rtt: sglang_batch(next(fbs), rtt)  # noqa: E731

            def step(canary=canary, make=make):
                b = make()
                canary.before_forward(b, stream=s)
                canary.after_forward(b, stream=s)
            yield name, step, canary
    for shape, how in itertools.product(("decode-bs1", "decode-bs64", "decode-bs256"), ("vllm_batch", "VllmBatchStager")):
        bs, prefix, extend = SHAPES[shape]
        name = f"manager, {how} (persistent buffers sliced), {shape}"
        if not only or only in name:
            w = Work(torch, bs, prefix, extend, layout="paged")
            canary = w.canary()
            block = 16
            blocks = torch.from_numpy(np.ascontiguousarray(w.slots[:, ::block] // block).astype(np.int32)).to(DEV[0])
            max_reqs = 2 * bs
            table = torch.zeros((max_reqs, blocks.shape[1]), dtype=torch.int32, device=DEV[0])
            table[:bs] = blocks
            seq = torch.zeros(max_reqs, dtype=torch.int32, device=DEV[0])
            seq[:bs] = prefix + extend
            qsl = torch.arange(max_reqs + 1, dtype=torch.int32, device=DEV[0]) * extend
            b = w.fields
            t = bs * extend
            slot_mapping = torch.full((2 * t,), -1, dtype=torch.int64, device=DEV[0])
            slot_mapping[:t] = b["out_cache_loc"]
            ids = torch.zeros(2 * t, dtype=torch.int32, device=DEV[0])
            ids[:t] = b["input_ids"]
            pos = torch.zeros(2 * t, dtype=torch.int64, device=DEV[0])
            pos[:t] = b["positions"]
            rtt_out = torch.zeros((max_reqs + 1, blocks.shape[1] * block), dtype=torch.int32, device=DEV[0])

            def make(table=table, seq=seq, qsl=qsl, slot_mapping=slot_mapping, ids=ids, pos=pos, rtt_out=rtt_out,
                     bs=bs, t=t):
                return vllm_batch(block_table=table[:bs], seq_lens=seq[:bs], query_start_loc=qsl[:bs + 1],
                                  slot_mapping=slot_mapping[:t], input_ids=ids[:t], positions=pos[:t],
                                  block_size=block, req_to_token=rtt_out)
            if how == "VllmBatchStager":
                stager = VllmBatchStager(max_reqs=max_reqs, max_tokens=2 * t, max_len=blocks.shape[1] * block,
                                         block_size=block)

                def make(table=table, seq=seq, qsl=qsl, slot_mapping=slot_mapping, ids=ids, pos=pos, bs=bs, t=t,
                         stager=stager):
                    return stager(block_table=table[:bs], seq_lens=seq[:bs], query_start_loc=qsl[:bs + 1],
                                  slot_mapping=slot_mapping[:t], input_ids=ids[:t], positions=pos[:t], stream=s)

            def step(canary=canary, make=make):
                b = make()
                canary.before_forward(b, stream=s)
                canary.after_forward(b, stream=s)
            yield name, step, canary
        name = f"ops build_plan + fused_verify + write, fresh Batch, {shape}"
        if how == "vllm_batch" and (not only or only in name):
            w = Work(torch, bs, prefix, extend)
            ctx = kc.VerifyContext(kc.CanaryBuffer.allocate(w.num_slots, device=0), kc.ViolationSink.allocate(device=0),
                                   kc.LaunchTag.TAIL_K_FULL, [kc.RealKvSource(w.pool, 1, 1024, 1024)],
                                   kc.HashMode.PARTIAL)
            plan = kc.StepPlan.allocate(bs, bs * prefix, device=0)
            batches = itertools.cycle(w.fresh())

            def step(ctx=ctx, plan=plan, batches=batches):
                b = next(batches)
                kc.build_plan(b, plan, stream=s)
                kc.fused_verify(ctx, b, plan, stream=s)
                kc.write(ctx, plan, b.input_ids, b.positions, b.out_cache_loc, stream=s)
            yield name, step, None


def time_row(step, steps: int) -> float:
    """Best of 40 rounds of ``steps // 10`` steps (a noisy shared CPU: the minimum is the cost)."""
    for _ in range(3):
        step()
    best, n = float("inf"), max(1, steps // 10)
    for _ in range(40):
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def torch_ops(step) -> int:
    """aten operators one step runs (each a kernel launch, and its host cost, on CUDA)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))
    step()
    with Count():
        step()
    return Count.n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--profile", default=None, help="cProfile output of the timed steps of --only's first row")
    ap.add_argument("--only", default="")
    ap.add_argument("--device", action="store_true", help="CUDA tensors and the real driver")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    fake = mp = None
    if args.device:
        DEV[0] = "cuda"
    else:
        fake, mp = install()
    try:
        for name, step, canary in rows(torch, args.only):
            if args.profile:
                for _ in range(3):
                    step()
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.steps):
                    step()
                prof.disable()
                prof.dump_stats(args.profile)
                pstats.Stats(prof).sort_stats("tottime").print_stats(18)
                return
            us = time_row(step, args.steps)
            n0 = canary.launch_count if canary is not None else 0
            step()
            n = canary.launch_count - n0 if canary is not None else 3
            clean = "" if canary is None or not args.device else f", {canary.stats()['violations']} violations"
            print(f"{name:70s} {us:8.1f} us/step  ({n} launches, {torch_ops(step)} torch ops{clean})", flush=True)
    finally:
        if fake is not None:
            from tests.support import fake_cuda
            fake_cuda.release(fake)
            mp.undo()


if __name__ == "__main__":
    main()
