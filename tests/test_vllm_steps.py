"""The vLLM connector's worker bookkeeping (kvcanary/adapters/vllm_steps.py), without vLLM: across a
churn of requests (new, chunked, decoding with new blocks, finished, preempted and resumed with new
blocks, rows reused), every step's Batch equals what the block lists say, computed here
independently (slot = block_ids[p // block_size] * block_size + p % block_size); on CUDA the staged
Batch (pinned copy, one scatter of new cells) equals the host one element for element."""

from __future__ import annotations

import numpy as np
import pytest

from kvcanary.adapters.vllm_steps import StepNotes, WorkerSteps
from tests.conftest import gpu_unavailable_reason

BS = 4  # block size


def churn(seed: int, steps: int = 60):
    """(StepNotes, {request id: (blocks, computed before, scheduled, tokens)}) per step of a random churn."""
    rng = np.random.default_rng(seed)
    live: dict = {}  # rid -> (blocks, computed)
    free = list(range(1, 400))
    rng.shuffle(free)
    out, next_id = [], 0
    for _ in range(steps):
        dropped, fresh_ids = [], []
        for rid in list(live):
            if rng.random() < 0.1 or live[rid][1] > 52:  # finished (or at max_len), or preempted
                dropped.append(rid)
                free += live.pop(rid)[0]
        if rng.random() < 0.3 and dropped:
            fresh_ids.append(dropped[0])  # resumed after preemption in this very step
        while len(live) + len(fresh_ids) < 6 and rng.random() < 0.7:
            fresh_ids.append(f"q{next_id}")
            next_id += 1
        ids, blocks, computed, scheduled, tokens, truth = [], [], [], [], [], {}
        for i, rid in enumerate(fresh_ids):
            nc, n = int(rng.integers(0, 3)) * BS, int(rng.integers(1, 9))
            blk = [free.pop() for _ in range(-(-(nc + n) // BS))]
            live[rid] = (blk, nc + n)
            ids.append(rid), blocks.append((i, list(blk))), computed.append(nc), scheduled.append(n)
            toks = [int(x) for x in rng.integers(0, 1000, n)]
            tokens += toks
            truth[rid] = (list(blk), nc, n, toks)
        for rid in [r for r in live if r not in fresh_ids]:
            blk, nc = live[rid]
            n = 1 if rng.random() < 0.7 else int(rng.integers(2, 6))
            need = -(-(nc + n) // BS) - len(blk)
            new = [free.pop() for _ in range(need)]
            blk = blk + new
            live[rid] = (blk, nc + n)
            if new:
                blocks.append((len(ids), new))
            ids.append(rid), computed.append(nc), scheduled.append(n)
            tokens += [-1] * n
            truth[rid] = (list(blk), nc, n, [-1] * n)
        out.append((StepNotes(dropped, ids, blocks, len(fresh_ids), computed, scheduled, tokens), truth))
    return out


def check(batch, notes, truth, steps, host) -> None:
    rows, prefix, extend = (host(getattr(batch, k)) for k in ("req_pool_indices", "prefix_lens", "extend_lens"))
    rtt = host(batch.req_to_token)
    ids, pos, loc = host(batch.input_ids), host(batch.positions), host(batch.out_cache_loc)
    assert len(set(rows.tolist())) == len(rows) and rows.min() >= 1
    at = 0
    for i, rid in enumerate(notes.ids):
        blk, nc, n, toks = truth[rid]
        assert (prefix[i], extend[i]) == (nc, n)
        want = [blk[p // BS] * BS + p % BS for p in range(nc + n)]
        assert rtt[rows[i], :nc + n].tolist() == want, rid
        assert pos[at:at + n].tolist() == list(range(nc, nc + n)) and loc[at:at + n].tolist() == want[nc:]
        assert ids[at:at + n].tolist() == toks
        at += n
    assert at == len(ids)


def run(device, host):
    for seed in range(4):
        steps = WorkerSteps(block_size=BS, max_len=64, rows=2, device=device)  # 2 rows: it must grow
        for notes, truth in churn(seed):
            batch = steps.batch(notes)
            if not notes.ids:
                assert batch is None
                continue
            check(batch, notes, truth, steps, host)


def test_worker_steps_follow_the_block_lists_through_churn():
    run(None, np.asarray)


def test_decode_steps_reuse_one_batch_object():
    steps = WorkerSteps(block_size=BS, max_len=64, rows=4, device=None)
    steps.batch(StepNotes([], ["a", "b"], [(0, [3]), (1, [5])], 2, [0, 0], [2, 3], [1, 2, 3, 4, 5]))
    first = steps.batch(StepNotes([], ["a", "b"], [], 0, [2, 3], None, None))
    again = steps.batch(StepNotes([], ["a", "b"], [(0, [9]), (1, [8])], 0, [3, 4], None, None))
    assert first is again and again.positions.tolist() == [3, 4] and again.out_cache_loc.tolist() == [15, 32]
    assert again.input_ids.tolist() == [-1, -1] and again.req_to_token[1, :5].tolist() == [12, 13, 14, 15, 36]


@pytest.mark.gpu
@pytest.mark.skipif(gpu_unavailable_reason() is not None, reason="needs a CUDA GPU")
def test_cuda_staging_equals_the_block_lists():
    torch = pytest.importorskip("torch")

    def host(t):
        torch.cuda.synchronize()
        return t.cpu().numpy()
    run(0, host)
