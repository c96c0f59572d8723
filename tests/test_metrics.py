"""Prometheus metrics and OpenTelemetry spans from real operations, and the promise that
``import idemlock`` imports neither (nor Celery)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import idemlock
from idemlock import Claimed, ElectionSpec, IdempotencySpec, LockSpec, SemaphoreSpec
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


def test_prometheus_counts_steps(url: str) -> None:
    registry = CollectorRegistry()
    coord = idemlock.connect(url, hooks=[PrometheusHook(registry=registry)])
    port = coord.idempotency(idemlock.IdempotencySpec("ship"))
    with pytest.raises(RuntimeError), port.run("order-9") as attempt:
        attempt.step("label", lambda: "L1")
        raise RuntimeError("crash before the carrier call")
    with port.run("order-9") as attempt:
        attempt.step("label", lambda: "L2")  # replayed: "L1"
        attempt.step("carrier", lambda: "C1")
    s = {"spec": "ship", "store": coord.store.kind}
    assert sample(registry, "idemlock_steps_total", **s, outcome="recorded") == 2
    assert sample(registry, "idemlock_steps_total", **s, outcome="replayed") == 1
    hist = "idemlock_operation_duration_seconds_count"
    assert sample(registry, hist, operation="step", **s) == 3
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


def _otel_values(reader: Any) -> dict[tuple[str, str], int]:
    """Every gauge point the OpenTelemetry reader holds, by (metric name, spec); each
    point is labelled by spec and store only."""
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
                    # up-down counters' points are NumberDataPoint: .value exists, but
                    # the SDK types data_points as a union with histogram points
                    out[(metric.name, spec)] = int(point.value)  # type: ignore[union-attr]
    return out


def test_otel_gauges_follow_claims_and_locks() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    coord = idemlock.connect("memory://", hooks=[OpenTelemetryHook(meter_provider=provider)])

    def values() -> dict[tuple[str, str], int]:
        return _otel_values(reader)

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


# ---- gauges of permits and leader terms ---------------------------------------------


@pytest.fixture(params=["memory", "sqlite", "redis"])
def lease_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A store for the permit and term gauges; Redis through its own server process."""
    if request.param == "memory":
        yield "memory://"
    elif request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/gauges.db"
    else:
        yield request.getfixturevalue("redis_server").url


def _connect(url: str, **kwargs: Any) -> idemlock.Coordinator:
    # A fresh prefix per test: the Redis server is shared by the session.
    return idemlock.connect(url, key_prefix=f"gauges-{time.monotonic_ns()}", **kwargs)


def scrape(registry: CollectorRegistry, name: str, spec: str, store: str) -> float | None:
    """A gauge's value as a scrape of ``/metrics`` returns it (None: no such series)."""
    text = generate_latest(registry).decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and s.labels == {"spec": spec, "store": store}:
                return float(s.value)
    return None


def until(check: Callable[[], bool], what: str, within: float = 60.0) -> None:
    """Wait for ``check()`` (a store or gauge state), failing after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not check():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


def test_permit_gauges_follow_acquire_wait_release_and_loss(lease_url: str) -> None:
    registry = CollectorRegistry()
    coord = _connect(lease_url, hooks=[PrometheusHook(registry=registry)])
    store = coord.store.kind

    def held() -> float | None:
        return scrape(registry, "idemlock_permits_held", "exports", store)

    def waiting() -> float | None:
        return scrape(registry, "idemlock_permits_waiting", "exports", store)

    sem = coord.semaphore(SemaphoreSpec("exports", limit=2, ttl=timedelta(seconds=10)))
    one = sem.acquire(SECRET_KEY)
    two = sem.acquire(SECRET_KEY)
    assert one is not None and two is not None
    assert held() == 2
    assert waiting() is None  # nobody waited yet: no series

    # A waiter in another thread: counted while it waits, then as a holder.
    got: list[idemlock.Permit | None] = []
    waiter = threading.Thread(target=lambda: got.append(sem.acquire(SECRET_KEY, wait=60)))
    waiter.start()
    until(lambda: waiting() == 1, "the waiter counted as waiting")
    assert held() == 2
    assert sem.release(one)
    waiter.join(60)
    assert not waiter.is_alive() and got and got[0] is not None
    assert waiting() == 0
    assert held() == 2

    # A waiter that gives up leaves the waiting gauge and was never a holder.
    assert sem.acquire(SECRET_KEY, wait=0.05) is None
    assert waiting() == 0 and held() == 2
    timeouts = sample(
        registry, "idemlock_lock_acquisitions_total", spec="exports", store=store, outcome="timeout"
    )
    assert timeouts == 1

    assert sem.release(two)
    assert held() == 1
    assert sem.release(got[0])
    assert held() == 0

    # A permit lost under a hold() leaves the gauge once, when the loss is detected.
    with pytest.raises(idemlock.LockLost), sem.hold("other") as permit:
        assert held() == 1
        assert sem.break_permit("other", permit.token)
        assert held() == 1  # the break itself does not move it
        until(lambda: permit.lost, "the holder noticed its loss")
        assert held() == 0
    assert held() == 0  # leaving the block (release not_held) is not counted again

    # Permits are not locks, and no key reaches a label.
    assert scrape(registry, "idemlock_locks_held", "exports", store) is None
    text = generate_latest(registry).decode()
    assert SECRET_KEY not in text and "other" not in text
    coord.close()


def test_permit_gauges_drop_a_cancelled_async_waiter(lease_url: str) -> None:
    import asyncio

    import idemlock.aio

    registry = CollectorRegistry()

    async def main() -> None:
        coord = idemlock.aio.connect(
            lease_url,
            key_prefix=f"gauges-{time.monotonic_ns()}",
            hooks=[PrometheusHook(registry=registry)],
        )
        store = coord.store.kind

        def held() -> float | None:
            return scrape(registry, "idemlock_permits_held", "slots", store)

        def waiting() -> float | None:
            return scrape(registry, "idemlock_permits_waiting", "slots", store)

        async def until_async(check: Callable[[], bool], what: str) -> None:
            deadline = time.monotonic() + 60
            while not check():
                assert time.monotonic() < deadline, f"never happened: {what}"
                await asyncio.sleep(0.005)

        sem = coord.semaphore(SemaphoreSpec("slots", limit=1, ttl=timedelta(seconds=10)))
        async with sem.hold("k") as permit:
            assert held() == 1
            first = asyncio.ensure_future(sem.acquire("k", wait=60))
            second = asyncio.ensure_future(sem.acquire("k", wait=60))
            await until_async(lambda: waiting() == 2, "two waiters counted")
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            assert waiting() == 1  # the cancelled waiter is gone at once
            assert held() == 1
            assert not permit.lost
        # The hold's release hands the permit to the waiter left.
        granted = await asyncio.wait_for(second, 60)
        assert granted is not None
        assert waiting() == 0 and held() == 1
        # An async waiter that gives up.
        assert await sem.acquire("k", wait=0.05) is None
        assert waiting() == 0 and held() == 1
        assert await sem.release(granted)
        assert held() == 0
        await coord.close()

    asyncio.run(main())


#: the terms' ttl where a test waits for a leader to notice its term ended (at its next
#: renewal, a third of the ttl): short, and as long as a renewal on a loaded machine needs
TERM_TTL = timedelta(seconds=3)


def test_leader_term_gauge_follows_campaigns_and_term_changes(lease_url: str) -> None:
    registry = CollectorRegistry()
    coord = _connect(lease_url, hooks=[PrometheusHook(registry=registry)])
    store = coord.store.kind

    def term() -> float | None:
        return scrape(registry, "idemlock_leader_term", "scheduler", store)

    el = coord.election(ElectionSpec("scheduler", ttl=TERM_TTL))
    assert term() is None
    elected = threading.Event()
    numbers: list[int] = []

    def successor() -> None:
        with el.campaign("eu-west", value="host-b") as t:
            numbers.append(t.number)
            elected.set()

    with el.campaign("eu-west", value="host-a") as first:
        assert term() == first.number > 0
        rival = threading.Thread(target=successor)
        rival.start()
        until(lambda: el.leader("eu-west") is not None, "a leader listed")
        assert not elected.is_set()  # the rival waits its turn
        assert term() == first.number
    rival.join(60)
    assert not rival.is_alive() and elected.is_set()
    # The term changed hands; the successor's term was shown while it led, and
    # leaving its block ended it too.
    assert numbers[0] > first.number
    assert term() == 0

    # Two keys led at once: the gauge shows the higher term, and the other when that ends.
    with el.campaign("eu-west") as west:
        with el.campaign("us-east") as east:
            assert term() == max(west.number, east.number)
        assert term() == west.number
    assert term() == 0

    # A term lost (an operator broke it) leaves the gauge when the leader notices.
    with pytest.raises(idemlock.LockLost), el.campaign("eu-west") as t:
        assert term() == t.number
        assert el.break_lock("eu-west", token=t.number)
        until(lambda: t.lost, "the leader noticed its term ended")
        assert term() == 0
    assert term() == 0
    # Elections are neither locks nor permits.
    assert scrape(registry, "idemlock_locks_held", "scheduler", store) is None
    assert scrape(registry, "idemlock_permits_held", "scheduler", store) is None
    assert "eu-west" not in generate_latest(registry).decode()
    coord.close()


def test_leader_term_gauge_async_and_a_cancelled_campaign(lease_url: str) -> None:
    import asyncio

    import idemlock.aio

    registry = CollectorRegistry()
    seen: list[tuple[str, str, str]] = []

    async def main() -> None:
        coord = idemlock.aio.connect(
            lease_url,
            key_prefix=f"gauges-{time.monotonic_ns()}",
            hooks=[
                PrometheusHook(registry=registry),
                lambda e: seen.append((e.name, e.outcome, e.kind)),
            ],
        )
        store = coord.store.kind
        el = coord.election(ElectionSpec("region", ttl=timedelta(seconds=10)))

        def term() -> float | None:
            return scrape(registry, "idemlock_leader_term", "region", store)

        async def rival() -> None:
            async with el.campaign("eu"):
                pytest.fail("elected while the first leader led")

        async with el.campaign("eu") as first:
            assert term() == first.number
            task = asyncio.ensure_future(rival())
            deadline = time.monotonic() + 60
            while ("wait", "started", "election") not in seen:  # the rival is queued
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.005)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert term() == first.number  # a cancelled campaign changes nothing
            assert seen[-1] == ("wait", "ended", "election")
        assert term() == 0
        async with el.campaign("eu") as second:
            assert second.number > first.number
            assert term() == second.number
        assert term() == 0
        await coord.close()

    asyncio.run(main())


def test_otel_gauges_of_permits_and_terms() -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    coord = idemlock.connect("memory://", hooks=[OpenTelemetryHook(meter_provider=provider)])

    def values() -> dict[tuple[str, str], int]:
        return _otel_values(reader)

    sem = coord.semaphore(SemaphoreSpec("exports", limit=1, ttl=timedelta(seconds=10)))
    el = coord.election(ElectionSpec("scheduler", ttl=timedelta(seconds=10)))
    permit = sem.acquire("t")
    assert permit is not None
    waiter = threading.Thread(target=lambda: sem.acquire("t", wait=60))
    waiter.start()
    until(lambda: values().get(("idemlock.permits.waiting", "exports")) == 1, "a waiter")
    with el.campaign("eu") as first:
        assert values() == {
            ("idemlock.permits.held", "exports"): 1,
            ("idemlock.permits.waiting", "exports"): 1,
            ("idemlock.leader.term", "scheduler"): first.number,
        }
    sem.release(permit)
    waiter.join(60)
    assert not waiter.is_alive()
    with el.campaign("eu") as second:
        assert values()[("idemlock.leader.term", "scheduler")] == second.number > first.number
    assert values() == {
        ("idemlock.permits.held", "exports"): 1,  # the waiter's, never released
        ("idemlock.permits.waiting", "exports"): 0,
        ("idemlock.leader.term", "scheduler"): 0,
    }
    coord.close()
    provider.shutdown()


def test_a_lost_term_leaves_once_when_another_key_has_its_number(lease_url: str) -> None:
    registry = CollectorRegistry()
    coord = _connect(lease_url, hooks=[PrometheusHook(registry=registry)])
    store = coord.store.kind
    el = coord.election(ElectionSpec("zones", ttl=TERM_TTL))

    def term() -> float | None:
        return scrape(registry, "idemlock_leader_term", "zones", store)

    with el.campaign("north") as north:
        with pytest.raises(idemlock.LockLost), el.campaign("south") as south:
            assert term() == max(north.number, south.number)
            # Ended behind the leader's back, as a takeover after expiry would.
            assert coord.store.release(south.lease._ns, "south", south.lease.owner, south.number)
            until(lambda: south.lost, "the leader of south noticed")
            assert term() == north.number
        # Leaving the lost term released it (not_held): that ends nothing more, even
        # where north's term has the same number (tokens count per key).
        assert term() == north.number
    assert term() == 0
    coord.close()
