"""Device workloads of the benchmarks: an engine batch over a KV pool, clean canary records.

A :class:`Workload` is ``bs`` requests whose first ``prefix`` tokens are cached (and verified
each step) and whose next ``extend`` tokens are written each step: decode is ``extend = 1``, a
prefill ``prefix = 0``. Slot layouts (slot 0 is the padding slot; ``req_to_token`` rows
``1..bs``, row 0 is padding): ``decode`` (default) is what a token allocator hands out when the
whole context was decoded step by step: slot(r, p) = 1 + p * bs + r, each step's tokens of all
requests adjacent, one request's tokens ``bs`` slots apart (a prefill of one request is then
contiguous); ``contiguous`` gives each request one run of slots (a fresh prefill); ``paged`` hands
out pages of 16 consecutive slots in random order over a pool 4x the batch's slots (vLLM's blocks,
SGLang with page_size 16, after some churn); ``vllm`` is ``paged`` with block tables of varying
lengths (each request's cached prefix drawn around ``prefix``, the same total on average);
``random`` permutes all slots (a long-fragmented pool, the worst case for locality).
Each context's buffer is stamped over the prefix once by kvcanary's own write, so every timed
verify is clean (the fast path) and every timed write re-stamps identical records: a timed step
is idempotent and can be repeated. The real-KV pool is ``[num_slots, bytes_per_token]`` uint8
filled with hashed bytes on the device. Byte counts (``*_bytes``) are what a launch must touch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import kvcanary as kc
from kvcanary import abi
from kvcanary.runtime import memory
from kvcanary.runtime.driver import check

MODES = {"identity": abi.HashMode.NONE, "partial": abi.HashMode.PARTIAL, "all": abi.HashMode.ALL}
RECORD, PRED, RTT, I64 = abi.SLOT_BYTES, 24, 4, 8


def settle() -> None:
    """Wait for the device. kvcanary zeroes new state with cuMemsetD8 on the legacy stream, which
    may still be running when the host returns; the timer's non-blocking stream does not wait
    for the legacy stream, so work enqueued there right after an allocation could race it."""
    from cuda.bindings import driver as cu
    check(cu.cuCtxSynchronize(), "cuCtxSynchronize")


@dataclass
class Workload:
    bs: int
    prefix: int
    extend: int
    layout: str
    bytes_per_token: int
    num_slots: int
    slots: np.ndarray            # host [bs, max prefix + extend]: the slot of each request position
    lens: np.ndarray             # host [bs]: each request's cached prefix (``prefix`` unless ``vllm``)
    rpi: memory.DeviceArray
    rtt: memory.DeviceArray
    batch: kc.Batch              # the timed step
    setup: kc.Batch | None       # stamps the prefix
    pool: memory.DeviceArray | None
    sink: kc.ViolationSink
    stream: int
    contexts: dict = field(default_factory=dict)

    @property
    def entries(self) -> int:
        return int(self.lens.sum())

    @property
    def new_tokens(self) -> int:
        return self.bs * self.extend

    @property
    def label(self) -> str:
        shape = f"decode bs{self.bs}x{self.prefix}" if self.extend == 1 else f"prefill {self.bs}x{self.extend}"
        return shape if self.layout == "decode" else f"{shape}, {self.layout} slots"

    def hash_bytes(self, mode: str) -> int:
        return {"identity": 0, "partial": abi.PARTIAL_HASH_BYTES, "all": self.bytes_per_token}[mode]

    def plan(self, materialize: bool = False) -> kc.StepPlan:
        plan = kc.StepPlan.allocate(self.bs, max(1, self.entries), device=0, materialize=materialize)
        settle()
        return plan

    def context(self, mode: str, tag: abi.LaunchTag = abi.LaunchTag.TAIL_K_FULL) -> kc.VerifyContext:
        """A stamped context of ``mode`` (cached per mode and tag)."""
        key = (mode, int(tag))
        if key not in self.contexts:
            sources = [] if mode == "identity" else [
                kc.RealKvSource(self.pool, 1, self.bytes_per_token, self.bytes_per_token)]
            ctx = kc.VerifyContext(kc.CanaryBuffer.allocate(self.num_slots, device=0), self.sink, tag,
                                   sources, MODES[mode])
            settle()
            if self.setup is not None:
                plan = kc.StepPlan.allocate(self.bs, 1, device=0)
                settle()
                kc.build_plan(self.setup, plan, stream=self.stream)
                write(ctx, plan, self.setup, self.stream)
            self.contexts[key] = ctx
        return self.contexts[key]

    def violations(self) -> int:
        return int(self.sink.arrays[1].numpy()[0])

    # ---- bytes a launch must touch (each input read once, each output written once) -----------
    def verify_bytes(self, mode: str) -> int:
        """Per entry: its req_to_token int32 and its 32-byte record, plus the fingerprinted bytes.
        The predecessor's record is another entry's record, so it is not counted twice."""
        return self.entries * (RTT + RECORD + self.hash_bytes(mode))

    def verify_bound_bytes(self, mode: str) -> int:
        """:meth:`verify_bytes` with a whole 32-byte sector per fingerprinted PARTIAL strip (the
        16 bytes a strip needs cost a sector of DRAM traffic): issue 13's PARTIAL bound."""
        strip = 2 * abi.PARTIAL_HASH_BYTES if mode == "partial" else self.hash_bytes(mode)
        return self.entries * (RTT + RECORD + strip)

    def verify_touched(self, mode: str, planned: bool) -> int:
        """What the kernels load: plan (4 int64) or two req_to_token reads, record, predecessor."""
        index = 4 * I64 if planned else 2 * RTT
        preds = int(np.maximum(self.lens - 1, 0).sum())
        return self.entries * (index + RECORD + self.hash_bytes(mode)) + preds * PRED

    def write_bytes(self, mode: str) -> int:
        """Per new token: token, position and slot in, a 32-byte record out, the fingerprinted
        bytes; per request: the seed's chain fields."""
        return self.new_tokens * (3 * I64 + RECORD + self.hash_bytes(mode)) + self.bs * PRED

    def prepare_bytes(self) -> int:
        return self.bs * (3 * I64 + RTT + 3 * I64)

    def step_bytes(self, mode: str, halves: int = 1) -> int:
        """HEAD (no real KV) + TAIL (``mode``) of one step of ``halves`` halves (1: K, 2: K and V
        over the same pool), with one plan build."""
        return self.prepare_bytes() + halves * (self.verify_bytes("identity") + self.write_bytes("identity")
                                                + self.verify_bytes(mode) + self.write_bytes(mode))


def write(ctx: kc.VerifyContext, plan: kc.StepPlan, batch: kc.Batch, stream: int) -> None:
    kc.write(ctx, plan, batch.input_ids, batch.positions, batch.out_cache_loc, stream=stream)


LAYOUTS = ("decode", "contiguous", "paged", "vllm", "random")
PAGE = 16          # slots per page of the paged layouts
POOL_FACTOR = 4    # the paged pools hold this many times the batch's slots


def slot_layout(layout: str, bs: int, length: int, rng) -> tuple[np.ndarray, int]:
    """([bs, length] slots, slots in the pool) (see the module docstring); slot 0 is never used."""
    if layout == "decode":
        return 1 + np.arange(length, dtype=np.int64)[None, :] * bs + np.arange(bs, dtype=np.int64)[:, None], bs * length + 1
    if layout == "contiguous":
        return 1 + np.arange(bs * length, dtype=np.int64).reshape(bs, length), bs * length + 1
    if layout == "random":
        return (rng.permutation(bs * length) + 1).reshape(bs, length), bs * length + 1
    if layout in ("paged", "vllm"):
        per_req = -(-length // PAGE)
        pool_pages = POOL_FACTOR * bs * per_req + 1
        pages = (rng.choice(pool_pages - 1, bs * per_req, replace=False) + 1).reshape(bs, per_req)  # page 0 holds slot 0
        pos = np.arange(length, dtype=np.int64)
        return pages[:, pos // PAGE] * PAGE + pos % PAGE, pool_pages * PAGE
    raise ValueError(f"perf: slot layout must be one of {LAYOUTS}, got {layout!r}")


def make(bs: int, prefix: int, extend: int, *, probes, stream: int, bytes_per_token: int = 1024,
         layout: str = "decode", seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    lens = np.full(bs, prefix, np.int64)
    if layout == "vllm" and prefix:
        lens = rng.integers(max(1, prefix // 8), 2 * prefix - prefix // 8, bs).astype(np.int64)
    length = int(lens.max(initial=0)) + extend
    slots, num_slots = slot_layout(layout, bs, length, rng)
    rtt = np.zeros((bs + 1, length), np.int32)
    rtt[1:] = slots
    tokens = rng.integers(0, 1 << 17, (bs, length)).astype(np.int64)
    dev = memory.to_device
    rpi, rtt_d = dev(np.arange(1, bs + 1, dtype=np.int64)), dev(rtt)

    def batch(lo: np.ndarray, hi: np.ndarray) -> kc.Batch:
        """Positions [lo[r], hi[r]) of every request as the new tokens."""
        cols = [np.arange(a, b) for a, b in zip(lo.tolist(), hi.tolist())]
        take = lambda m: np.concatenate([m[r, c] for r, c in enumerate(cols)]).astype(np.int64)  # noqa: E731
        return kc.Batch(req_pool_indices=rpi, prefix_lens=dev(lo.astype(np.int64)),
                        extend_lens=dev((hi - lo).astype(np.int64)), req_to_token=rtt_d,
                        input_ids=dev(take(tokens)), positions=dev(np.concatenate(cols).astype(np.int64)),
                        out_cache_loc=dev(take(slots)))

    pool = memory.empty((num_slots, bytes_per_token), np.uint8)
    probes.fill(pool.ptr, pool.nbytes, 11 + seed, stream)
    sink = kc.ViolationSink.allocate(device=0)
    settle()
    zero = np.zeros(bs, np.int64)
    return Workload(bs, prefix, extend, layout, bytes_per_token, num_slots, slots, lens, rpi, rtt_d,
                    batch(lens, lens + extend), batch(zero, lens) if prefix else None, pool, sink, stream)


class Workloads:
    """Session cache: building a 1M-entry workload and stamping its contexts is done once."""

    def __init__(self, probes, timer):
        self.probes, self.timer, self.cache = probes, timer, {}

    def get(self, bs: int, prefix: int, extend: int, layout: str = "decode") -> Workload:
        key = (bs, prefix, extend, layout)
        if key not in self.cache:
            self.cache[key] = make(bs, prefix, extend, probes=self.probes, stream=self.timer.handle,
                                   layout=layout)
        return self.cache[key]


DECODE_256 = (256, 4096, 1)
DECODE_64 = (64, 4096, 1)
STEP_SHAPES = {"decode-bs1": (1, 4096, 1), "decode-bs8x1024": (8, 1024, 1), "decode-bs64": (64, 4096, 1),
               "decode-bs256": DECODE_256,
               "prefill-32768": (1, 0, 32768), "prefill-8x4096": (8, 0, 4096)}


def sglang_forward_batches(torch, b: dict, mode: str, n: int) -> list:
    """``n`` SGLang-style ForwardBatches of new tensors (what an engine hands over each step) from
    the torch Batch fields ``b``; ``mode`` is the forward mode's name (DECODE or EXTEND)."""
    import types
    out = []
    for _ in range(n):
        fb = types.SimpleNamespace(forward_mode=types.SimpleNamespace(name=mode),
                                   req_pool_indices=b["req_pool_indices"].clone(),
                                   seq_lens=(b["prefix_lens"] + b["extend_lens"]).clone(),
                                   input_ids=b["input_ids"].to(torch.int32), positions=b["positions"].clone(),
                                   out_cache_loc=b["out_cache_loc"].clone())
        if mode == "EXTEND":
            fb.extend_prefix_lens = b["prefix_lens"].to(torch.int32)
            fb.extend_seq_lens = b["extend_lens"].to(torch.int32)
        out.append(fb)
    return out
