"""The guides' GPU code blocks, run as written on a GPU: ``<!-- runnable: gpu -->`` blocks alone (with
the output their ``prints`` block shows, if any), and docs/engines/sglang.md's stager block after the
guide's other SGLang blocks, over the stand-in engine of tests/test_doc_engines.py with CUDA tensors."""

from __future__ import annotations

import contextlib
import io

import pytest

from tests.support.docblocks import expected_output, runnable

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("block", runnable("gpu"), ids=lambda b: b.where)
def test_gpu_block_runs_as_written(block):
    if "cupy" in block.code:
        pytest.importorskip("cupy")
    if "torch" in block.code:
        pytest.importorskip("torch")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(block.code, block.where, "exec"), {"__name__": "__doc_block__"})
    want = expected_output(block)
    if want is not None:
        assert out.getvalue().strip() == want.strip()


def test_sglang_stager_block_on_the_gpu():
    pytest.importorskip("torch")
    from tests.test_doc_engines import FinishAbort, serve
    assert len(runnable("sglang-gpu")) == 1
    canary, (a, b), evicted = serve(flip=False, device="cuda", kinds=("sglang", "sglang-gpu"))
    assert canary.stats()["violations"] == 0 and not hasattr(b, "to_finish")
    canary, (a, b), evicted = serve(flip=True, device="cuda", kinds=("sglang", "sglang-gpu"))
    assert not hasattr(a, "to_finish") and isinstance(b.to_finish, FinishAbort) and evicted == [5]
