"""Store failures are visible to the hooks: every store call that raises emits an
Event with outcome "error" and the exception's type name, for claims, completes,
abandons, acquires, releases and renewals (those of ``hold()`` too), sync and async,
and Prometheus/OpenTelemetry show them. The failure is real: another connection
holds the SQLite write lock past the store's busy timeout."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from prometheus_client import CollectorRegistry

import idemlock
import idemlock.aio
from idemlock import Claimed, Event, IdempotencySpec, LockLost, LockSpec, StoreUnavailable
from idemlock.integrations.otel import OpenTelemetryHook
from idemlock.integrations.prometheus import PrometheusHook

from .contract.facade import Facade, Proxy
from .contract.harness import Harness

SPEC = IdempotencySpec("pay", lease=timedelta(seconds=30))
LOCKS = LockSpec("jobs", ttl=timedelta(seconds=30))
SHORT = LockSpec("short", ttl=timedelta(seconds=0.6))


class WriteLock:
    """Another connection holding BEGIN IMMEDIATE: every write of the store fails
    after its busy timeout with StoreUnavailable."""

    def __init__(self, path: Path) -> None:
        self._conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)

    def __enter__(self) -> WriteLock:
        self._conn.execute("BEGIN IMMEDIATE")
        return self

    def __exit__(self, *exc: object) -> None:
        self._conn.execute("ROLLBACK")

    def close(self) -> None:
        self._conn.close()


@pytest.fixture(params=["sync", "async"])
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def db(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "errors.db"


def _facade(db: Path, mode: str, **options: Any) -> Facade:
    url = f"sqlite:///{db}"
    harness = Harness("sqlite", url, idemlock.connect, idemlock.aio.connect)
    connect = idemlock.connect if mode == "sync" else idemlock.aio.connect
    return Facade(harness, connect(url, busy_timeout=0.2, **options), mode)


def errors(events: list[Event]) -> list[tuple[str, str | None]]:
    return [(e.name, e.error) for e in events if e.outcome == "error"]


async def test_every_failed_store_call_emits_an_error_event(db: Path, mode: str) -> None:
    events: list[Event] = []
    api = _facade(db, mode, hooks=[events.append])
    port: Proxy = api.idem(SPEC)
    locks = api.lock(LOCKS)
    claim = await port.claim("running")
    other = await port.claim("other")
    lease = await locks.acquire("held")
    assert isinstance(claim, Claimed) and isinstance(other, Claimed) and lease is not None
    blocker = WriteLock(db)
    try:
        with blocker:
            calls = [
                lambda: port.claim("new"),
                lambda: port.wait("new", timeout=0.05),
                lambda: port.complete(claim.token, "r"),
                lambda: port.abandon(other.token),
                lambda: locks.acquire("free"),
                lambda: locks.acquire("free", wait=0.05),
                lambda: locks.renew(lease),
                lambda: locks.release(lease),
                lambda: api.wrap(SPEC, lambda n: n, key=lambda n: f"w{n}")(1),
            ]
            for call in calls:
                with pytest.raises(StoreUnavailable):
                    await call()
    finally:
        blocker.close()
    assert errors(events) == [
        ("claim", "StoreUnavailable"),
        ("claim", "StoreUnavailable"),
        ("complete", "StoreUnavailable"),
        ("abandon", "StoreUnavailable"),
        ("acquire", "StoreUnavailable"),
        ("acquire", "StoreUnavailable"),
        ("renew", "StoreUnavailable"),
        ("release", "StoreUnavailable"),
        ("claim", "StoreUnavailable"),
    ]
    assert all(e.error is None for e in events if e.outcome != "error")
    # The store is back: the calls go through and the outcomes are ordinary again.
    await port.complete(claim.token, "r")
    assert await locks.release(lease) is True
    await api.close()


async def test_failed_renewals_of_hold_emit_error_events(db: Path, mode: str) -> None:
    events: list[Event] = []
    api = _facade(db, mode, hooks=[events.append])
    locks = api.lock(SHORT)
    blocker = WriteLock(db)
    try:
        with pytest.raises(LockLost):
            async with locks.hold("k", renew_every=0.1) as lease:
                with blocker:
                    waited = time.monotonic() + 10
                    while not lease.lost and time.monotonic() < waited:
                        if mode == "sync":
                            await asyncio.to_thread(time.sleep, 0.02)
                        else:
                            await asyncio.sleep(0.02)  # cancelled when the lease is lost
        # The watchdog's thread sets lease.lost, then delivers the event: wait for it.
        waited = time.monotonic() + 10
        while ("lost", "lost") not in [(e.name, e.outcome) for e in events]:
            assert time.monotonic() < waited, [(e.name, e.outcome) for e in events]
            await asyncio.sleep(0.02)
    finally:
        blocker.close()
        await api.close()
    assert ("renew", "StoreUnavailable") in errors(events)


def test_prometheus_and_otel_show_store_errors(db: Path) -> None:
    registry = CollectorRegistry()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    coord = idemlock.connect(
        f"sqlite:///{db}",
        busy_timeout=0.2,
        hooks=[PrometheusHook(registry=registry), OpenTelemetryHook(provider)],
    )
    port = coord.idempotency(SPEC)
    assert isinstance(port.claim("warm"), Claimed)
    blocker = WriteLock(db)
    try:
        with blocker, pytest.raises(StoreUnavailable):
            port.claim("k")
    finally:
        blocker.close()
    labels = {"spec": "pay", "store": "sqlite", "outcome": "error"}
    assert registry.get_sample_value("idemlock_claims_total", labels) == 1
    (span,) = [
        s
        for s in exporter.get_finished_spans()
        if (s.attributes or {}).get("idemlock.outcome") == "error"
    ]
    assert span.name == "idemlock.claim"
    assert (span.attributes or {})["idemlock.error"] == "StoreUnavailable"
    assert span.status.status_code is StatusCode.ERROR
    coord.close()
    provider.shutdown()
