"""Prometheus metrics and OpenTelemetry spans from real operations, and the promise that
``import idemlock`` imports neither (nor Celery)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry

import idemlock
from idemlock import Claimed, IdempotencySpec, LockSpec
from idemlock.integrations.otel import OpenTelemetryHook
from idemlock.integrations.prometheus import PrometheusHook

#: what must never show up in a label or an attribute
SECRET_KEY = "order-4111111111111111"
SECRET_PAYLOAD = "alice@example.com"


@pytest.fixture(params=["memory", "sqlite"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    return "memory://" if request.param == "memory" else f"sqlite:///{tmp_path}/metrics.db"


def exercise(coord: idemlock.Coordinator) -> None:
    """One of every outcome an application meets."""
    port = coord.idempotency(IdempotencySpec("charge", lease=timedelta(seconds=30)))
    claim = port.claim(SECRET_KEY, payload={"email": SECRET_PAYLOAD})
    assert isinstance(claim, Claimed)
    assert isinstance(port.claim(SECRET_KEY, payload={"email": SECRET_PAYLOAD}), idemlock.InFlight)
    port.complete(claim.token, {"ok": True})
    assert isinstance(port.claim(SECRET_KEY, payload={"email": SECRET_PAYLOAD}), idemlock.Completed)
    with pytest.raises(idemlock.PayloadMismatch):
        port.claim(SECRET_KEY, payload={"email": "mallory@example.com"})
    other = port.claim("order-2", payload=None)
    assert isinstance(other, Claimed)
    port.abandon(other.token)
    with pytest.raises(idemlock.StaleClaim):
        port.complete(other.token, 1)

    locks = coord.lock(LockSpec("report", ttl=timedelta(seconds=5)))
    lease = locks.acquire("nightly", owner="host-a")
    assert lease is not None
    assert locks.renew(lease)
    assert locks.acquire("nightly", owner="host-b", wait=0.05) is None
    assert locks.release(lease)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_prometheus_counts_real_operations(url: str) -> None:
    registry = CollectorRegistry()
    coord = idemlock.connect(url, hooks=[PrometheusHook(registry=registry)])
    exercise(coord)
    store = coord.store.kind
    assert store in ("memory", "sqlite")
    c = {"spec": "charge", "store": store}
    assert sample(registry, "idemlock_claims_total", **c, outcome="claimed") == 2
    assert sample(registry, "idemlock_claims_total", **c, outcome="in_flight") == 1
    assert sample(registry, "idemlock_claims_total", **c, outcome="replayed") == 1
    assert sample(registry, "idemlock_claims_total", **c, outcome="mismatch") == 1
    assert sample(registry, "idemlock_completions_total", **c, outcome="ok") == 1
    assert sample(registry, "idemlock_completions_total", **c, outcome="stale") == 1
    assert sample(registry, "idemlock_abandons_total", **c, outcome="ok") == 1
    r = {"spec": "report", "store": store}
    assert sample(registry, "idemlock_lock_acquisitions_total", **r, outcome="acquired") == 1
    assert sample(registry, "idemlock_lock_acquisitions_total", **r, outcome="timeout") == 1
    assert sample(registry, "idemlock_renewals_total", **r, outcome="ok") == 1
    assert sample(registry, "idemlock_lock_releases_total", **r, outcome="ok") == 1

    hist = "idemlock_operation_duration_seconds"
    assert sample(registry, hist + "_count", operation="claim", **c) == 5
    assert sample(registry, hist + "_count", operation="acquire", **r) == 2
    # The timed-out acquire waited 50 ms, and its duration says so.
    assert sample(registry, hist + "_sum", operation="acquire", **r) >= 0.05
    assert sample(registry, hist + "_bucket", operation="claim", le="+Inf", **c) == 5

    labels = {v for m in registry.collect() for s in m.samples for v in s.labels.values()}
    assert not any(SECRET_KEY in v or SECRET_PAYLOAD in v or "host-" in v for v in labels)
    assert {"charge", "report", store} <= labels
    coord.close()


def test_prometheus_counts_decorated_calls_and_lost_leases() -> None:
    registry = CollectorRegistry()
    coord = idemlock.connect("memory://")
    coord.add_hook(PrometheusHook(registry=registry))
    # A second hook on the same registry shares its metrics instead of failing.
    tenant = coord.for_tenant("acme")
    tenant.add_hook(PrometheusHook(registry=registry))

    @coord.idempotent("double", key=lambda n: f"n-{n}")
    def double(n: int) -> int:
        return n * 2

    assert double(2) == double(2) == 4
    d = {"spec": "double", "store": "memory"}
    # Hooks are shared by a coordinator and its tenant views: two hooks, two counts.
    assert sample(registry, "idemlock_claims_total", **d, outcome="claimed") == 2
    assert sample(registry, "idemlock_claims_total", **d, outcome="replayed") == 2

    locks = coord.lock(LockSpec("job", ttl=timedelta(seconds=0.3)))
    with pytest.raises(idemlock.LockLost), locks.hold("k") as lease:
        locks.release(lease)  # lost from under the holder: the next renewal fails
        deadline = time.monotonic() + 5
        while not lease.lost and time.monotonic() < deadline:
            time.sleep(0.01)
    j = {"spec": "job", "store": "memory"}
    assert sample(registry, "idemlock_leases_lost_total", **j) == 2
    assert sample(registry, "idemlock_renewals_total", **j, outcome="failed") == 2
    coord.close()


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def test_otel_spans_for_real_operations(
    url: str, spans: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    provider, exporter = spans
    coord = idemlock.connect(url, hooks=[OpenTelemetryHook(provider)])
    tracer = provider.get_tracer("app")
    with tracer.start_as_current_span("job") as job:
        exercise(coord)
    store = coord.store.kind
    finished = {s.name: s for s in exporter.get_finished_spans()}
    got = [
        (s.name, (s.attributes or {}).get("idemlock.outcome"))
        for s in exporter.get_finished_spans()
        if s.name != "job"
    ]
    assert got == [
        ("idemlock.claim", "claimed"),
        ("idemlock.claim", "in_flight"),
        ("idemlock.complete", "ok"),
        ("idemlock.claim", "replayed"),
        ("idemlock.claim", "mismatch"),
        ("idemlock.claim", "claimed"),
        ("idemlock.abandon", "ok"),
        ("idemlock.complete", "stale"),
        ("idemlock.acquire", "acquired"),
        ("idemlock.renew", "ok"),
        ("idemlock.acquire", "timeout"),
        ("idemlock.release", "ok"),
    ]
    for s in exporter.get_finished_spans():
        if s.name == "job":
            continue
        attrs = dict(s.attributes or {})
        assert attrs["idemlock.store"] == store
        assert attrs["idemlock.spec"] in ("charge", "report")
        assert set(attrs) == {
            "idemlock.spec",
            "idemlock.store",
            "idemlock.outcome",
            "idemlock.kind",
        }
        assert not any(SECRET_KEY in str(v) or SECRET_PAYLOAD in str(v) for v in attrs.values())
        assert s.parent is not None and s.parent.span_id == job.get_span_context().span_id
        assert s.start_time is not None and s.end_time is not None
        assert s.start_time <= s.end_time
        failed = attrs["idemlock.outcome"] in ("stale", "mismatch")
        assert (s.status.status_code is StatusCode.ERROR) == failed
    timeout = _only(exporter.get_finished_spans(), "idemlock.acquire", "timeout")
    assert timeout.end_time is not None and timeout.start_time is not None
    assert timeout.end_time - timeout.start_time >= 50_000_000  # its 50 ms wait
    assert finished["job"].parent is None
    coord.close()


def _only(spans: tuple[ReadableSpan, ...], name: str, outcome: str) -> ReadableSpan:
    (span,) = [
        s
        for s in spans
        if s.name == name and (s.attributes or {}).get("idemlock.outcome") == outcome
    ]
    return span


def test_hooks_are_called_for_async_coordinators(
    spans: tuple[TracerProvider, InMemorySpanExporter],
) -> None:
    import asyncio

    import idemlock.aio

    provider, exporter = spans
    registry = CollectorRegistry()

    async def main() -> None:
        coord = idemlock.aio.connect(
            "memory://", hooks=[PrometheusHook(registry=registry), OpenTelemetryHook(provider)]
        )

        @coord.idempotent("triple", key=lambda n: f"n-{n}")
        async def triple(n: int) -> int:
            return n * 3

        assert await triple(1) == await triple(1) == 3
        await coord.close()

    asyncio.run(main())
    t = {"spec": "triple", "store": "memory"}
    assert sample(registry, "idemlock_claims_total", **t, outcome="replayed") == 1
    assert [s.name for s in exporter.get_finished_spans()] == [
        "idemlock.claim",
        "idemlock.complete",
        "idemlock.claim",
    ]


def test_import_idemlock_imports_no_extra() -> None:
    code = (
        "import sys, idemlock, idemlock.integrations, idemlock.aio\n"
        "c = idemlock.connect('memory://')\n"
        "c.idempotency('s').claim('k')\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('prometheus_client', 'opentelemetry', 'celery', 'kombu')]\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr


def test_the_library_logs_nothing_in_normal_operation(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG", logger="idemlock")
    coord = idemlock.connect(url)
    exercise(coord)
    coord.close()
    assert [r for r in caplog.records if r.name.startswith("idemlock")] == []


def test_a_broken_hook_warns_and_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    def broken(event: idemlock.Event) -> None:
        raise RuntimeError("metrics backend down")

    coord = idemlock.connect("memory://", hooks=[broken])
    port = coord.idempotency("s")
    claim = port.claim("k")
    assert isinstance(claim, Claimed)
    port.complete(claim.token, 1)
    assert isinstance(port.claim("k"), idemlock.Completed)
    warnings = [r for r in caplog.records if r.name == "idemlock"]
    assert warnings and all(r.levelname == "WARNING" for r in warnings)


# ---- gauges of what this process holds ---------------------------------------------


def test_prometheus_gauges_follow_claims_and_locks_of_this_process(url: str) -> None:
    registry = CollectorRegistry()
    coord = idemlock.connect(url, hooks=[PrometheusHook(registry=registry)])
    store = coord.store.kind
    c = {"spec": "charge", "store": store}
    r = {"spec": "report", "store": store}

    def in_flight(spec: str = "charge") -> float:
        return sample(registry, "idemlock_claims_in_flight", spec=spec, store=store)

    def held() -> float:
        return sample(registry, "idemlock_locks_held", **r)

    port = coord.idempotency(IdempotencySpec("charge", lease=timedelta(seconds=30)))
    first = port.claim("a")
    second = port.claim("b")
    assert isinstance(first, Claimed) and isinstance(second, Claimed)
    assert in_flight() == 2
    # A busy or replayed claim is not this process's: no change.
    assert isinstance(port.claim("a"), idemlock.InFlight)
    assert in_flight() == 2
    port.complete(first.token, 1)
    assert in_flight() == 1
    assert isinstance(port.claim("a"), idemlock.Completed)
    assert in_flight() == 1
    port.abandon(second.token)
    assert in_flight() == 0
    other = coord.idempotency("other").claim("a")
    assert isinstance(other, Claimed)
    assert in_flight("other") == 1 and in_flight() == 0

    locks = coord.lock(LockSpec("report", ttl=timedelta(seconds=5)))
    one = locks.acquire("x")
    two = locks.acquire("y")
    assert one is not None and two is not None
    assert held() == 2
    assert locks.acquire("x", wait=0.02) is None  # timed out: not held
    assert held() == 2
    locks.release(one)
    assert held() == 1
    with locks.hold("z"):
        assert held() == 2
    assert held() == 1
    locks.release(two)
    assert held() == 0
    assert registry.get_sample_value("idemlock_locks_held", c) is None  # no lock of that spec
    coord.close()


def test_prometheus_gauges_drop_a_lost_lease_once() -> None:
    registry = CollectorRegistry()
    coord = idemlock.connect("memory://", hooks=[PrometheusHook(registry=registry)])
    j = {"spec": "job", "store": "memory"}
    locks = coord.lock(LockSpec("job", ttl=timedelta(seconds=0.3)))
    keep = locks.acquire("other")
    assert keep is not None
    with pytest.raises(idemlock.LockLost), locks.hold("k") as lease:
        assert sample(registry, "idemlock_locks_held", **j) == 2
        # Freed behind the holder's back (as another process's expiry takeover would).
        assert coord.store.release(lease._ns, lease.key, lease.owner, lease.token)
        deadline = time.monotonic() + 5
        while not lease.lost and time.monotonic() < deadline:
            time.sleep(0.01)
        # Counted down when the loss was detected, before the block ends.
        assert sample(registry, "idemlock_locks_held", **j) == 1
    # Leaving the block released (not_held): not counted down a second time.
    assert sample(registry, "idemlock_lock_releases_total", **j, outcome="not_held") == 1
    assert sample(registry, "idemlock_locks_held", **j) == 1
    locks.release(keep)
    assert sample(registry, "idemlock_locks_held", **j) == 0
    coord.close()


def test_otel_gauges_follow_claims_and_locks() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    coord = idemlock.connect("memory://", hooks=[OpenTelemetryHook(meter_provider=provider)])

    def values() -> dict[tuple[str, str], int]:
        data = reader.get_metrics_data()
        out: dict[tuple[str, str], int] = {}
        assert data is not None
        for rm in data.resource_metrics:
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    for point in metric.data.data_points:
                        assert point.attributes is not None
                        assert set(point.attributes) == {"idemlock.spec", "idemlock.store"}
                        spec = str(point.attributes["idemlock.spec"])
                        out[(metric.name, spec)] = int(point.value)  # type: ignore[union-attr]
        return out

    port = coord.idempotency("pay")
    claim = port.claim(SECRET_KEY, payload={"email": SECRET_PAYLOAD})
    assert isinstance(claim, Claimed)
    locks = coord.lock(LockSpec("nightly", ttl=timedelta(seconds=5)))
    lease = locks.acquire("report")
    assert lease is not None
    assert values() == {
        ("idemlock.claims.in_flight", "pay"): 1,
        ("idemlock.locks.held", "nightly"): 1,
    }
    port.complete(claim.token, 1)
    locks.release(lease)
    assert values() == {
        ("idemlock.claims.in_flight", "pay"): 0,
        ("idemlock.locks.held", "nightly"): 0,
    }
    coord.close()
    provider.shutdown()


def test_a_break_is_counted_and_the_holders_gauge_drops_once() -> None:
    registry = CollectorRegistry()
    coord = idemlock.connect("memory://", hooks=[PrometheusHook(registry=registry)])
    j = {"spec": "deploy", "store": "memory"}
    locks = coord.lock(LockSpec("deploy", ttl=timedelta(seconds=0.3)))
    with pytest.raises(idemlock.LockLost), locks.hold("prod") as lease:
        assert sample(registry, "idemlock_locks_held", **j) == 1
        # The break itself does not move the gauge (the holder may be another
        # process); the holder's failing renewal does.
        assert locks.break_lock("prod") is True
        assert sample(registry, "idemlock_locks_held", **j) == 1
        deadline = time.monotonic() + 5
        while not lease.lost and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sample(registry, "idemlock_locks_held", **j) == 0
    assert sample(registry, "idemlock_locks_held", **j) == 0
    assert locks.break_lock("prod") is False
    assert sample(registry, "idemlock_lock_breaks_total", **j, outcome="broken") == 1
    assert sample(registry, "idemlock_lock_breaks_total", **j, outcome="not_held") == 1
    hist = "idemlock_operation_duration_seconds_count"
    assert sample(registry, hist, operation="break", **j) == 2
    coord.close()
