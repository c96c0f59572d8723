"""One timer per coordinator for everything it holds with a local deadline.

A lease held by ``hold()`` is lost when its *local* deadline passes (counted from
when the acquire or the last confirmed renewal was sent), whatever a renewal in
progress is doing: a network that drops packets never answers, so the renewal's reply
cannot be what decides. The watchdog calls each entry's ``fire`` once its deadline
has passed; the owner of the entry moves the deadline after each confirmed renewal.

It is a registry of deadlines, not a lease manager, so that everything a coordinator
holds (leases in ``hold()``, claims kept alive by heartbeats) shares one timer; the
renewals themselves are the coordinator's renewer's (:mod:`idemlock._renewer`). The
sync face runs one daemon thread over a heap, the async face schedules
``loop.call_at`` on the holder's loop. Deadlines are read on the coordinator's clock;
when that is not the machine's clock (a ``ManualClock`` in tests) the timer re-checks
every :data:`POLL` seconds.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ._clock import SystemClock
from ._core.clock import Clock
from ._logfields import fields

if TYPE_CHECKING:
    import asyncio

__all__ = ["AsyncWatchdog", "Entry", "Watchdog"]

log = logging.getLogger("idemlock")

#: how often a deadline is re-checked on a clock that is not the machine's
POLL = 0.01
#: how long an idle timer thread waits for new entries before it exits
LINGER = 1.0


class Entry:
    """One thing held with a local deadline (monotonic seconds on the clock)."""

    __slots__ = ("active", "at", "fire", "handle", "loop")

    def __init__(self, at: float, fire: Callable[[], None]) -> None:
        self.at = at
        self.fire = fire
        self.active = True
        self.handle: asyncio.TimerHandle | None = None
        self.loop: asyncio.AbstractEventLoop | None = None


def _fire(entry: Entry) -> None:
    try:
        entry.fire()
    except Exception:
        # One broken callback must not stop the timer for everything else it watches.
        log.warning(
            "idemlock watchdog callback %r failed",
            entry.fire,
            exc_info=True,
            extra=fields(operation="watchdog", outcome="error"),
        )


def _cap(clock: Clock) -> float | None:
    return None if isinstance(clock, SystemClock) else POLL


class Watchdog:
    """The sync timer: one daemon thread per coordinator, started on first use and
    ended after :data:`LINGER` seconds with nothing to watch (and after ``fork``)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._cap = _cap(clock)
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, Entry]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def watch(self, at: float, fire: Callable[[], None]) -> Entry:
        """Call ``fire()`` (on the timer thread) once ``clock.monotonic() >= at``."""
        if self._pid != os.getpid():
            # A forked child inherits neither the thread nor a usable lock.
            self._reset()
        entry = Entry(at, fire)
        with self._cond:
            heapq.heappush(self._heap, (at, next(self._seq), entry))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="idemlock-watchdog", daemon=True
                )
                self._thread.start()
            self._cond.notify()
        return entry

    def move(self, entry: Entry, at: float) -> None:
        """Set a new deadline (after a confirmed renewal)."""
        with self._cond:
            if not entry.active:
                return
            entry.at = at
            # The old heap item stays and is skipped when it surfaces (lazy deletion).
            heapq.heappush(self._heap, (at, next(self._seq), entry))
            self._cond.notify()

    def cancel(self, entry: Entry) -> None:
        with self._cond:
            entry.active = False

    def _run(self) -> None:
        while True:
            due: list[Entry] = []
            with self._cond:
                while True:
                    heap = self._heap
                    while heap and (not heap[0][2].active or heap[0][2].at != heap[0][0]):
                        heapq.heappop(heap)
                    if not heap:
                        if due:
                            break
                        self._cond.wait(LINGER)
                        if not any(e.active for _, _, e in self._heap):
                            self._heap.clear()
                            self._thread = None
                            return
                        continue
                    at, _, entry = heap[0]
                    now = self._clock.monotonic()
                    if now >= at:
                        heapq.heappop(heap)
                        entry.active = False
                        due.append(entry)
                        continue
                    if due:
                        break
                    wait = at - now if self._cap is None else min(at - now, self._cap)
                    self._cond.wait(wait)
            # Callbacks run outside the lock: they may move or add entries.
            for entry in due:
                _fire(entry)


class AsyncWatchdog:
    """The async timer: each entry is a ``call_at`` on the loop that was running when
    it was added; the registry holds every active entry."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._cap = _cap(clock)
        self._entries: set[Entry] = set()

    def watch(self, at: float, fire: Callable[[], None]) -> Entry:
        """Call ``fire()`` (on the current loop) once ``clock.monotonic() >= at``."""
        import asyncio  # here: `import idemlock` alone must not load asyncio

        entry = Entry(at, fire)
        entry.loop = asyncio.get_running_loop()
        self._entries.add(entry)
        self._schedule(entry)
        return entry

    def move(self, entry: Entry, at: float) -> None:
        if not entry.active:
            return
        entry.at = at
        if entry.handle is not None:
            entry.handle.cancel()
        self._schedule(entry)

    def cancel(self, entry: Entry) -> None:
        entry.active = False
        self._entries.discard(entry)
        if entry.handle is not None:
            entry.handle.cancel()
            entry.handle = None

    def _schedule(self, entry: Entry) -> None:
        loop = entry.loop
        assert loop is not None
        delay = max(0.0, entry.at - self._clock.monotonic())
        if self._cap is not None:
            delay = min(delay, self._cap)
        entry.handle = loop.call_at(loop.time() + delay, self._check, entry)

    def _check(self, entry: Entry) -> None:
        if not entry.active:
            return
        if self._clock.monotonic() < entry.at:
            # Early (timer resolution) or a clock that is not the loop's: look again.
            self._schedule(entry)
            return
        entry.active = False
        entry.handle = None
        self._entries.discard(entry)
        _fire(entry)
