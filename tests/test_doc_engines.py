"""docs/engines/sglang.md's code blocks, run as written against stand-ins with SGLang's attribute
names, dtypes and shapes (the ones tests/test_adapters_upstream.py copies from SGLang's sources): the
model runner and its MHA pool, ForwardBatches, the ScheduleBatch's Req objects, FINISH_ABORT. A
prefill of two requests, a flipped byte in one's cached K, and the decode that reads it: the guide's
scheduler hook aborts that request alone and names its slot for eviction."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.support.docblocks import runnable
from tests.test_adapters import ForwardMode

torch = pytest.importorskip("torch")

SLOTS, LAYERS, HEADS, DIM = 64, 2, 2, 16


class Model:
    """The model's forward as far as the KV pool sees it: every layer writes the new tokens' K and V."""

    def __init__(self, pool):
        self.pool = pool

    def forward(self, input_ids, positions, forward_batch):
        loc = forward_batch.out_cache_loc
        for buf in (*self.pool.k_buffer, *self.pool.v_buffer):
            buf[loc] = torch.randn((len(loc), HEADS, DIM), device=buf.device).to(torch.bfloat16)
        return input_ids


class FinishAbort:
    """SGLang's FINISH_ABORT(message, status_code, err_type)."""

    def __init__(self, message, status_code, err_type):
        self.message, self.status_code, self.err_type = message, status_code, err_type


def engine(device: str, kinds: tuple):
    """The stand-in runner on ``device``, and the guide's blocks of ``kinds`` run over it in order."""
    zeros = lambda: [torch.zeros((SLOTS, HEADS, DIM), dtype=torch.bfloat16, device=device) for _ in range(LAYERS)]  # noqa: E731
    pool = SimpleNamespace(k_buffer=zeros(), v_buffer=zeros(), page_size=1, layer_num=LAYERS)
    rtt = torch.zeros((4, 32), dtype=torch.int32, device=device)
    runner = SimpleNamespace(token_to_kv_pool=pool, sliding_window_size=None, model=Model(pool),
                             req_to_token_pool=SimpleNamespace(req_to_token=rtt))
    evicted = []
    scope = {"model_runner": runner, "FINISH_ABORT": FinishAbort, "evict_radix_nodes_holding": evicted.extend}
    blocks = runnable("sglang") + (runnable("sglang-gpu") if "sglang-gpu" in kinds else [])
    for b in blocks:
        exec(compile(b.code, b.where, "exec"), scope)
    return scope, runner, evicted


def forward_batch(mode, rows, seq_lens, ids, loc, *, extend=None, prefix=None, device="cpu"):
    i64 = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    pos = [p for s, e in zip(seq_lens, extend or [1] * len(rows)) for p in range(s - e, s)]
    return SimpleNamespace(forward_mode=mode, batch_size=len(rows), req_pool_indices=i64(rows), seq_lens=i64(seq_lens),
                           input_ids=i64(ids), positions=i64(pos), out_cache_loc=i64(loc),
                           extend_seq_lens=None if extend is None else torch.tensor(extend, dtype=torch.int32, device=device),
                           extend_prefix_lens=None if prefix is None else torch.tensor(prefix, dtype=torch.int32, device=device),
                           spec_info=None, seq_lens_cpu=i64(seq_lens))


def serve(flip: bool, device: str = "cpu", kinds: tuple = ("sglang",)):
    """Prefill requests a (row 1, slots 1-3) and b (row 2, slots 4-6), then one decode step each."""
    scope, runner, evicted = engine(device, kinds)
    rtt = runner.req_to_token_pool.req_to_token
    rtt[1, :3], rtt[2, :3] = torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6])
    reqs = [SimpleNamespace(rid="a"), SimpleNamespace(rid="b")]
    batch = SimpleNamespace(reqs=reqs)
    scope["run_batch"](batch, forward_batch(ForwardMode.EXTEND, [1, 2], [3, 3], [11, 12, 13, 21, 22, 23],
                                            [1, 2, 3, 4, 5, 6], extend=[3, 3], prefix=[0, 0], device=device))
    if flip:  # a stray write: one bit of b's cached token at slot 5, layer 0 K, in the fingerprinted bytes
        runner.token_to_kv_pool.k_buffer[0][5].view(-1).view(torch.uint8)[2] ^= 0x10
    rtt[1, 3], rtt[2, 3] = 7, 8
    scope["run_batch"](batch, forward_batch(ForwardMode.DECODE, [1, 2], [4, 4], [14, 24], [7, 8], device=device))
    if device != "cpu":  # the verdicts arrive with the pump's snapshot, a step or two later: one more (idle) step
        scope["canary"].flush()
        scope["run_batch"](SimpleNamespace(reqs=[]), forward_batch(ForwardMode.IDLE, [], [], [], [], device=device))
    scope["canary"].flush()
    late = scope["hook"].take()
    assert late == [], f"failures the guide's hook never saw: {late}"
    return scope["canary"], reqs, evicted


def test_a_clean_run_aborts_nothing():
    canary, reqs, evicted = serve(flip=False)
    assert canary.stats()["violations"] == 0 and canary.stats()["verified_slots"] > 0
    assert not any(hasattr(r, "to_finish") for r in reqs) and evicted == []


def test_the_guides_hook_aborts_the_request_that_read_the_flipped_byte():
    canary, (a, b), evicted = serve(flip=True)
    assert not hasattr(a, "to_finish") and not hasattr(a, "skip_radix_cache_insert")
    assert isinstance(b.to_finish, FinishAbort) and b.skip_radix_cache_insert is True
    assert b.to_finish.status_code == 500 and b.to_finish.err_type == "InternalServerError"
    assert b.to_finish.message.startswith("kv-canary:")
    assert evicted == [5]
