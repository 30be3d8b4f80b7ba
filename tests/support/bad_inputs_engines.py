"""More rows of tests/test_bad_inputs.py (see tests/support/bad_inputs.py): arrays, engine adapters, metrics
and the tensor-parallel aggregator."""

from __future__ import annotations

import socket
from types import SimpleNamespace as SN

import numpy as np

import kvcanary as kc
from kvcanary.adapters import (
    block_table_to_req_to_token,
    select_layers,
    sglang_batch,
    sglang_canary,
    sglang_groups,
    sglang_pool_group,
    sglang_sources,
    vllm_batch,
    vllm_batch_from_metadata,
    vllm_canary,
    vllm_layer_layout,
    vllm_metadata,
    vllm_pool_group,
)
from tests.support.bad_inputs import (
    ERR,
    INTS,
    OK,
    TYPE,
    N,
    canary,
    i64,
    pool,
    row,
    rows,
    rtt,
)

# ---- arrays: as_view and from_pointer ----------------------------------------------------------------------
BUF = np.zeros(256, np.uint8)  # host memory the from_pointer rows describe (kept alive by the module)
PTR = BUF.ctypes.data


class CAI:
    def __init__(self, cai):
        self.__cuda_array_interface__ = cai


def cai(**over):
    d = {"data": (0x10000, False), "shape": (4,), "typestr": "<i4", "version": 3}
    d.update(over)
    return CAI(d)


class DL:
    def __init__(self, dlpack, device=lambda: (1, 0)):
        self._dlpack, self._device = dlpack, device

    def __dlpack__(self, **kw):
        return self._dlpack(**kw)

    def __dlpack_device__(self):
        return self._device()


def _raise(exc):
    def fn(*a, **k):
        raise exc
    return fn


def torch_case(build):
    def action():
        import torch
        return kc.as_view(build(torch), name="t")
    return action


rows("arrays.as_view", lambda v: kc.as_view(v, name="x"),
     [("None", None, TYPE), ("list", [1, 2], TYPE), ("int", 3, TYPE), ("str", "abc", TYPE),
      ("object-array", np.array([object()]), TYPE), ("numpy", np.zeros(4), OK), ("0-d", np.float32(1), TYPE),
      ("cai-empty", CAI({}), TYPE), ("cai-None", CAI(None), TYPE), ("cai-data-int", cai(data=5), TYPE),
      ("cai-shape-int", cai(shape=5), TYPE), ("cai-typestr", cai(typestr="zz"), TYPE),
      ("cai-strides", cai(strides=(4, 4)), ERR), ("cai-mask", cai(mask=object()), ERR), ("cai-stream-0", cai(stream=0), ERR),
      ("cai-data-negative", cai(data=(-16, False)), ERR), ("cai-shape-negative", cai(shape=(-1,)), ERR),
      ("cai-shape-float", cai(shape=(1.5,)), TYPE), ("cai-ok", cai(), OK),
      ("dlpack-not-capsule", DL(lambda **k: 5), TYPE), ("dlpack-raises-KeyError", DL(_raise(KeyError("x"))), TYPE),
      ("dlpack-device-raises", DL(lambda **k: BUF.__dlpack__(), _raise(AttributeError("x"))), TYPE),
      ("dlpack-ok", DL(lambda **k: BUF.__dlpack__(**k)), OK),
      ("torch-like-xla", SN(data_ptr=lambda: 16, stride=lambda: (1,), element_size=lambda: 4, device=SN(type="xla"),
                            shape=(4,), dtype="torch.int32"), TYPE)])
row("arrays.as_view.capsule-used-twice", TYPE, lambda: [kc.as_view(c, name="x") for c in [BUF.__dlpack__()] * 2])
row("arrays.as_view.torch-sparse", TYPE, torch_case(lambda t: t.zeros(4, 4).to_sparse()))
row("arrays.as_view.torch-conj", ERR, torch_case(lambda t: t.zeros(4, dtype=t.complex64).conj()))
row("arrays.as_view.torch-meta", TYPE, torch_case(lambda t: t.zeros(4, device="meta")))
row("arrays.as_view.torch-cpu", OK, torch_case(lambda t: t.zeros(4, dtype=t.int64)))
rows("arrays.from_pointer.ptr", lambda v: kc.from_pointer(v, (4,), np.int32, device=None, owner=BUF),
     [("-16", -16, ERR), ("'x'", "x", TYPE), ("2**70", 2**70, ERR), ("1.5", 1.5, TYPE), ("NULL", 0, ERR),
      ("True", True, TYPE), ("ok", PTR, OK)])
rows("arrays.from_pointer.shape", lambda v: kc.from_pointer(PTR, v, np.int32, device=None, owner=BUF),
     [("5", 5, TYPE), ("(-1,)", (-1,), ERR), ("(1.5,)", (1.5,), TYPE), ("2**62", (2**62,), ERR), ("None", None, TYPE),
      ("(0,)", (0,), OK), ("(2, 2)", (2, 2), OK)])
rows("arrays.from_pointer.dtype", lambda v: kc.from_pointer(PTR, (4,), v, device=None, owner=BUF),
     [("'nonsense'", "nonsense", TYPE), ("None", None, TYPE), ("object", object, TYPE), ("'bfloat16'", "bfloat16", OK),
      ("'<i8'", "<i8", OK)])
rows("arrays.from_pointer.device", lambda v: kc.from_pointer(0x10000, (4,), np.int32, device=v),
     [("'cuda'", "cuda", TYPE), ("-2", -2, ERR), ("True", True, TYPE), ("1.5", 1.5, TYPE), ("0", 0, OK), ("-1", -1, OK)])
rows("arrays.from_pointer.strides", lambda v: kc.from_pointer(PTR, (4,), np.int32, device=None, strides=v, owner=BUF),
     [("(4, 4)", (4, 4), ERR), ("('a',)", ("a",), TYPE), ("5", 5, TYPE), ("(8,)", (8,), OK)])

# ---- adapters: layer selection -----------------------------------------------------------------------------
rows("adapters.select_layers", lambda v: select_layers(4, v),
     [("'some'", "some", ERR), ("1.5", 1.5, TYPE), ("[0, 0]", [0, 0], ERR), ("[5]", [5], ERR), ("-1", -1, ERR),
      ("[]", [], ERR), ("[True]", [True], TYPE), ("[[0]]", [[0]], TYPE), ("object", object(), TYPE),
      ("[1.0]", [1.0], TYPE), ("None", None, OK), ("'all'", "all", OK), ("'ALL'", "ALL", OK), ("[3, 1]", [3, 1], OK),
      ("np.int64", np.int64(2), OK), ("range", range(2), OK), ("True", True, TYPE)])
rows("adapters.select_layers.num_layers", lambda v: select_layers(v), [("0", 0, ERR), ("-3", -3, ERR)])


# ---- adapters: SGLang-style pools and batches ------------------------------------------------------------------
def mha(layers=2, slots=N):
    return SN(k_buffer=[pool(slots) for _ in range(layers)], v_buffer=[pool(slots) for _ in range(layers)])


def mla():
    return SN(kv_buffer=[np.zeros((N, 1, 64), np.uint8)])


def swa_pool(**over):
    d = dict(full_kv_pool=mha(), swa_kv_pool=mha(), full_to_swa_index_mapping=np.arange(N, dtype=np.int64))
    d.update(over)
    return SN(**d)


def fb(mode="DECODE", **over):
    d = dict(forward_mode=SN(name=mode), req_pool_indices=i64(1, 2), seq_lens=i64(4, 3), input_ids=i64(1, 2),
             positions=i64(3, 2), out_cache_loc=i64(8, 11), extend_seq_lens=None, extend_prefix_lens=None, spec_info=None)
    d.update(over)
    return SN(**d)


rows("adapters.sglang_sources.pool", lambda v: sglang_sources(v),
     [("empty", SN(), ERR), ("k-without-v", SN(k_buffer=[pool()]), ERR), ("k-int", SN(k_buffer=5, v_buffer=5), TYPE),
      ("k-str", SN(k_buffer="ab", v_buffer="ab"), TYPE), ("None-buffers", SN(k_buffer=None, kv_buffer=None), ERR),
      ("mla-36-bytes", SN(kv_buffer=[np.zeros((N, 1, 36), np.uint8)]), ERR), ("mha", mha(), OK), ("mla", mla(), OK),
      ("None", None, ERR)])
rows("adapters.sglang_sources.layers", lambda v: sglang_sources(mha(), layers=v),
     [("[3]", [3], ERR), ("'some'", "some", ERR), ("1.5", 1.5, TYPE), ("'all'", "all", OK)])
rows("adapters.sglang_sources.scales", lambda v: sglang_sources(mha(), scales=v),
     [("'maybe'", "maybe", ERR), ("None", None, TYPE), ("True-none", True, ERR), ("1", 1, TYPE), ("False", False, OK),
      ("'AUTO'", "AUTO", OK)])
rows("adapters.sglang_sources.read_bytes", lambda v: sglang_sources(mha(), read_bytes=v),
     [("8", 8, ERR), ("1.5", 1.5, TYPE), ("32", 32, OK)])
row("adapters.sglang_pool_group.layer-sizes", ERR,
    lambda: sglang_pool_group(SN(k_buffer=[pool(), pool(32)], v_buffer=[pool(), pool(32)]), layers="all"))
rows("adapters.sglang_pool_group.fingerprint", lambda v: sglang_pool_group(mha(), fingerprint=v),
     [("'no'", "no", TYPE), ("0", 0, TYPE), ("False", False, OK)])
rows("adapters.sglang_groups.window", lambda v: sglang_groups(swa_pool(), window=v),
     [("None", None, ERR), ("0", 0, ERR), ("'x'", "x", TYPE), ("1.5", 1.5, TYPE), ("True", True, TYPE), ("-4", -4, ERR),
      ("4", 4, OK)])
row("adapters.sglang_groups.no-mapping", ERR, lambda: sglang_groups(swa_pool(full_to_swa_index_mapping=None), window=4))
row("adapters.sglang_groups.mapping-list", TYPE, lambda: sglang_groups(swa_pool(full_to_swa_index_mapping=[0] * N),
                                                                       window=4))
rows("adapters.sglang_canary", lambda kw: sglang_canary(mha(), **{"max_batch": 2, **kw}),
     [("device='cpu'", {"device": "cpu"}, TYPE), ("max_batch=0", {"max_batch": 0}, ERR), ("foo=1", {"foo": 1}, TYPE),
      ("hash_mode='PARTIAL'", {"hash_mode": "PARTIAL"}, OK), ("defaults", {}, OK)])
rows("adapters.sglang_batch.forward_batch", lambda v: sglang_batch(v, rtt()),
     [("None", None, ERR), ("decode", fb(), OK), ("PREBUILT", fb("PREBUILT"), ERR), ("seq-list", fb(seq_lens=[4, 3]), TYPE),
      ("EXTEND-no-lens", fb("EXTEND"), ERR), ("no-mode", SN(**{k: v for k, v in vars(fb()).items() if k != "forward_mode"}),
                                               ERR),
      ("verify-drafts-str", fb("TARGET_VERIFY", spec_info=SN(draft_token_num="x")), TYPE),
      ("verify-tree", fb("TARGET_VERIFY", spec_info=SN(draft_token_num=1, topk=2)), ERR),
      ("verify-tokens", fb("TARGET_VERIFY", spec_info=SN(draft_token_num=2, topk=1)), ERR),
      ("verify-ok", fb("TARGET_VERIFY", spec_info=SN(draft_token_num=1, topk=1)), OK)])
rows("adapters.sglang_batch.req_to_token", lambda v: sglang_batch(fb(), v),
     [("None", None, TYPE), ("list", [[0]], TYPE), ("pool-object", SN(req_to_token=rtt()), OK)])
row("adapters.sglang_batch.full_to_swa='x'", TYPE, lambda: sglang_batch(fb(), rtt(), full_to_swa="x"))

# ---- adapters: vLLM-style caches, block tables and metadata --------------------------------------------------
def split():
    return np.zeros((2, 4, 16, 2, 8), np.float16)  # [2, blocks, block_size, heads, dim]


rows("adapters.vllm_layer_layout.cache", lambda v: vllm_layer_layout(v),
     [("None", None, TYPE), ("split", split(), OK), ("2d", np.zeros((4, 16), np.float16), ERR), ("list", [[0]], TYPE)])
rows("adapters.vllm_layer_layout.layout", lambda v: vllm_layer_layout(split(), layout=v),
     [("5", 5, TYPE), ("'NCHW'", "NCHW", ERR), ("'split'", "split", OK), ("'SPLIT'", "SPLIT", OK)])
rows("adapters.vllm_layer_layout.kv_dim", lambda v: vllm_layer_layout(split(), kv_dim=v),
     [("3", 3, ERR), ("'x'", "x", TYPE), ("1.5", 1.5, TYPE), ("0", 0, OK)])
rows("adapters.vllm_layer_layout.head_size", lambda v: vllm_layer_layout(np.zeros((4, 2, 16, 16), np.float16),
                                                                          layout="LBHNC", head_size=v),
     [("'x'", "x", TYPE), ("1.5", 1.5, TYPE), ("0", 0, ERR), ("-1", -1, ERR), ("8", 8, OK)])
rows("adapters.vllm_pool_group", lambda v: vllm_pool_group(v),
     [("[]", [], ERR), ("None", None, TYPE), ("dict", {"l0": split()}, OK), ("tensor", split(), OK)])
rows("adapters.vllm_pool_group.fingerprint", lambda v: vllm_pool_group([split()], fingerprint=v),
     [("'yes'", "yes", TYPE), ("True", True, OK)])
row("adapters.vllm_pool_group.layers=[2]", ERR, lambda: vllm_pool_group([split()], layers=[2]))
row("adapters.vllm_pool_group.mixed-halves", ERR,
    lambda: vllm_pool_group([split(), np.zeros((4, 16, 64), np.float16)], layers="all"))
rows("adapters.vllm_canary", lambda kw: vllm_canary([split()], **{"max_batch": 2, **kw}),
     [("device='cpu'", {"device": "cpu"}, TYPE), ("mode='warn'", {"mode": "warn"}, ERR), ("defaults", {}, OK)])
row("adapters.vllm_canary([])", ERR, lambda: vllm_canary([]))
BT, SEQ = np.array([[1, 2], [3, 0]], np.int32), i64(20, 5)
rows("adapters.block_table_to_req_to_token.block_size", lambda v: block_table_to_req_to_token(BT, SEQ, v),
     INTS + [("16", 16, OK)])
for label, args, kw, expected in [
    ("block_table-1d", (BT[0], SEQ, 16), {}, ERR), ("block_table-None", (None, SEQ, 16), {}, TYPE),
    ("block_table-float", (BT * 1.0, SEQ, 16), {}, TYPE), ("seq_lens-None", (BT, None, 16), {}, TYPE),
    ("seq_lens-short", (BT, SEQ[:1], 16), {}, ERR), ("seq_lens-float", (BT, SEQ * 1.0, 16), {}, TYPE),
    ("max_len=0", (BT, SEQ, 16), {"max_len": 0}, ERR), ("max_len=10**6", (BT, SEQ, 16), {"max_len": 10**6}, ERR),
    ("max_len=1.5", (BT, SEQ, 16), {"max_len": 1.5}, TYPE), ("max_len=20", (BT, SEQ, 16), {"max_len": 20}, OK),
    ("out-shape", (BT, SEQ, 16), {"out": np.zeros((1, 32), np.int32)}, ERR),
    ("out-list", (BT, SEQ, 16), {"out": [[0]]}, TYPE), ("out-int64", (BT, SEQ, 16), {"out": np.zeros((3, 32), np.int64)}, TYPE),
    ("out-ok", (BT, SEQ, 16), {"out": np.zeros((4, 32), np.int32)}, OK),
]:
    row(f"adapters.block_table_to_req_to_token.{label}", expected, lambda a=args, k=kw: block_table_to_req_to_token(*a, **k))


def vb(**over):
    d = dict(block_table=BT, seq_lens=SEQ, query_start_loc=i64(0, 20, 25),
             slot_mapping=np.array(list(range(16, 36)) + list(range(48, 53)), np.int64), input_ids=np.arange(25),
             positions=np.array(list(range(20)) + list(range(5))), block_size=16)
    d.update(over)
    return vllm_batch(**d)


rows("adapters.vllm_batch", lambda kw: vb(**kw),
     [("block_size=0", {"block_size": 0}, ERR), ("query_start_loc=None", {"query_start_loc": None}, TYPE),
      ("num_reqs=-1", {"num_reqs": -1}, ERR), ("num_reqs=1.5", {"num_reqs": 1.5}, TYPE), ("num_reqs=5", {"num_reqs": 5}, ERR),
      ("num_tokens=-1", {"num_tokens": -1}, ERR), ("num_tokens=100", {"num_tokens": 100}, ERR),
      ("input_ids=None", {"input_ids": None}, TYPE), ("slot_mapping=list", {"slot_mapping": [16] * 25}, TYPE),
      ("defaults", {}, OK), ("num_reqs=1", {"num_reqs": 1, "num_tokens": 20}, OK)])
MD = SN(block_table=BT, seq_lens=SEQ, query_start_loc=i64(0, 20, 25), slot_mapping=np.arange(25, dtype=np.int64),
        num_actual_tokens=25)
rows("adapters.vllm_metadata", lambda args: vllm_metadata(*args),
     [("list", ([MD, MD],), ERR), ("{}", ({},), ERR), ("missing-layer", ({"a": MD}, "b"), ERR),
      ("layer_name=5", ({"a": MD}, 5), TYPE), ("two-groups", ({"a": MD, "b": SN()},), ERR), ("object", (MD,), OK),
      ("dict", ({"a": MD, "b": MD},), OK)])
rows("adapters.vllm_batch_from_metadata", lambda md: vllm_batch_from_metadata(md, input_ids=np.arange(25),
                                                                               positions=np.arange(25), block_size=16),
     [("empty", SN(), ERR), ("None", None, ERR), ("ok", MD, OK)])


# ---- adapters: transformers --------------------------------------------------------------------------------------
def tc(**kw):
    from kvcanary.adapters import TransformersCanary
    return TransformersCanary(kw.pop("model", SN(init_continuous_batching=lambda *a, **k: None)), **kw)


def transformers_version(v):
    from kvcanary.adapters.transformers_layout import check_transformers_version
    return check_transformers_version(v)


rows("adapters.check_transformers_version", transformers_version,
     [("'4.57.0'", "4.57.0", ERR), ("'junk'", "junk", ERR), ("None", None, ERR), ("'5.26.0.dev0'", "5.26.0.dev0", ERR),
      ("'5.20.1'", "5.20.1", OK)])
rows("adapters.TransformersCanary", lambda kw: tc(**kw),
     [("hash_mode='x'", {"hash_mode": "x"}, ERR), ("hash_mode=1", {"hash_mode": 1}, TYPE), ("mode='warn'", {"mode": "warn"}, ERR),
      ("check_inputs=1", {"check_inputs": 1}, TYPE), ("before_step=5", {"before_step": 5}, TYPE),
      ("after_step='f'", {"after_step": "f"}, TYPE), ("layers='some'", {"layers": "some"}, ERR),
      ("layers=1.5", {"layers": 1.5}, TYPE), ("model=None", {"model": None}, TYPE), ("foo=1", {"foo": 1}, TYPE),
      ("max_batch=8", {"max_batch": 8}, TYPE), ("ring_capacity=8", {"ring_capacity": 8}, OK),
      ("hash_mode='ALL'", {"hash_mode": "ALL"}, OK), ("defaults", {}, OK), ("layers=[0, 1]", {"layers": [0, 1]}, OK)])


# ---- metrics --------------------------------------------------------------------------------------------------------
def metrics(**kw):
    import prometheus_client

    from kvcanary.reporting.metrics import PrometheusMetrics
    kw.setdefault("registry", prometheus_client.CollectorRegistry())
    return PrometheusMetrics(kw.pop("canary") if "canary" in kw else canary(), **kw)


rows("metrics.PrometheusMetrics", lambda kw: metrics(**kw),
     [("canary=None", {"canary": None}, TYPE), ("labels-tag", {"labels": {"tag": "x"}}, ERR),
      ("labels-int", {"labels": {"rank": 0}}, TYPE), ("labels-list", {"labels": ["rank"]}, TYPE),
      ("labels-1bad", {"labels": {"1bad": "x"}}, ERR), ("labels-dunder", {"labels": {"__x": "y"}}, ERR),
      ("labels-dash", {"labels": {"tp-rank": "0"}}, ERR), ("registry='x'", {"registry": "x"}, TYPE),
      ("labels-ok", {"labels": {"tp_rank": "0"}}, OK), ("defaults", {}, OK)])


def serve(port=0, addr="127.0.0.1"):
    from kvcanary.reporting.metrics import start_http_server
    server, _ = start_http_server(port, addr=addr)
    server.shutdown()
    server.server_close()


def serve_busy():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        serve(s.getsockname()[1])


rows("metrics.start_http_server.port", lambda v: serve(v),
     [("'9400'", "9400", TYPE), ("70000", 70000, ERR), ("-1", -1, ERR), ("True", True, TYPE), ("0", 0, OK)])
rows("metrics.start_http_server.addr", lambda v: serve(addr=v),
     [("5", 5, TYPE), ("'256.1.1.1'", "256.1.1.1", ERR), ("None", None, TYPE)])
row("metrics.start_http_server.busy-port", ERR, serve_busy)


# ---- distributed: TensorParallelAggregator's arguments (checked before any process group is needed) --------------
def tpa(**kw):
    from kvcanary.distributed import TensorParallelAggregator
    return TensorParallelAggregator(kw.pop("canary") if "canary" in kw else canary(), **kw)


rows("distributed.TensorParallelAggregator", lambda kw: tpa(**kw),
     [("canary=None", {"canary": None}, TYPE), ("canary-raise", {"canary": canary(mode="raise")}, ERR),
      ("mode='warn'", {"mode": "warn"}, ERR), ("mode=None", {"mode": None}, TYPE), ("lag=2", {"lag": 2}, ERR),
      ("lag='1'", {"lag": "1"}, TYPE), ("lag=True", {"lag": True}, TYPE), ("rows_per_step=0", {"rows_per_step": 0}, ERR),
      ("rows_per_step='4'", {"rows_per_step": "4"}, TYPE), ("stale_steps=1.5", {"stale_steps": 1.5}, TYPE),
      ("max_backlog=None", {"max_backlog": None}, TYPE), ("export=5", {"export": 5}, TYPE),
      ("rank='0'", {"rank": "0"}, TYPE), ("world_size=-1", {"world_size": -1}, ERR), ("rank=-1", {"rank": -1}, ERR),
      ("valid-but-no-process-group", {}, ERR), ("mode='RAISE'-no-process-group", {"mode": "RAISE"}, ERR)])
