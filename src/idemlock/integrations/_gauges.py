"""Gauges of what this process holds now, derived from the event stream.

Events carry no key or token (metrics stay private and low-cardinality), so the
gauges count per (spec, store): a claim taken (``claim``/``claimed``) or a lock taken
(``acquire``/``acquired``, ``waited``) counts up; a settling call (``complete``,
``abandon``, ``release``, whatever its outcome, ``error`` included: the process is
done with it) counts down. A ``lost`` event counts down at once, and the settling
call that always follows a loss in ``run()``, ``hold()`` and the decorators is then
not counted again. A ``break`` (an operator's ``break_lock``) changes nothing: the
lock may be held by another process, and a holder in this process finds out by its
own failing renewal (``lost``) and release.

So the gauges are this process's view: claims and locks it took and has not settled.
Another process's holds are not in them; a lease that expires unnoticed (no heartbeat,
never settled) stays counted until the process settles it. A re-acquire by the owner
that already holds the lock counts once more (its reply does not say it was a
re-acquire). Counts never go below zero.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .._core.events import Event

__all__ = ["CLAIMS", "LOCKS", "HeldTally"]

#: the gauge an event moves
CLAIMS = "claims"
LOCKS = "locks"

_TAKEN = {("claim", "claimed"), ("acquire", "acquired"), ("acquire", "waited")}
_SETTLED = {"complete": CLAIMS, "abandon": CLAIMS, "release": LOCKS}


class HeldTally:
    """Counts per (gauge, spec, store); thread-safe (events come from any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str, str], int] = {}
        #: losses whose settling call has not come yet
        self._lost: dict[tuple[str, str, str], int] = {}

    def apply(self, event: Event, publish: Callable[[str, int, int], None]) -> None:
        """Apply one event; if it moves a gauge, call ``publish(gauge, before, after)``
        while still holding the tally's lock, so values reach the backend in order."""
        gauge = _gauge_of(event)
        if gauge is None:
            return
        k = (gauge, event.spec, event.store)
        with self._lock:
            before = self._held.get(k, 0)
            if (event.name, event.outcome) in _TAKEN:
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

    def value(self, gauge: str, spec: str, store: str) -> int:
        with self._lock:
            return self._held.get((gauge, spec, store), 0)


def _gauge_of(event: Event) -> str | None:
    if (event.name, event.outcome) in _TAKEN:
        return CLAIMS if event.name == "claim" else LOCKS
    if event.name == "lost":
        return CLAIMS if event.kind == "idempotency" else LOCKS
    return _SETTLED.get(event.name)
