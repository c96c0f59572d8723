"""Gauges of what this process holds now, derived from the event stream.

Events carry no key (metrics stay private and low-cardinality), so the gauges count per
(spec, store), one gauge per kind of port: claims (``idempotency``), locks (``lock``),
permits (``semaphore``) and the leader's term (``election``).

Claims: a claim taken (``claim``/``claimed``) counts up; a settling call (``complete``,
``abandon``, whatever its outcome, ``error`` included: the process is done with it)
counts down. A ``lost`` event counts down at once, and the settling call that always
follows a loss in ``run()`` and the decorators is then not counted again.

Locks, permits and terms: the leases this process holds are the tokens (the events'
``token``) of the ``acquire`` events that granted one (``acquired``, ``waited``); a
lease leaves on its ``release`` (whatever the outcome, ``error`` included) or at once
on its ``lost``, and the release that always follows a loss in ``hold()`` and
``campaign()`` is then not counted again. Tokens increase per key, so two keys of a
spec may hold the same one: they are counted apart (a multiset). Locks and permits are
counted; the leader term is the highest term held (several keys of one spec), 0 when
none. A release of a lease acquired before the hook was added changes nothing. A
``break`` (an operator's ``break_lock``) changes nothing: the lease may be another
process's, and a holder in this process finds out by its own failing renewal
(``lost``) and release.

Permits waiting: ``wait``/``started`` (a semaphore acquire's first attempt was refused
and it waits) counts up, ``wait``/``ended`` (the acquire is over: granted, timed out,
failed or cancelled) counts down.

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
#: the gauges of leases, followed by their tokens
_LEASES = (LOCKS, PERMITS, LEADER_TERM)


class HeldTally:
    """Counts per (gauge, spec, store); thread-safe (events come from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str, str], int] = {}
        #: claim losses whose settling call has not come yet
        self._lost: dict[tuple[str, str, str], int] = {}
        #: the tokens of the leases held now, per (gauge, spec, store); a token repeats
        #: when two keys have it, or an owner re-acquired the lease it held
        self._leases: dict[tuple[str, str, str], list[int]] = {}
        #: the tokens of lost leases whose release has not come yet
        self._gone: dict[tuple[str, str, str], list[int]] = {}

    def apply(self, event: Event, publish: Callable[[str, int, int], None]) -> None:
        """Apply one event; if it moves a gauge, call ``publish(gauge, before, after)``
        while still holding the tally's lock, so values reach the backend in order."""
        gauge = _gauge_of(event)
        if gauge is None:
            return
        k = (gauge, event.spec, event.store)
        with self._lock:
            before = self._held.get(k, 0)
            if gauge in _LEASES:
                after = self._lease(k, event)
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

    def _lease(self, k: tuple[str, str, str], event: Event) -> int:
        """A lease gauge after ``event`` (called under the lock)."""
        tokens = self._leases.setdefault(k, [])
        gone = self._gone.setdefault(k, [])
        token = event.token
        if token is None:
            pass
        elif (event.name, event.outcome) in _TAKEN:
            tokens.append(token)
        elif event.name != "lost" and token in gone:
            gone.remove(token)  # the release after a loss: the loss counted it down
        elif token in tokens:
            tokens.remove(token)
            if event.name == "lost":
                gone.append(token)
        return max(tokens, default=0) if k[0] == LEADER_TERM else len(tokens)

    def value(self, gauge: str, spec: str, store: str) -> int:
        with self._lock:
            return self._held.get((gauge, spec, store), 0)


def _gauge_of(event: Event) -> str | None:
    if event.name == "wait":
        return PERMITS_WAITING if event.kind == "semaphore" else None
    if (event.name, event.outcome) in _TAKEN or event.name == "lost" or event.name in _SETTLING:
        return _HELD.get(event.kind)
    return None
