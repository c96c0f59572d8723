"""Gauges of what this process holds now, derived from the event stream.

Events carry no key (metrics stay private and low-cardinality), so the gauges count per
(spec, store), one gauge per kind of port: claims (``idempotency``), locks (``lock``),
permits (``semaphore``) and the leader's term (``election``).

Claims, locks and permits: a claim taken (``claim``/``claimed``) or a lease taken
(``acquire``/``acquired``, ``waited``) counts up; a settling call (``complete``,
``abandon``, ``release``, whatever its outcome, ``error`` included: the process is
done with it) counts down. A ``lost`` event counts down at once, and the settling
call that always follows a loss in ``run()``, ``hold()`` and the decorators is then
not counted again. A ``break`` (an operator's ``break_lock``) changes nothing: the
lock may be held by another process, and a holder in this process finds out by its
own failing renewal (``lost``) and release.

Permits waiting: ``wait``/``started`` (a semaphore acquire's first attempt was refused
and it waits) counts up, ``wait``/``ended`` (the acquire is over: granted, timed out,
failed or cancelled) counts down.

Leader term: the terms (the events' ``token``) this process leads per (spec, store);
the gauge is the highest of them, 0 when it leads none. A term joins on its
``acquire`` and leaves on its ``release`` (any outcome) or ``lost``, whichever comes
first.

So the gauges are this process's view: claims, leases and waits it took and has not
settled. Another process's holds are not in them; a lease that expires unnoticed (no
heartbeat, never settled) stays counted until the process settles it. A re-acquire
by the owner that already holds the lease counts once more (its reply does not say it
was a re-acquire). Counts never go below zero.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .._core.events import Event

__all__ = ["CLAIMS", "LEADER_TERM", "LOCKS", "PERMITS", "PERMITS_WAITING", "HeldTally"]

#: the gauge an event moves
CLAIMS = "claims"
LOCKS = "locks"
PERMITS = "permits"
PERMITS_WAITING = "permits_waiting"
LEADER_TERM = "leader_term"

_TAKEN = {("claim", "claimed"), ("acquire", "acquired"), ("acquire", "waited")}
_SETTLING = {"complete", "abandon", "release"}
#: the gauge of what a port of each kind holds
_HELD = {"idempotency": CLAIMS, "lock": LOCKS, "semaphore": PERMITS, "election": LEADER_TERM}


class HeldTally:
    """Counts per (gauge, spec, store); thread-safe (events come from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str, str], int] = {}
        #: losses whose settling call has not come yet
        self._lost: dict[tuple[str, str, str], int] = {}
        #: the terms led now, per (spec, store): a term may repeat (a re-acquire)
        self._terms: dict[tuple[str, str], list[int]] = {}

    def apply(self, event: Event, publish: Callable[[str, int, int], None]) -> None:
        """Apply one event; if it moves a gauge, call ``publish(gauge, before, after)``
        while still holding the tally's lock, so values reach the backend in order."""
        gauge = _gauge_of(event)
        if gauge is None:
            return
        k = (gauge, event.spec, event.store)
        with self._lock:
            before = self._held.get(k, 0)
            if gauge == LEADER_TERM:
                after = self._term(event)
            elif gauge == PERMITS_WAITING:
                after = before + 1 if event.outcome == "started" else max(0, before - 1)
            elif (event.name, event.outcome) in _TAKEN:
                after = before + 1
            elif event.name == "lost":
                after = max(0, before - 1)
                self._lost[k] = self._lost.get(k, 0) + 1
            elif self._lost.get(k, 0):
                self._lost[k] -= 1  # the loss already counted this one down
                after = before
            else:
                after = max(0, before - 1)
            self._held[k] = after
            publish(gauge, before, after)

    def _term(self, event: Event) -> int:
        """The leader-term gauge after ``event`` (called under the lock)."""
        terms = self._terms.setdefault((event.spec, event.store), [])
        if event.token is not None:
            if event.name == "acquire":
                terms.append(event.token)
            elif event.token in terms:  # a release or loss: gone once, whichever is first
                terms.remove(event.token)
        return max(terms, default=0)

    def value(self, gauge: str, spec: str, store: str) -> int:
        with self._lock:
            return self._held.get((gauge, spec, store), 0)


def _gauge_of(event: Event) -> str | None:
    if event.name == "wait":
        return PERMITS_WAITING if event.kind == "semaphore" else None
    if (event.name, event.outcome) in _TAKEN or event.name == "lost" or event.name in _SETTLING:
        return _HELD.get(event.kind)
    return None
