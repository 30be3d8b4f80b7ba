"""The kvcanary error hierarchy. Every message starts with ``kv-canary:`` and says what was
expected, what was got, and how to fix it."""

from __future__ import annotations


class KvCanaryError(Exception):
    """Base of every error kvcanary raises on purpose."""


class ValidationError(KvCanaryError, ValueError):
    """Bad input caught on the host before any launch (shape, dtype, layout, value)."""


class BatchValueError(ValidationError):
    """A host-array batch value the device would report as BATCH_INDEX_OUT_OF_RANGE, rejected
    before anything ran. Carries what the device row would: ``field`` (abi.BatchField),
    ``request`` (index in the batch, -1 for the token arrays), ``value``, ``bound``, ``slot``."""

    def __init__(self, message: str, *, field: int, request: int, value: int, bound: int, slot: int = -1):
        super().__init__(message)
        self.field, self.request, self.value, self.bound, self.slot = field, request, value, bound, slot


class ValidationTypeError(KvCanaryError, TypeError):
    """An argument of the wrong kind (not an array, wrong dtype family)."""


class CompileError(KvCanaryError):
    """NVRTC rejected a kernel; carries the log, the options and the numbered source."""

    def __init__(self, message: str, *, log: str = "", options: tuple[str, ...] = (), source: str = ""):
        numbered = "\n".join(f"{i + 1:5d}  {line}" for i, line in enumerate(source.splitlines()))
        super().__init__(f"{message}\n--- NVRTC log ---\n{log.strip()}\n--- options ---\n"
                         f"{' '.join(options)}\n--- source ---\n{numbered}")
        self.log, self.options, self.source = log, options, source


class DriverError(KvCanaryError, RuntimeError):
    """A CUDA driver call failed; names the operation and the CUresult."""

    def __init__(self, operation: str, result_name: str, hint: str = ""):
        super().__init__(f"kv-canary: CUDA driver call {operation} failed with {result_name}"
                         + (f"; {hint}" if hint else ""))
        self.operation, self.result_name = operation, result_name


class NoCudaDriverError(DriverError):
    """No usable CUDA driver on this machine."""

    def __init__(self, detail: str):
        KvCanaryError.__init__(
            self,
            "kv-canary: no CUDA driver found (" + detail + "). Expected an NVIDIA driver "
            "(libcuda.so) to launch kernels. Still available without a GPU: host arrays run on "
            "the CPU reference backend (numpy), validation, NVRTC compilation and the compile "
            "cache, `python -m kvcanary doctor` and `python -m kvcanary demo --backend cpu`. "
            "Fix: pass numpy arrays, or install the NVIDIA driver on a machine with a GPU.")
        self.operation, self.result_name = "cuInit", "DynamicLibNotFoundError"


class UnsupportedDeviceError(DriverError):
    """A GPU older than the oldest arch the kernels run on (``kvcanary.abi.MIN_ARCH``)."""

    def __init__(self, ordinal: int, arch: int, oldest: int):
        KvCanaryError.__init__(
            self,
            f"kv-canary: CUDA device {ordinal} is sm_{arch}, older than sm_{oldest}, the oldest GPU kvcanary's "
            f"kernels run on (Ampere: A100, A10, RTX 30xx and newer). Fix: run the canary on an sm_{oldest}+ GPU, "
            f"or on the CPU reference backend (KvCanary(device=None) with host arrays)")
        self.operation, self.result_name = "cuDeviceGetAttribute(COMPUTE_CAPABILITY)", "unsupported"


class CanaryViolationError(KvCanaryError, RuntimeError):
    """Raised in mode "raise" when the device reported violations; carries every row."""

    def __init__(self, violations, overflow: int = 0):
        lines = [str(v) for v in violations]
        more = f" (+{overflow} not recorded: ring full)" if overflow else ""
        super().__init__(f"kv-canary: {len(lines)} KV cache violation(s){more}:\n" + "\n".join(lines))
        self.violations, self.overflow = list(violations), overflow


class CorruptedKvError(KvCanaryError, RuntimeError):
    """The error an engine adapter fails one request with in mode "fail_request": the request read
    (or wrote) KV that failed the canary's checks (``failed``: its :class:`~kvcanary.reporting.verdicts.FailedRequest`)."""

    def __init__(self, request_id, failed):
        shown = list(failed.slots[:8])
        more = f" (+{len(failed.slots) - 8} more)" if len(failed.slots) > 8 else ""
        super().__init__(f"kv-canary: request {request_id!r} read KV cache entries that failed the canary's checks "
                         f"in step {failed.step} ({failed.reason_text} at slots {shown}{more}); it was "
                         f"ended there, without that step's token, and its KV blocks are kept out of prefix reuse. "
                         f"Retry the request (it recomputes its prefix); the canary log names the corrupted entries")
        self.request_id, self.failed = request_id, failed
