"""OpenTelemetry spans for idemlock, built on the event hook (``opentelemetry-api``).

::

    import idemlock
    from idemlock.integrations.otel import OpenTelemetryHook

    coord = idemlock.connect()
    coord.add_hook(OpenTelemetryHook())     # uses the global tracer provider

Every event becomes one span, ended when the event is reported and started
``duration`` earlier, as a child of the span current at that moment (the Celery
task's or the HTTP request's, when those are traced). Span names are
``idemlock.<event>`` (``idemlock.claim``, ``idemlock.complete``, ``idemlock.acquire``,
...), of kind INTERNAL, with the attributes ``idemlock.spec``, ``idemlock.store`` (the
store kind), ``idemlock.outcome`` and ``idemlock.kind`` (``idempotency``, ``lock``,
``semaphore`` or ``election``);
never the key, the payload, the owner or the tenant. Outcomes that mean something
went wrong (``stale``, ``mismatch``, ``failed``, ``lost``, ``error``) set the span's
status to ERROR; a store call that raised (outcome ``error``) also carries
``idemlock.error``, the exception's type name (``StoreUnavailable``).

Up-down counters (OpenTelemetry's gauges of a count) with the attributes
``idemlock.spec`` and ``idemlock.store`` (never the key): ``idemlock.claims.in_flight``,
the claims this process took and has not completed or abandoned yet;
``idemlock.locks.held`` and ``idemlock.permits.held``, the locks and semaphore permits
it acquired and has not released (nor lost) yet; ``idemlock.permits.waiting``, its
semaphore acquires waiting for a permit now; and ``idemlock.leader.term``, the term
number it leads (the highest, if it leads several keys of the spec; 0 when none).
They are this process's view, derived from its own events (see
:mod:`idemlock.integrations._gauges`): sum them over your processes for the whole
picture (the maximum, for the term).

Without an SDK configured the API's tracer and meter are no-ops, so the hook costs
little.
"""

from __future__ import annotations

import time

from opentelemetry import metrics, trace
from opentelemetry.metrics import Meter, MeterProvider
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer, TracerProvider

from .._core.events import Event
from ._gauges import CLAIMS, LEADER_TERM, LOCKS, PERMITS, PERMITS_WAITING, HeldTally

__all__ = ["ERROR_OUTCOMES", "OpenTelemetryHook"]

#: outcomes recorded with an ERROR span status
ERROR_OUTCOMES = frozenset({"stale", "mismatch", "failed", "lost", "error"})


class OpenTelemetryHook:
    """An event hook that records every idemlock outcome as a span.

    ``tracer_provider`` defaults to the global one (``trace.set_tracer_provider``);
    or pass a ``tracer`` directly. Likewise ``meter_provider`` (default: the global
    one, ``metrics.set_meter_provider``) or ``meter``, for the gauges.
    """

    def __init__(
        self,
        tracer_provider: TracerProvider | None = None,
        *,
        tracer: Tracer | None = None,
        meter_provider: MeterProvider | None = None,
        meter: Meter | None = None,
    ) -> None:
        from .. import __version__

        if tracer is None:
            tracer = trace.get_tracer("idemlock", __version__, tracer_provider=tracer_provider)
        self.tracer = tracer
        if meter is None:
            meter = metrics.get_meter("idemlock", __version__, meter_provider=meter_provider)
        self.meter = meter
        self._held = {
            CLAIMS: meter.create_up_down_counter(
                "idemlock.claims.in_flight",
                unit="{claim}",
                description="Claims this process took and has not completed or abandoned yet.",
            ),
            LOCKS: meter.create_up_down_counter(
                "idemlock.locks.held",
                unit="{lock}",
                description="Locks this process acquired and has not released (nor lost) yet.",
            ),
            PERMITS: meter.create_up_down_counter(
                "idemlock.permits.held",
                unit="{permit}",
                description=(
                    "Semaphore permits this process acquired and has not released (nor lost) yet."
                ),
            ),
            PERMITS_WAITING: meter.create_up_down_counter(
                "idemlock.permits.waiting",
                unit="{acquire}",
                description="Semaphore acquires of this process waiting for a permit now.",
            ),
            # A term number, not a count: each change adds the difference, so the sum
            # is the term (a synchronous gauge needs opentelemetry-api 1.23).
            LEADER_TERM: meter.create_up_down_counter(
                "idemlock.leader.term",
                unit="{term}",
                description=(
                    "The term number this process leads (the highest of its keys), 0 if none."
                ),
            ),
        }
        self._tally = HeldTally()

    def __call__(self, event: Event) -> None:
        end = time.time_ns()
        span = self.tracer.start_span(
            f"idemlock.{event.name}",
            kind=SpanKind.INTERNAL,
            start_time=end - max(0, int(event.duration * 1e9)),
            attributes={
                "idemlock.spec": event.spec,
                "idemlock.store": event.store,
                "idemlock.outcome": event.outcome,
                "idemlock.kind": event.kind,
            },
        )
        if event.error is not None:
            span.set_attribute("idemlock.error", event.error)
        if event.outcome in ERROR_OUTCOMES:
            detail = event.outcome if event.error is None else f"{event.outcome} ({event.error})"
            span.set_status(Status(StatusCode.ERROR, f"{event.name}: {detail}"))
        span.end(end_time=end)
        attributes = {"idemlock.spec": event.spec, "idemlock.store": event.store}

        def publish(gauge: str, before: int, after: int) -> None:
            if after != before:
                self._held[gauge].add(after - before, attributes)

        self._tally.apply(event, publish)
