"""Bundle what the vLLM connector's tests and benchmark need on a GPU machine that cannot install vLLM
(no network there, and vLLM's wheel is larger than what travels with a call):

- ``vllm-py.tgz``: the vLLM modules the connector tests import (read from ``sys.modules`` after running
  them here), ``vllm/model_executor/models/llama.py`` and vLLM's cached model info for it (vLLM inspects
  a model's architecture in a subprocess unless ``VLLM_CACHE_ROOT/modelinfos`` holds a record whose hash
  matches that file). No dist-info: with it vLLM detects the CUDA platform and wants its compiled ops.
- ``whl/``: cp312 manylinux wheels of the packages those modules import that the GPU image lacks.

Usage, from the repository root (with the test environment of the README active)::

    python -m perf.vllm_bundle .gpu-vllm        # then carry .gpu-vllm; on the GPU machine:
    pip install --no-index --no-deps --target /tmp/site .gpu-vllm/whl/*.whl; tar xzf .gpu-vllm/vllm-py.tgz -C /tmp/site
    PYTHONPATH=$PWD:/tmp/site VLLM_CACHE_ROOT=/tmp/site python3 -m pytest tests/test_vllm_connector.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

# Imported by vLLM's scheduler, connector factory and worker glue, missing from the GPU image.
WHEELS = ("cachetools==8.0.2", "cbor2==6.3.0", "msgspec==0.23.0", "pybase64==1.5.1", "pydantic==2.14.4",
          "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5", "llguidance==1.7.6",
          "xgrammar==0.2.8", "apache-tvm-ffi==0.1.11", "pyzmq==27.3.0")
PLATFORMS = ("manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64",
             "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux1_x86_64")


def main(out: Path) -> None:
    import pytest
    import vllm
    out.mkdir(parents=True, exist_ok=True)
    if pytest.main(["-q", "-p", "no:warnings", "tests/test_vllm_connector.py"]) != 0:
        raise SystemExit("the connector tests must pass here first")
    site = Path(vllm.__file__).resolve().parent.parent
    files = {Path(m.__file__).resolve().relative_to(site) for m in list(sys.modules.values())
             if getattr(m, "__file__", None) and Path(m.__file__).resolve().is_relative_to(site / "vllm")}
    files.add(Path("vllm/model_executor/models/llama.py"))
    cache = Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm")) / "modelinfos"
    with tarfile.open(out / "vllm-py.tgz", "w:gz") as tar:
        for f in sorted(files):
            tar.add(site / f, arcname=str(f))
        tar.add(cache, arcname="modelinfos")
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(out / "whl"),
                    *WHEELS], check=True)
    print(f"{len(files)} vLLM modules in {out / 'vllm-py.tgz'}; wheels in {out / 'whl'}")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else ".gpu-vllm"))
