"""CanaryConfig: a canary's settings checked once, frozen, given whole or as KvCanary's keywords."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import kvcanary as kc
from kvcanary import CanaryConfig, ValidationError, ValidationTypeError
from kvcanary.abi import HashMode


def pools():
    k = np.zeros((16, 16), np.uint8)
    return kc.PoolGroup(16, k_sources=[kc.source_from_slots(k)], v_sources=[kc.source_from_slots(k.copy())])


def test_a_config_or_keywords_or_both_give_the_same_canary_settings():
    config = CanaryConfig(max_batch=4, hash_mode="all", stats_every=2)
    a = kc.KvCanary(pools(), config=config)
    b = kc.KvCanary(pools(), max_batch=4, hash_mode="all", stats_every=2)
    c = kc.KvCanary(pools(), config=config, mode="fail_request")  # a keyword overrides the config's field
    assert a.config == b.config == dataclasses.replace(c.config, mode="log")
    assert a.config.hash_mode is HashMode.ALL and a.plans["FULL"].max_batch == 4 and c.mode == "fail_request"
    assert config.mode == "log", "the caller's config is never changed"


def test_a_config_is_checked_once_and_frozen():
    with pytest.raises(ValidationError, match="max_batch"):
        CanaryConfig(max_batch=0)
    with pytest.raises(ValidationError, match="fingerprint_every=4 needs the fused verify"):
        CanaryConfig(fingerprint_every=4, fused=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        CanaryConfig().max_batch = 3


def test_unknown_settings_and_a_wrong_config_are_refused_naming_the_fields():
    with pytest.raises(ValidationTypeError, match=r"unknown settings \['max_bach'\].*CanaryConfig: device, hash_mode"):
        kc.KvCanary(pools(), max_bach=4)
    with pytest.raises(ValidationTypeError, match=r"KvCanary\(config=\) must be a kvcanary.CanaryConfig, got dict"):
        kc.KvCanary(pools(), config={"max_batch": 4})
