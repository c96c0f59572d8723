"""One renewer per coordinator: heartbeats for every claim (and lease) it keeps alive.

A worker running 1,000 claims at once must not run 1,000 renewal loops, each with its
own timer and round trip. The renewer keeps every :class:`~idemlock._core.flows.Renewal`
of its coordinator in one heap ordered by when each is due, wakes once for all that
are due, and renews them with one :func:`~idemlock._core.flows.renew_batch_flow`:
one ``renew_many`` call where the store has a batched renewal (one Lua script, one SQL
statement, one SQLite transaction), else one call each. A batch also takes what is due
soon (:func:`~idemlock._core.flows.joins_batch`): where renewals are batched, every
renewal within half its interval of being due, so claims that arrive steadily converge
on a few phases and the round trips per interval stay bounded whatever their number.
The same flow runs under the sync driver (one daemon thread per coordinator) and the
async one (one task per event loop). Whether a claim is lost by time is not decided
here: the coordinator's watchdog fires at each local deadline, whatever a renewal in
progress is doing.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any

from ._core.clock import Clock
from ._core.flows import Renewal, gather_horizon, joins_batch, renew_batch_flow
from ._drive import run_async, run_sync
from ._watchdog import LINGER, _cap

if TYPE_CHECKING:
    import asyncio

__all__ = ["AsyncRenewer", "Renewer"]


def _batched(store: Any) -> bool:
    return bool(store.capabilities.renew_many)


def _live(r: Renewal) -> bool:
    return not (r.done or r.state.lost or r.state.ended)


def _stop_at_limit(r: Renewal, now: float) -> bool:
    """``max_run``: stop renewing; the lease then runs out and the watchdog says why."""
    if r.until is not None and now >= r.until:
        r.state.stopped = r.until_reason
        r.done = True
        return True
    return False


def _take(
    heap: list[tuple[float, int, Renewal]],
    seq: itertools.count[int],
    now: float,
    batched: bool,
    longest: float,
) -> list[Renewal]:
    """Pop from ``heap`` the live renewals a batch sent at ``now`` renews; those popped
    but not taken (due later than their own share of the horizon) go back."""
    horizon = now + gather_horizon(longest, batched)
    due: list[Renewal] = []
    later: list[Renewal] = []
    seen: set[int] = set()
    while heap and heap[0][0] <= horizon:
        at, _, r = heapq.heappop(heap)
        if not _live(r) or id(r) in seen or at != r.next_at:
            continue
        seen.add(id(r))
        (due if joins_batch(r, now, batched) else later).append(r)
    for r in later:
        heapq.heappush(heap, (r.next_at, next(seq), r))
    return due


def _crashed(batch: list[Renewal], exc: BaseException) -> None:
    for r in batch:
        r.done = True
        r.state.lose(f"renewal crashed: {exc!r}")


class Renewer:
    """The sync face: one daemon thread over a heap, started on first use, ended after
    :data:`~idemlock._watchdog.LINGER` seconds with nothing to renew (and after fork)."""

    def __init__(self, store: Any, clock: Clock) -> None:
        self._store = store
        self._clock = clock
        self._cap = _cap(clock)
        self._batched = _batched(store)
        #: the longest renewal interval seen: how far ahead a batch looks
        self._longest = 0.0
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, Renewal]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        #: store round trips made (for benchmarks and tests)
        self.round_trips = 0

    def add(self, r: Renewal) -> None:
        if self._pid != os.getpid():
            self._reset()  # a forked child inherits neither the thread nor the lock
        with self._cond:
            self._longest = max(self._longest, r.every)
            heapq.heappush(self._heap, (r.next_at, next(self._seq), r))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="idemlock-renewer", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def remove(self, r: Renewal) -> None:
        r.done = True  # lazily dropped when it surfaces

    def _due(self) -> list[Renewal] | None:
        """Wait for the next due renewals; None when idle long enough to exit."""
        with self._cond:
            while True:
                heap = self._heap
                while heap and (not _live(heap[0][2]) or heap[0][0] != heap[0][2].next_at):
                    heapq.heappop(heap)
                if not heap:
                    self._cond.wait(LINGER)
                    if not any(_live(r) for _, _, r in self._heap):
                        self._heap.clear()
                        self._thread = None
                        return None
                    continue
                now = self._clock.monotonic()
                at = heap[0][0]
                if now < at:
                    wait = at - now if self._cap is None else min(at - now, self._cap)
                    self._cond.wait(wait)
                    continue
                return _take(heap, self._seq, now, self._batched, self._longest)

    def _run(self) -> None:
        while True:
            due = self._due()
            if due is None:
                return
            now = self._clock.monotonic()
            batch = [r for r in due if not _stop_at_limit(r, now)]
            if batch:
                calls = 1 if self._batched else len(batch)
                try:
                    run_sync(renew_batch_flow(batch, self._batched), self._store, clock=self._clock)
                except BaseException as exc:  # a broken store adapter loses what it renews
                    _crashed(batch, exc)
                self.round_trips += calls
            with self._cond:
                for r in batch:
                    if _live(r):
                        heapq.heappush(self._heap, (r.next_at, next(self._seq), r))
                self._cond.notify()


class _LoopRenewer:
    """The renewer's state on one event loop: a heap and the one task that serves it."""

    def __init__(self, owner: AsyncRenewer) -> None:
        import asyncio  # here: `import idemlock` alone must not load asyncio

        self.owner = owner
        self.heap: list[tuple[float, int, Renewal]] = []
        self.seq = itertools.count()
        self.wake = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    def add(self, r: Renewal) -> None:
        heapq.heappush(self.heap, (r.next_at, next(self.seq), r))
        if self.task is None or self.task.done():
            import asyncio

            self.task = asyncio.get_running_loop().create_task(self.run(), name="idemlock-renewer")
        self.wake.set()

    async def _sleep(self, seconds: float) -> None:
        import asyncio

        self.wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wake.wait(), max(0.0, seconds))

    async def run(self) -> None:
        import asyncio

        owner = self.owner
        clock = owner._clock
        while True:
            heap = self.heap
            while heap and (not _live(heap[0][2]) or heap[0][0] != heap[0][2].next_at):
                heapq.heappop(heap)
            if not heap:
                await self._sleep(LINGER)
                if not any(_live(r) for _, _, r in self.heap):
                    self.heap.clear()
                    self.task = None
                    return
                continue
            now = clock.monotonic()
            at = heap[0][0]
            if now < at:
                await self._sleep(at - now if owner._cap is None else min(at - now, owner._cap))
                continue
            taken = _take(heap, self.seq, now, owner._batched, owner._longest)
            due = [r for r in taken if not _stop_at_limit(r, now)]
            if not due:
                continue
            try:
                await run_async(renew_batch_flow(due, owner._batched), owner._store, clock=clock)
            except asyncio.CancelledError:
                # The loop is shutting down: what it renewed is lost to the watchdog.
                raise
            except BaseException as exc:
                _crashed(due, exc)
            owner.round_trips += 1 if owner._batched else len(due)
            for r in due:
                if _live(r):
                    heapq.heappush(self.heap, (r.next_at, next(self.seq), r))


class AsyncRenewer:
    """The async face: one task per event loop (a coordinator may be used from several
    loops one after the other), all sharing the coordinator's store."""

    def __init__(self, store: Any, clock: Clock) -> None:
        self._store = store
        self._clock = clock
        self._cap = _cap(clock)
        self._batched = _batched(store)
        #: the longest renewal interval seen: how far ahead a batch looks
        self._longest = 0.0
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopRenewer] = (
            weakref.WeakKeyDictionary()
        )
        #: store round trips made (for benchmarks and tests)
        self.round_trips = 0

    def add(self, r: Renewal) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        self._longest = max(self._longest, r.every)
        state = self._loops.get(loop)
        if state is None:
            state = self._loops[loop] = _LoopRenewer(self)
        state.add(r)

    def remove(self, r: Renewal) -> None:
        r.done = True
