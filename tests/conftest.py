"""Test tiers: CPU tests always run; tests marked ``gpu`` need a CUDA driver and a device and skip
cleanly without one (the exception cuInit raises without libcuda is caught, never propagated)."""

from __future__ import annotations

import functools

import pytest


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    from kvcanary import driver
    return driver.unavailable_reason()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not the folder-name keyword
            reason = gpu_unavailable_reason()
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"gpu tier: {reason}"))
