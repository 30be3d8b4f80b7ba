"""Decoding of ring rows (docs/format.md §10): the log line, JSON lines, overflow."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvcanary import abi
from kvcanary.errors import ValidationError, ValidationTypeError
from kvcanary.reporting.violations import Violation, decode_ring


def row(tag=2, slot=7, pos=3, tok=11, exp=-1, chain=-1, aux=0x1234, bits=3):
    return [tag, slot, pos, tok, exp, chain, aux, bits]


def test_log_line_format_by_hand():
    v = Violation.from_row(row())
    assert str(v) == ("kv_canary violation: launch_tag=TAIL_K_FULL fail_reason=verify_chain_hash+verify_position "
                      "slot_idx=7 position=3 stored_token=11 expected_token=-1 "
                      "stored_chain_hash=0xffffffffffffffff expected_aux=0x0000000000001234")
    assert v.reasons == abi.FailReason.VERIFY_CHAIN_HASH_MISMATCH | abi.FailReason.VERIFY_POSITION_MISMATCH


def test_reason_labels_follow_bit_order():
    v = Violation.from_row(row(tag=9, bits=32 | 4 | 8 | 64))
    assert v.reason_text == "verify_real_kv_hash+write_token+verify_token+slot_out_of_range"
    assert v.tag_name == "TAIL_V_SWA"


def test_json_line_carries_the_same_fields():
    d = json.loads(Violation.from_row(row()).to_json(step=5, ring_overflow=2))
    assert d["launch_tag"] == "TAIL_K_FULL" and d["fail_reason"] == ["verify_chain_hash", "verify_position"]
    assert d["stored_chain_hash"] == "0xffffffffffffffff" and d["step"] == 5 and d["ring_overflow"] == 2
    assert d["slot_idx"] == 7 and d["fail_reason_bits"] == 3


def test_decode_ring_with_overflow_and_start():
    ring = np.zeros((4, 8), np.int64)
    for i in range(4):
        ring[i] = row(slot=i + 1)
    out = decode_ring(ring, write_index=9)
    assert [v.slot for v in out.violations] == [1, 2, 3, 4] and out.overflow == 5
    later = decode_ring(ring, write_index=3, start=1)
    assert [v.slot for v in later.violations] == [2, 3] and later.overflow == 0


@pytest.mark.parametrize("ring", [None, np.zeros((4, 7), np.int64), np.zeros((4, 8), np.float64), "rows"])
def test_decode_ring_refuses_what_is_not_a_ring(ring):
    with pytest.raises(ValidationError, match=r"decode_ring needs the ring as int64 rows of 8 columns.*Fix:"):
        decode_ring(ring, 0)


@pytest.mark.parametrize("wi", [None, 1.5, True, np.array([3])])
def test_decode_ring_refuses_a_write_index_that_is_not_an_int(wi):
    with pytest.raises(ValidationTypeError, match=r"decode_ring\(write_index=\) must be an int"):
        decode_ring(np.zeros((4, 8), np.int64), wi)
