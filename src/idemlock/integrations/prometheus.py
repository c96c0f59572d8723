"""Prometheus metrics for idemlock, built on the event hook (``prometheus-client``).

::

    import idemlock
    from idemlock.integrations.prometheus import PrometheusHook

    coord = idemlock.connect()
    coord.add_hook(PrometheusHook())            # or PrometheusHook(registry=my_registry)

Metrics (labels are the spec name, the store kind and the outcome; never the key,
the payload, the owner or the tenant, which are unbounded and may be private):

==========================================  =========================================
``idemlock_claims_total``                   claims by ``outcome``: claimed, in_flight,
                                            replayed, mismatch, error
``idemlock_completions_total``              ``complete`` calls by ``outcome``: ok, stale,
                                            error
``idemlock_abandons_total``                 ``abandon`` calls by ``outcome``: ok, stale,
                                            error
``idemlock_lock_acquisitions_total``        by ``outcome``: acquired, waited, timeout,
                                            error
``idemlock_lock_releases_total``            by ``outcome``: ok, not_held, error
``idemlock_renewals_total``                 lease renewals by ``outcome``: ok, failed,
                                            error
``idemlock_leases_lost_total``              leases lost while held (``hold()``)
``idemlock_lock_breaks_total``              ``break_lock`` calls by ``outcome``: broken,
                                            not_held, error
``idemlock_claims_in_flight``               gauge: claims this process took and has not
                                            completed or abandoned yet
``idemlock_locks_held``                     gauge: locks this process acquired and has
                                            not released (nor lost) yet
``idemlock_permits_held``                   gauge: semaphore permits this process
                                            acquired and has not released (nor lost)
                                            yet
``idemlock_permits_waiting``                gauge: semaphore acquires of this process
                                            waiting for a permit now
``idemlock_leader_term``                    gauge: the term number this process leads
                                            (the highest, if it leads several keys of
                                            the spec); 0 when it leads none
``idemlock_operation_duration_seconds``     histogram by ``operation`` (claim, complete,
                                            abandon, acquire, release, renew,
                                            break); an
                                            ``acquire`` includes its wait
==========================================  =========================================

Outcome ``error`` counts store calls that raised (the store down or past its
timeout), so an outage shows as a rising ``error`` rate rather than silence. Every
metric has the ``spec`` and ``store`` labels (``store`` is the store kind:
memory, sqlite, redis, postgres). The metrics are registered once per registry, so
several coordinators (or tenant views) can each add a ``PrometheusHook`` on the same
registry.

The gauges are **this process's view**, derived from its own events (see
:mod:`idemlock.integrations._gauges`): a claim, lock or permit held by another process
is not in them, so sum them over your processes (``sum by (spec)``) for the whole
picture, and take ``max by (spec)`` of ``idemlock_leader_term`` for the current term.
They are labelled by spec and store, never by key, as every metric here. A lost claim
or lease leaves the gauge when the loss is detected; one that expires unnoticed (no
heartbeat, never completed, abandoned or released) stays counted. Hooks sharing a
registry count every event once each, as the counters do.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from .._core.events import Event
from ._gauges import CLAIMS, LEADER_TERM, LOCKS, PERMITS, PERMITS_WAITING, HeldTally

__all__ = ["DEFAULT_BUCKETS", "PrometheusHook"]

#: from 100 µs (an in-memory claim) to 30 s (a long acquire wait)
DEFAULT_BUCKETS: tuple[float, ...] = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip

#: event name -> (metric attribute, help text)
_COUNTERS: dict[str, tuple[str, str]] = {
    "claim": ("idemlock_claims_total", "Idempotency claims by outcome."),
    "complete": ("idemlock_completions_total", "Completed idempotency claims by outcome."),
    "abandon": ("idemlock_abandons_total", "Abandoned idempotency claims by outcome."),
    "acquire": ("idemlock_lock_acquisitions_total", "Lock acquisitions by outcome."),
    "release": ("idemlock_lock_releases_total", "Lock releases by outcome."),
    "renew": ("idemlock_renewals_total", "Lease renewals by outcome."),
    "break": ("idemlock_lock_breaks_total", "Locks broken (break_lock) by outcome."),
    "step": ("idemlock_steps_total", "Steps inside idempotent operations by outcome."),
}


class _Metrics:
    def __init__(self, registry: CollectorRegistry, buckets: Sequence[float]) -> None:
        labels = ("spec", "store", "outcome")
        self.counters = {
            event: Counter(name, doc, labels, registry=registry)
            for event, (name, doc) in _COUNTERS.items()
        }
        self.lost = Counter(
            "idemlock_leases_lost_total",
            "Leases lost while held (renewal failed or came too late).",
            ("spec", "store"),
            registry=registry,
        )
        self.duration = Histogram(
            "idemlock_operation_duration_seconds",
            "Duration of idemlock operations, waits included.",
            ("operation", "spec", "store"),
            registry=registry,
            buckets=tuple(buckets),
        )
        self.held = {
            CLAIMS: Gauge(
                "idemlock_claims_in_flight",
                "Claims this process took and has not completed or abandoned yet.",
                ("spec", "store"),
                registry=registry,
            ),
            LOCKS: Gauge(
                "idemlock_locks_held",
                "Locks this process acquired and has not released (nor lost) yet.",
                ("spec", "store"),
                registry=registry,
            ),
            PERMITS: Gauge(
                "idemlock_permits_held",
                "Semaphore permits this process acquired and has not released (nor lost) yet.",
                ("spec", "store"),
                registry=registry,
            ),
            PERMITS_WAITING: Gauge(
                "idemlock_permits_waiting",
                "Semaphore acquires of this process waiting for a permit now.",
                ("spec", "store"),
                registry=registry,
            ),
            LEADER_TERM: Gauge(
                "idemlock_leader_term",
                "The term number this process leads (the highest of its keys), 0 if none.",
                ("spec", "store"),
                registry=registry,
            ),
        }
        #: shared by every hook on the registry, like the metrics themselves
        self.tally = HeldTally()


_by_registry: weakref.WeakKeyDictionary[CollectorRegistry, _Metrics] = weakref.WeakKeyDictionary()
_registering = threading.Lock()


def _metrics(registry: CollectorRegistry, buckets: Sequence[float]) -> _Metrics:
    # prometheus_client refuses a second metric of one name in a registry: share them.
    with _registering:
        metrics = _by_registry.get(registry)
        if metrics is None:
            metrics = _by_registry[registry] = _Metrics(registry, buckets)
        return metrics


class PrometheusHook:
    """An event hook that records idemlock's outcomes as Prometheus metrics.

    ``registry`` defaults to prometheus_client's global ``REGISTRY``; ``buckets``
    (used when the registry gets its metrics, i.e. by the first hook on it) are the
    histogram's, in seconds.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        buckets: Sequence[float] = DEFAULT_BUCKETS,
    ) -> None:
        self.registry = REGISTRY if registry is None else registry
        self._metrics = _metrics(self.registry, buckets)
        # (name, outcome, spec, store) -> bound children: labels() is resolved once per
        # combination, not on every event (it locks and hashes every label).
        self._record: dict[tuple[str, str, str, str], Callable[[float], None]] = {}

    def __call__(self, event: Event) -> None:
        combo = (event.name, event.outcome, event.spec, event.store)
        record = self._record.get(combo)
        if record is None:
            record = self._record[combo] = self._bind(*combo)
        record(event.duration)
        held = self._metrics.held
        self._metrics.tally.apply(
            event, lambda gauge, _, value: held[gauge].labels(event.spec, event.store).set(value)
        )

    def _bind(self, name: str, outcome: str, spec: str, store: str) -> Callable[[float], None]:
        m = self._metrics
        if name == "lost":
            lost = m.lost.labels(spec, store)
            return lambda _duration: lost.inc()
        counter = m.counters.get(name)
        if counter is None:  # an event this version does not know: ignore, never fail
            return lambda _duration: None
        count = counter.labels(spec, store, outcome)
        observe = m.duration.labels(name, spec, store).observe

        def record(duration: float) -> None:
            count.inc()
            observe(duration)

        return record
