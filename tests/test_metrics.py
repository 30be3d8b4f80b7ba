"""kvcanary.reporting.metrics: a CPU-backend KvCanary stepped clean, then with a flipped K byte, scraped
over HTTP from a running exporter; the conversion of cumulative stats into counters; labels;
and that nothing of it is imported or run unless asked for.

Expected values come from the stats contract (verified_slots: every verify entry of every verify
launch, K and V, HEAD and TAIL: 4 x the cached prefix per step here) and from the injected fault
(one K byte of one slot flipped in "partial" mode: one TAIL_K_FULL row, verify_real_kv_hash).
"""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

import kvcanary as kc
from kvcanary.errors import ValidationError, ValidationTypeError

FIRST_TOKENS = 3  # a 3-token prefill, then one decoded token per step


def test_import_kvcanary_imports_no_metrics():
    code = ("import sys, kvcanary; bad = [m for m in ('prometheus_client', 'kvcanary.reporting.metrics') if m in sys.modules];"
            " print(bad); sys.exit(bool(bad))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture
def pc():
    return pytest.importorskip("prometheus_client")


@pytest.fixture
def registry(pc):
    return pc.CollectorRegistry()


@pytest.fixture
def scrape(registry):
    """GET /metrics of an exporter started with kvcanary.reporting.metrics.start_http_server on a free port;
    returns {(name, labels): value} of the samples, parsed by prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvcanary.reporting.metrics import start_http_server
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    url = f"http://127.0.0.1:{server.server_port}/metrics"

    def get() -> dict:
        with urllib.request.urlopen(url, timeout=10) as resp:
            assert resp.status == 200
            text = resp.read().decode()
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for family in text_string_to_metric_families(text) for s in family.samples}

    yield get
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


class Engine:
    """One request on host pools stepped through a KvCanary (the README's first example)."""

    def __init__(self, hash_mode: str = "partial", **kw):
        self.k = np.zeros((64, 64), np.uint8)
        self.v = np.zeros((64, 64), np.uint8)
        group = kc.PoolGroup(64, k_sources=[kc.source_from_slots(self.k)], v_sources=[kc.source_from_slots(self.v)])
        self.canary = kc.KvCanary(group, device=None, hash_mode=hash_mode, mode="log", max_batch=4,
                                  verify_capacity=1024, **kw)
        self.rtt = np.zeros((2, 32), np.int32)
        self.rtt[1] = np.arange(5, 37)
        self.length = 0

    def step(self, new: int = 1) -> None:
        lo, hi = self.length, self.length + new
        slots = self.rtt[1, lo:hi].astype(np.int64)
        batch = kc.Batch(req_pool_indices=np.array([1], np.int64), prefix_lens=np.array([lo], np.int64),
                         extend_lens=np.array([new], np.int64), req_to_token=self.rtt,
                         input_ids=np.arange(100 + lo, 100 + hi, dtype=np.int64),
                         positions=np.arange(lo, hi, dtype=np.int64), out_cache_loc=slots)
        self.canary.before_forward(batch)
        self.k[slots] = 7  # the model's forward writes the new tokens' KV
        self.v[slots] = 9
        self.canary.after_forward(batch)
        self.length = hi


def verified(prefixes) -> int:
    """verified_slots by the contract: HEAD and TAIL, K and V each check the whole cached prefix."""
    return sum(4 * p for p in prefixes)


def test_scraped_counters_follow_clean_steps_and_a_flipped_kv_byte(registry, scrape, caplog):
    from kvcanary.reporting.metrics import PrometheusMetrics
    engine = Engine()
    stats = []
    PrometheusMetrics(engine.canary, registry=registry, labels={"tp_rank": "0"})
    engine.canary.add_listener(lambda r: stats.append(r) if r["type"] == "stats" else None)
    engine.step(FIRST_TOKENS)
    engine.step()
    engine.step()
    engine.canary.flush()
    clean = scrape()
    assert clean[series("verified_slots_total")] == verified([3, 4])
    assert not [key for key in clean if key[0].startswith("kvcanary_violation")], "a clean run has no violation series"
    for name in ("skipped_verifies", "ring_overflow", "export_errors", "unattributed", "self_tests"):
        assert clean[series(f"{name}_total")] == 0
    assert clean[series("protected_tokens_total")] == stats[-1]["protected_tokens"] > 0
    assert clean[series("step")] == stats[-1]["step"]
    assert clean[series("steps_behind")] == 0

    engine.k[engine.rtt[1, 1], 0] ^= 0x40  # a cached K byte of position 1 changes between steps
    with caplog.at_level("WARNING", logger="kvcanary"):
        engine.step()
        engine.canary.flush()
    faulty = scrape()
    assert [key for key in faulty if key[0] == "kvcanary_violations_total"] == [
        series("violations_total", tag="TAIL_K_FULL", reason="verify_real_kv_hash")]
    assert faulty[series("violations_total", tag="TAIL_K_FULL", reason="verify_real_kv_hash")] == 1
    assert faulty[series("violation_records_total", tag="TAIL_K_FULL")] == 1
    # the one request of the batch read it: one failed request (docs/format.md 5.7), none before
    assert faulty[series("failed_requests_total", reason="verify_real_kv_hash")] == 1
    assert not [key for key in clean if key[0] == "kvcanary_failed_requests_total"]
    assert faulty[series("verified_slots_total")] == verified([3, 4, 5])
    assert faulty[series("protected_tokens_total")] == stats[-1]["protected_tokens"]
    assert faulty[series("protected_tokens_total")] > clean[series("protected_tokens_total")]


def series(name: str, **labels) -> tuple:
    """The scrape key of kvcanary_<name> with the test's tp_rank label and ``labels``."""
    return f"kvcanary_{name}", tuple(sorted({"tp_rank": "0", **labels}.items()))


class FakeCanary:
    """Takes the listener PrometheusMetrics registers, so tests can feed it records."""

    def add_listener(self, callback) -> None:
        self.emit = callback


def stats_record(**values) -> dict:
    return {"type": "stats", "step": 0, **values}


def test_cumulative_stats_become_counter_increments_that_never_decrease(registry):
    from kvcanary.reporting.metrics import PrometheusMetrics
    fake = FakeCanary()
    PrometheusMetrics(fake, registry=registry)
    value = lambda name: registry.get_sample_value(name)  # noqa: E731
    fake.emit(stats_record(step=1, verified_slots=10, export_errors=1, unattributed=2, skipped_verifies=1,
                           ring_overflow=3, steps_behind=2))
    fake.emit(stats_record(step=2, verified_slots=25, export_errors=1, unattributed=2, skipped_verifies=1,
                           ring_overflow=3, steps_behind=0))
    assert value("kvcanary_verified_slots_total") == 25
    assert (value("kvcanary_export_errors_total"), value("kvcanary_unattributed_total"),
            value("kvcanary_skipped_verifies_total"), value("kvcanary_ring_overflow_total")) == (1, 2, 1, 3)
    assert value("kvcanary_steps_behind") == 0 and value("kvcanary_step") == 2
    fake.emit(stats_record(step=3, verified_slots=4))  # lower: read as a restart from 0 (+4)
    assert value("kvcanary_verified_slots_total") == 29
    fake.emit(stats_record(step=4, verified_slots=6))
    assert value("kvcanary_verified_slots_total") == 31
    fake.emit(stats_record(step=5))  # a key the canary does not report adds nothing
    assert value("kvcanary_verified_slots_total") == 31


def test_a_row_with_two_reasons_counts_once_per_reason_and_once_as_a_record(registry):
    from kvcanary.reporting.metrics import PrometheusMetrics
    fake = FakeCanary()
    PrometheusMetrics(fake, registry=registry)
    row = {"type": "violation", "launch_tag": "HEAD_V_FULL", "fail_reason": ["verify_chain_hash", "verify_position"],
           "fail_reason_bits": 3, "ring_overflow": 0}
    fake.emit(row)
    fake.emit(dict(row, fail_reason=["verify_chain_hash"], fail_reason_bits=1, ring_overflow=2))
    get = registry.get_sample_value
    assert get("kvcanary_violations_total", {"tag": "HEAD_V_FULL", "reason": "verify_chain_hash"}) == 2
    assert get("kvcanary_violations_total", {"tag": "HEAD_V_FULL", "reason": "verify_position"}) == 1
    assert get("kvcanary_violation_records_total", {"tag": "HEAD_V_FULL"}) == 2
    assert get("kvcanary_ring_overflow_total") == 2
    fake.emit(stats_record(ring_overflow=2))  # the same cumulative count, seen again in the stats
    assert get("kvcanary_ring_overflow_total") == 2
    fake.emit(stats_record())  # a canary whose stats do not carry the key: no reset
    fake.emit(dict(row, ring_overflow=3))
    assert get("kvcanary_ring_overflow_total") == 3


def test_canaries_share_a_registry_through_labels(registry):
    from kvcanary.reporting.metrics import PrometheusMetrics
    ranks = [FakeCanary(), FakeCanary()]
    for i, fake in enumerate(ranks):
        PrometheusMetrics(fake, registry=registry, labels={"tp_rank": str(i)})
    ranks[0].emit(stats_record(verified_slots=5))
    ranks[1].emit(stats_record(verified_slots=7))
    assert registry.get_sample_value("kvcanary_verified_slots_total", {"tp_rank": "0"}) == 5
    assert registry.get_sample_value("kvcanary_verified_slots_total", {"tp_rank": "1"}) == 7
    with pytest.raises(ValidationError, match=r"^kv-canary: .*same label names.*Fix:"):
        PrometheusMetrics(FakeCanary(), registry=registry, labels={"engine": "a"})


@pytest.mark.parametrize("labels,error", [({"tag": "x"}, ValidationError), ({"rank": 0}, ValidationTypeError),
                                          (["rank"], ValidationTypeError)])
def test_bad_labels_are_refused(registry, labels, error):
    from kvcanary.reporting.metrics import PrometheusMetrics
    with pytest.raises(error, match=r"^kv-canary: .*Fix:"):
        PrometheusMetrics(FakeCanary(), registry=registry, labels=labels)


def test_bad_arguments_are_refused(registry):
    from kvcanary.reporting.metrics import PrometheusMetrics, start_http_server
    with pytest.raises(ValidationTypeError, match=r"^kv-canary: .*got object.*Fix:"):
        PrometheusMetrics(object(), registry=registry)
    with pytest.raises(ValidationTypeError, match=r"^kv-canary: port must be an int.*Fix:"):
        start_http_server("9400")
    with pytest.raises(ValidationError, match=r"^kv-canary: port must be in.*got 70000.*Fix:"):
        start_http_server(70000)


def test_without_prometheus_client_the_error_says_what_to_install(monkeypatch):
    from kvcanary.reporting import metrics
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # makes the import fail
    with pytest.raises(metrics.MetricsUnavailableError, match=r"^kv-canary: .*Fix: pip install 'kvcanary\[metrics\]'"):
        metrics.PrometheusMetrics(FakeCanary())
    assert isinstance(metrics.MetricsUnavailableError("x"), ImportError)


def test_self_tests_count_as_a_heartbeat_not_as_violations(registry, scrape):
    from kvcanary.reporting.metrics import PrometheusMetrics
    engine = Engine(self_test_every=2)
    PrometheusMetrics(engine.canary, registry=registry, labels={"tp_rank": "0"})
    for _ in range(5):
        engine.step()
    engine.canary.flush()
    got = scrape()
    assert got[series("self_tests_total")] == 2  # HEAD K verify runs 2 and 4 of 5
    assert not [key for key in got if key[0].startswith("kvcanary_violation")]


def test_the_operators_guides_metrics_blocks_run_as_written(tmp_path):
    """docs/operators.md: the exporter snippet, run after the README's quick start, serves what the
    guide's curl line shows, and the Prometheus config scrapes that port and alerts on a series the
    exporter serves."""
    pytest.importorskip("prometheus_client")
    yaml = pytest.importorskip("yaml")
    from tests.support.docblocks import block, runnable

    quick_start = next(b for b in runnable("") if b.doc.name == "README.md").code
    snippet = block("metrics").code
    command, *shown = block("metrics-scrape").code.splitlines()
    port = int(re.search(r"start_http_server\((\d+)\)", snippet).group(1))
    pattern = re.fullmatch(r"\$ curl -s localhost:(\d+)/metrics \| grep -E '(.*)'", command)
    assert pattern and int(pattern.group(1)) == port, command
    scrape = (f"import re, urllib.request\ncanary.flush()\n"
              f"text = urllib.request.urlopen('http://localhost:{port}/metrics', timeout=10).read().decode()\n"
              f"open('metrics.txt', 'w').write(text)\n"
              f"print('\\n'.join(l for l in text.splitlines() if re.search({pattern.group(2)!r}, l)))\n")
    done = subprocess.run([sys.executable, "-c", quick_start + "\n" + snippet + "\n" + scrape], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    served = done.stdout.splitlines()[-len(shown):]
    assert served == shown, (served, shown)

    config = yaml.safe_load(block("prometheus-rules").code)
    assert config["scrape_configs"][0]["static_configs"][0]["targets"] == [f"engine-host:{port}"]
    (rule,) = config["groups"][0]["rules"]
    series = re.search(r"(kvcanary_\w+)", rule["expr"]).group(1)
    assert f"# TYPE {series} counter" in (tmp_path / "metrics.txt").read_text(), series
