"""kvcanary: a canary for the paged KV cache of LLM serving engines.

Importing compiles every kernel family of kernels_src/ (``abi.FAMILIES``, one NVRTC program each)
for the configured archs, or loads their cubins from the disk cache. It never initialises the CUDA
driver: that happens on the first launch, so servers may fork after import.
"""

import os as _os

from ._version import __version__  # noqa: E402
from . import abi  # noqa: E402
from .runtime import nvrtc_build as _compile  # noqa: E402
from .runtime.nvrtc_program import WORKER_ENV as _WORKER_ENV  # noqa: E402
from .abi import FailReason, HashMode, LaunchTag, MAX_REAL_KV_SOURCES  # noqa: E402
from .errors import (CanaryViolationError, CompileError, CorruptedKvError, DriverError, KvCanaryError,  # noqa: E402
                     NoCudaDriverError, UnsupportedDeviceError, ValidationError, ValidationTypeError)

# cubins by arch and family (the driver loads them on first launch); a compile worker compiles only what it is sent
COMPILED = None if _os.environ.get(_WORKER_ENV) else _compile.load_kernels()

from .interop.arrays import ArrayView, as_view, from_pointer  # noqa: E402
from .ops import build_plan, fused_verify, verify, write  # noqa: E402
from .ops.batch import Batch, StepPlan  # noqa: E402
from .ops.sources import (RealKvSource, source_from_slots, sources_from_layers,  # noqa: E402
                          sources_from_pages, sources_from_vllm)
from .ops.state import CanaryBuffer, VerifyContext, ViolationSink  # noqa: E402
from .reporting.violations import Violation, decode_ring  # noqa: E402
from .reporting.verdicts import FailedRequest  # noqa: E402
from .ops.records import CanaryRecords  # noqa: E402
from .config import CanaryConfig  # noqa: E402
from .manager.canary import KvCanary, PoolGroup  # noqa: E402

__all__ = [
    "__version__",
    "abi", "FailReason", "HashMode", "LaunchTag", "MAX_REAL_KV_SOURCES", "CanaryViolationError",
    "CompileError", "DriverError", "KvCanaryError", "NoCudaDriverError", "UnsupportedDeviceError", "ValidationError",
    "ValidationTypeError", "ArrayView", "as_view", "from_pointer", "build_plan", "fused_verify",
    "verify", "write", "Batch", "StepPlan", "RealKvSource", "source_from_slots",
    "sources_from_layers", "sources_from_pages", "sources_from_vllm", "CanaryBuffer",
    "VerifyContext", "ViolationSink", "Violation", "decode_ring", "COMPILED", "KvCanary", "PoolGroup",
    "CanaryRecords", "FailedRequest", "CorruptedKvError", "CanaryConfig",
]
