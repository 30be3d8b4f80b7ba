"""Prometheus metrics of a :class:`kvcanary.KvCanary` (optional: ``pip install 'kvcanary[metrics]'``).

:class:`PrometheusMetrics` subscribes to a canary with ``canary.add_listener`` and turns the
records the export target gets into metrics of a ``prometheus_client`` registry:

counters (exposed with the ``_total`` suffix)
    ``kvcanary_violations_total{tag, reason}``: one per violation record and set fail-reason bit:
    a row with two bits (``verify_chain_hash`` and ``verify_position``) counts once under each
    reason, so alert on a reason, and use ``kvcanary_violation_records_total{tag}`` (one per row)
    to count violations. ``kvcanary_verified_slots_total``, ``kvcanary_protected_tokens_total``,
    ``kvcanary_skipped_verifies_total``, ``kvcanary_ring_overflow_total`` (detected but not
    recorded: ring full), ``kvcanary_export_errors_total``, ``kvcanary_unattributed_total``,
    ``kvcanary_self_tests_total`` (with ``self_test_every=N``: alert when it stops rising);
gauges
    ``kvcanary_steps_behind`` (snapshots in flight), ``kvcanary_step`` (last reported step).

The stats records carry cumulative values (``canary.stats()``); each counter grows by what the
value gained since the previous record and never decreases. A value lower than the last one seen
is read as Prometheus reads a counter reset: the count restarted from 0, so the whole new value
is added. Keys a canary does not report stay at 0.
``labels`` (e.g. ``{"tp_rank": "0"}``) are added to every series, so several canaries of one
process can share a registry. Nothing here runs unless a :class:`PrometheusMetrics` is created:
``import kvcanary`` never imports this module or ``prometheus_client``.
"""

from __future__ import annotations

import re
import threading
import weakref

from ..errors import KvCanaryError, ValidationError, ValidationTypeError

# stats key -> (metric name as prometheus_client takes it: the "_total" suffix is added on export, help)
COUNTERS = {
    "verified_slots": ("kvcanary_verified_slots", "Verify entries checked (every verify launch: K and V, HEAD and TAIL)."),
    "protected_tokens": ("kvcanary_protected_tokens", "Tokens stamped by the TAIL writes of the full-attention group."),
    "skipped_verifies": ("kvcanary_skipped_verifies", "Steps whose verify was skipped: more cached entries than verify_capacity."),
    "ring_overflow": ("kvcanary_ring_overflow", "Violations detected but not recorded because the violation ring was full."),
    "export_errors": ("kvcanary_export_errors", "Records the export target failed to take."),
    "unattributed": ("kvcanary_unattributed", "Index errors counted on the device without a ring row."),
    "self_tests": ("kvcanary_self_tests", "Self-test rows received (KvCanary(self_test_every=N)): the detector's heartbeat."),
}
GAUGES = {
    "steps_behind": ("kvcanary_steps_behind", "Status snapshots still in flight on the device."),
    "step": ("kvcanary_step", "The last step the canary reported."),
}
VIOLATIONS = ("kvcanary_violations", "Violation records by launch tag and fail reason (one per set reason bit).")
RECORDS = ("kvcanary_violation_records", "Violation records (ring rows) by launch tag.")
FAILED = ("kvcanary_failed_requests", "Requests of a step's batch that read or wrote KV failing a check (docs/format.md "
          "5.7), by fail reason (one per set reason bit); each is failed in mode fail_request.")
RESERVED_LABELS = ("tag", "reason")
_LABEL_NAME = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")  # Prometheus' label names; "__" starts reserved ones

_families: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # registry -> (label names, metrics)
_families_lock = threading.Lock()


class MetricsUnavailableError(KvCanaryError, ImportError):
    """prometheus_client is not installed."""


def _prometheus():
    try:  # on first use: prometheus_client is optional (the kvcanary[metrics] extra)
        import prometheus_client
    except ImportError as exc:
        raise MetricsUnavailableError(
            f"kv-canary: Prometheus metrics need the prometheus_client package, got {exc!r}. "
            "Fix: pip install 'kvcanary[metrics]' (or pip install 'prometheus-client>=0.17').") from exc
    return prometheus_client


def _metric_families(pc, registry, names: tuple[str, ...]) -> dict:
    """The metric objects of ``registry`` for constant label names ``names`` (created once per
    registry, so several exporters share them; label names must then agree)."""
    with _families_lock:
        if registry in _families:
            have, metrics = _families[registry]
            if have != names:
                raise ValidationError(
                    f"kv-canary: every PrometheusMetrics on one registry must use the same label names, "
                    f"expected {list(have)}, got {list(names)}. Fix: pass labels with the same keys "
                    "(different values), or a registry of its own (registry=CollectorRegistry()).")
            return metrics
        metrics = {key: pc.Counter(name, doc, names, registry=registry) for key, (name, doc) in COUNTERS.items()}
        metrics.update({key: pc.Gauge(name, doc, names, registry=registry) for key, (name, doc) in GAUGES.items()})
        metrics["violations"] = pc.Counter(*VIOLATIONS, (*names, "tag", "reason"), registry=registry)
        metrics["records"] = pc.Counter(*RECORDS, (*names, "tag"), registry=registry)
        metrics["failed"] = pc.Counter(*FAILED, (*names, "reason"), registry=registry)
        _families[registry] = (names, metrics)
        return metrics


def _check_labels(labels) -> dict[str, str]:
    if labels is None:
        return {}
    if not isinstance(labels, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
        raise ValidationTypeError(f"kv-canary: labels must be a dict of str to str, got {labels!r}. "
                                  "Fix: pass e.g. labels={'tp_rank': '0'}.")
    bad = sorted(k for k in labels if not _LABEL_NAME.match(k) or k.startswith("__"))
    if bad:
        raise ValidationError(f"kv-canary: label names must match [a-zA-Z_][a-zA-Z0-9_]* and not start with '__' "
                              f"(Prometheus' rule), got {bad}. Fix: rename them, e.g. 'tp_rank'.")
    clash = sorted(set(labels) & set(RESERVED_LABELS))
    if clash:
        raise ValidationError(f"kv-canary: labels may not use the names {list(RESERVED_LABELS)} (the "
                              f"violation counter's own labels), got {clash}. Fix: rename them, e.g. 'engine_tag'.")
    return dict(labels)


class PrometheusMetrics:
    """Metrics of one canary in a ``prometheus_client`` registry (default: the global
    ``prometheus_client.REGISTRY``); see the module docstring for the series. Creating it
    subscribes to ``canary``; it is then called with every record, on the thread that steps
    the canary (prometheus_client's metrics are safe to scrape meanwhile)."""

    def __init__(self, canary, registry=None, labels: dict[str, str] | None = None):
        if not callable(getattr(canary, "add_listener", None)):
            raise ValidationTypeError(f"kv-canary: PrometheusMetrics needs a KvCanary (an object with "
                                      f"add_listener), got {type(canary).__name__}. Fix: pass the KvCanary.")
        pc = _prometheus()
        self.labels = _check_labels(labels)
        if registry is not None and not callable(getattr(registry, "register", None)):
            raise ValidationTypeError(f"kv-canary: registry must be a prometheus_client CollectorRegistry or None, got "
                                      f"{type(registry).__name__}. Fix: pass prometheus_client.CollectorRegistry() "
                                      f"or leave it out (the global registry).")
        self.registry = pc.REGISTRY if registry is None else registry
        self._metrics = _metric_families(pc, self.registry, tuple(sorted(self.labels)))
        self._series = {key: self._metrics[key].labels(**self.labels) if self.labels else self._metrics[key]
                        for key in (*COUNTERS, *GAUGES)}
        self._last = dict.fromkeys(COUNTERS, 0)
        canary.add_listener(self)

    def __call__(self, record: dict) -> None:
        kind = record.get("type")
        if kind == "violation":
            self._violation(record)
        elif kind == "stats":
            self._stats(record)
        elif kind == "failed_request":
            for reason in str(record.get("reasons") or "unknown").split("+"):
                self._metrics["failed"].labels(**self.labels, reason=reason).inc()

    def _violation(self, record: dict) -> None:
        tag = str(record.get("launch_tag", "unknown"))
        self._metrics["records"].labels(**self.labels, tag=tag).inc()
        for reason in record.get("fail_reason") or ["unknown"]:
            self._metrics["violations"].labels(**self.labels, tag=tag, reason=str(reason)).inc()
        self._advance("ring_overflow", record.get("ring_overflow", 0))  # cumulative, like the stats key

    def _stats(self, record: dict) -> None:
        for key in COUNTERS:
            if key in record:  # an absent key is not a reset (ring_overflow also comes with violations)
                self._advance(key, record[key])
        for key in GAUGES:
            self._series[key].set(int(record.get(key, 0)))

    def _advance(self, key: str, value) -> None:
        """Grow counter ``key`` to the cumulative ``value`` (never down; see the module docstring)."""
        value = int(value or 0)
        last, self._last[key] = self._last[key], value
        gained = value - last if value >= last else value  # lower: restarted from 0
        if gained > 0:
            self._series[key].inc(gained)


def start_http_server(port: int, addr: str = "0.0.0.0", registry=None):
    """Serve ``registry`` (default: prometheus_client's global one) at ``http://addr:port/metrics``
    from a daemon thread; returns prometheus_client's (server, thread). ``port=0`` takes a free
    port: read it from ``server.server_port``. Stop it with ``server.shutdown()``."""
    if isinstance(port, bool) or not isinstance(port, int):
        raise ValidationTypeError(f"kv-canary: port must be an int, got {type(port).__name__}. Fix: e.g. port=9400.")
    if not 0 <= port <= 65535:
        raise ValidationError(f"kv-canary: port must be in [0, 65535], got {port}. Fix: e.g. port=9400.")
    if not isinstance(addr, str):
        raise ValidationTypeError(f"kv-canary: addr must be a host name or address string, got {type(addr).__name__}. "
                                  f"Fix: e.g. addr='0.0.0.0' (every interface) or addr='127.0.0.1'.")
    pc = _prometheus()
    try:
        return pc.start_http_server(port, addr=addr, registry=pc.REGISTRY if registry is None else registry)
    except OSError as exc:
        raise ValidationError(f"kv-canary: the metrics server must be able to listen on {addr}:{port}, got "
                              f"{type(exc).__name__}: {exc.strerror or exc}. Fix: pick a free port (port=0 takes "
                              f"one) and an address of this host.") from None
