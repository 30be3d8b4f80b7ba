"""The padding-slot rule and an SWA window (docs/format.md §8), on the CPU reference: the first
verified entry's predecessor outside the window may map to slot 0 (no report); a 0 inside the
window is reported as PADDING_SLOT_READ. tests/gpu/emulated/test_manager_emulated.py holds the kernels to it."""

from __future__ import annotations

import pytest

from kvcanary import FailReason
from tests.support.swa_window import VARIANTS, run


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("hash_mode,layers", VARIANTS)
def test_an_out_of_window_predecessor_on_slot_0_is_not_a_padding_read(hash_mode, layers, fused):
    """Catches the padding-slot rule applied to the first SWA entry's predecessor as well: a false
    PADDING_SLOT_READ on a healthy request whose out-of-window token's SWA slot was freed."""
    assert run(None, hash_mode, layers, zero_position=5, fused=fused) == []


@pytest.mark.parametrize("hash_mode,layers", VARIANTS)
def test_a_slot_0_inside_the_window_is_reported(hash_mode, layers):
    """The control: position 7 inside the window (a later entry's required predecessor, and an entry
    itself) on slot 0 is a padding read, reported in HEAD and TAIL of the SWA group."""
    rows = run(None, hash_mode, layers, zero_position=7)
    assert rows and all(tag.endswith("_SWA") for tag, _, _, _ in rows)
    assert any(bits & FailReason.PADDING_SLOT_READ for _, bits, _, _ in rows)
