"""perf/test_timeline.py's trace reduction, on the CPU: medians per kernel position of a
hand-written chrome trace (expected values worked out by hand)."""

from __future__ import annotations

import pytest

from perf.test_timeline import kernel_events, per_kernel


def event(name, ts, dur, cat="kernel"):
    return dict(name=name, ts=ts, dur=dur, cat=cat)


def trace(*events):
    return {"traceEvents": list(events)}


def test_medians_per_kernel_position():
    t = trace(
        # replay 1: b starts 1 us before a ends (PDL overlap), span 0..9
        event("kvc_a", 100.0, 4.0), event("kvc_b", 103.0, 6.0),
        event("cudaLaunchKernel", 100.0, 1.0, cat="cuda_runtime"),  # not a kernel
        event("kvcp_spin", 50.0, 20.0),                               # not kvcanary's
        # replay 2: b starts 2 us after a ends, span 0..10
        event("kvc_a", 200.0, 3.0), event("kvc_b", 205.0, 5.0),
        # replay 3: b starts right as a ends, span 0..11
        event("kvc_a", 300.0, 5.0), event("kvc_b", 305.0, 6.0),
    )
    got = per_kernel(kernel_events(t), 3)
    assert [k["name"] for k in got] == ["kvc_a", "kvc_b", "(step span)"]
    assert got[0] == dict(name="kvc_a", start_us=0.0, dur_us=4.0, gap_us=0.0)
    assert got[1] == dict(name="kvc_b", start_us=5.0, dur_us=6.0, gap_us=0.0)  # gaps -1, 2, 0
    assert got[2]["dur_us"] == 10.0  # spans 9, 10, 11


def test_events_sorted_by_start():
    t = trace(event("kvc_b", 5.0, 1.0), event("kvc_a", 1.0, 1.0))
    assert [k[0] for k in kernel_events(t)] == ["kvc_a", "kvc_b"]


def test_uneven_replays_refused():
    t = trace(event("kvc_a", 0.0, 1.0), event("kvc_b", 2.0, 1.0), event("kvc_a", 10.0, 1.0))
    with pytest.raises(AssertionError, match="not a multiple"):
        per_kernel(kernel_events(t), 2)


def test_different_sequences_refused():
    t = trace(event("kvc_a", 0.0, 1.0), event("kvc_b", 2.0, 1.0),
              event("kvc_b", 10.0, 1.0), event("kvc_a", 12.0, 1.0))
    with pytest.raises(AssertionError, match="different kernel sequences"):
        per_kernel(kernel_events(t), 2)
