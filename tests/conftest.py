"""Test tiers: CPU tests always run; tests marked ``gpu`` need a CUDA driver and a device and skip
cleanly without one (the exception cuInit raises without libcuda is caught, never propagated).
Without a device, gpu tests also marked ``emulated`` run instead on the CPU: their kernels, the
real kernels_src/ built with the host C++ compiler, in the emulator of tests/emu behind the fake
driver of tests/support/fake_cuda.py (they skip only when there is no host compiler either)."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    from kvcanary.runtime import driver
    return driver.unavailable_reason()


@functools.lru_cache(maxsize=None)
def emulator_unavailable_reason() -> str | None:
    from tests import emu
    return emu.unavailable_reason()


def emulated(item) -> bool:
    """Whether ``item`` runs its kernels in the CPU emulator (a gpu test, no GPU here)."""
    return (item.get_closest_marker("emulated") is not None and gpu_unavailable_reason() is not None
            and emulator_unavailable_reason() is None)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") is not None and not emulated(item):  # the marker, not the folder name
            reason = gpu_unavailable_reason()
            if reason:
                if item.get_closest_marker("emulated") is not None:
                    reason = f"{emulator_unavailable_reason()}; and {reason}"
                item.add_marker(pytest.mark.skip(reason=f"gpu tier: {reason}"))


@pytest.fixture
def fake(monkeypatch):
    """The fake CUDA driver of tests/support/fake_cuda.py (launches queued per stream, no kernel
    runs), released after the test."""
    from tests.support import fake_cuda
    f = fake_cuda.install(monkeypatch)
    yield f
    fake_cuda.release(f)


@pytest.fixture(autouse=True)
def emulated_device(request, monkeypatch):
    """The fake driver with the emulated kernels, for an emulated test (None otherwise)."""
    if not emulated(request.node):
        yield None
        return
    from tests import emu
    from tests.support import fake_cuda
    fake = fake_cuda.install(monkeypatch)
    fake.kernels, fake.immediate = emu.Kernels(), True  # launches run in program order
    try:
        yield fake
    finally:
        fake_cuda.release(fake)
