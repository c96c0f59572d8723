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
store kind), ``idemlock.outcome`` and ``idemlock.kind`` (``idempotency`` or ``lock``);
never the key, the payload, the owner or the tenant. Outcomes that mean something
went wrong (``stale``, ``mismatch``, ``failed``, ``lost``, ``error``) set the span's
status to ERROR; a store call that raised (outcome ``error``) also carries
``idemlock.error``, the exception's type name (``StoreUnavailable``).

Without an SDK configured the API's tracer is a no-op, so the hook costs little.
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer, TracerProvider

from .._core.events import Event

__all__ = ["ERROR_OUTCOMES", "OpenTelemetryHook"]

#: outcomes recorded with an ERROR span status
ERROR_OUTCOMES = frozenset({"stale", "mismatch", "failed", "lost", "error"})


class OpenTelemetryHook:
    """An event hook that records every idemlock outcome as a span.

    ``tracer_provider`` defaults to the global one (``trace.set_tracer_provider``);
    or pass a ``tracer`` directly.
    """

    def __init__(
        self, tracer_provider: TracerProvider | None = None, *, tracer: Tracer | None = None
    ) -> None:
        if tracer is None:
            from .. import __version__

            tracer = trace.get_tracer("idemlock", __version__, tracer_provider=tracer_provider)
        self.tracer = tracer

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
