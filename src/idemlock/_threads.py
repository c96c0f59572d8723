"""What the blocking API does its own way, with threads: the decorator for plain and
``async def`` functions, ``run()`` and ``hold()`` reporting a lost claim or lease on
threads of their own, and leaving a hold within the store's bound.

The generated :mod:`idemlock._sync` takes these from here, where :mod:`idemlock.aio`
(its source) takes them from :mod:`idemlock._tasks`.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ._context import enter_claim, leave_claim
from ._core.flows import Renewal, RenewState
from ._core.types import Claim, Claimed, ClaimToken, Completed, Lease
from ._decorator import WrapPlan, heartbeat_options
from ._durations import seconds
from ._errors import InFlightError, LockLost, LockNotAcquired, StaleClaim
from ._logfields import port_fields
from ._ports import Attempt, IdempotencyBase, LockBase
from ._watchdog import Watchdog

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("idemlock")


def decorator(
    port: Any,
    key: Callable[..., str] | None,
    replay_errors: tuple[type[BaseException], ...],
    wait_s: float | None,
    every: float | None,
    limit: float | None,
    on_lost: Callable[[ClaimToken], object] | None,
) -> Callable[[F], F]:
    """``Coordinator.idempotent``'s decorator: plain functions, and ``async def`` ones
    with the store called from worker threads."""

    def decorate(fn: F) -> F:
        plan = WrapPlan(fn, key, replay_errors)
        if inspect.iscoroutinefunction(fn):
            # Only here: `import idemlock` alone must not load asyncio.
            from ._tasks import coroutine_wrapper

            wrapped = coroutine_wrapper(fn, plan, port, wait_s, every, limit, on_lost, threads=True)
            return cast(F, wrapped)

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            claim, sent = port._begin_at(plan, args, kwargs, wait_s)
            if isinstance(claim, Completed):
                return plan.replay(claim)
            token = claim.token
            hb = None if every is None else port._heartbeat(token, sent, every, limit, on_lost)
            mark = enter_claim(token)
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                if hb is not None:
                    hb.stop()
                port._fail(plan, token, exc)
                raise
            finally:
                leave_claim(mark)
            if hb is not None:
                hb.stop()
            port._record_beat(plan, token, result, hb)
            return result

        return cast(F, wrapper)

    return decorate


class IdempotencyRun(IdempotencyBase):
    """``run()`` of :class:`~idemlock.IdempotencyPort`."""

    if TYPE_CHECKING:

        def _claim_at(self, key: str, payload: Any, wait: float | None) -> tuple[Claim, float]: ...

        def complete(self, token: ClaimToken, result: Any) -> None: ...

        def _abandon_quietly(self, token: ClaimToken) -> None: ...

    @contextmanager
    def run(
        self,
        key: str,
        *,
        payload: Any = None,
        wait: timedelta | float | None = None,
        heartbeat: bool = True,
        renew_every: timedelta | float | None = None,
        max_run: timedelta | float | None = None,
        on_lost: Callable[[ClaimToken], object] | None = None,
    ) -> Iterator[Attempt]:
        """Claim or replay ``key`` for a block, for code that does not fit a decorator::

            with port.run("order-7", payload=order) as attempt:
                if not attempt.replayed:
                    attempt.result = charge(order, fence=attempt.fence)
            use(attempt.result)

        A key completed already gives ``attempt.replayed`` (its ``result`` is the
        recorded one). A key in flight elsewhere raises ``InFlightError``, or with
        ``wait`` waits that long for it to complete or be freed. Otherwise the claim is
        renewed while the block runs (heartbeats, as in ``Coordinator.idempotent``:
        ``renew_every``, ``max_run``, ``on_lost``, ``heartbeat=False``), leaving the
        block records ``attempt.result``, and an exception abandons the claim (a retry
        runs again). A claim lost while the block ran (another attempt took the key
        over) raises ``ClaimLost`` on exit, recording nothing."""
        every, limit = heartbeat_options(self, heartbeat, renew_every, max_run, on_lost)
        wait_s = None if wait is None else self._wait_for(wait)
        claim, sent = self._claim_at(key, payload, wait_s)
        if isinstance(claim, Completed):
            yield Attempt(key, None, claim.result)
            return
        if not isinstance(claim, Claimed):
            raise InFlightError(key, claim.expires_at)
        token = claim.token
        hb = None if every is None else self._heartbeat(token, sent, every, limit, on_lost)
        attempt = Attempt(key, token)
        mark = enter_claim(token)
        try:
            yield attempt
        except BaseException:
            if hb is not None:
                hb.stop()
            self._abandon_quietly(token)
            raise
        finally:
            leave_claim(mark)
        if hb is not None:
            hb.stop()
        try:
            self.complete(token, attempt.result)
        except StaleClaim:
            if hb is None:
                raise
            raise self._lost_claim(token, hb.reason) from None

    def _expire_callback(self, state: RenewState) -> Callable[[], None]:
        def expire() -> None:
            # On the watchdog's thread: mark at once, report on a thread of its own so
            # a slow on_lost never delays the deadlines of other claims.
            if state.mark_lost(state.expired_reason()):
                threading.Thread(
                    target=state.report_lost, name="idemlock-claim-lost", daemon=True
                ).start()

        return expire


class LockHold(LockBase):
    """``hold()`` of :class:`~idemlock.LockPort`."""

    if TYPE_CHECKING:

        def acquire(
            self, key: str, *, owner: str | None = None, wait: timedelta | float | None = None
        ) -> Lease | None: ...

        def release(self, lease: Lease) -> bool: ...

    @contextmanager
    def hold(
        self,
        key: str,
        *,
        wait: timedelta | float | None = None,
        renew_every: timedelta | float | None = None,
        max_hold: timedelta | float | None = None,
        owner: str | None = None,
        on_lost: Callable[[Lease], object] | None = None,
    ) -> Iterator[Lease]:
        """Hold the lock for a block, renewing it in the background.

        Raises ``LockNotAcquired`` if it cannot be taken within ``wait``. The lease is
        lost when ``lease.remaining()`` reaches zero without a confirmed renewal (a
        local timer decides, whatever a renewal in progress is doing) or when the store
        says it is gone: ``lease.lost`` turns True, ``on_lost(lease)`` runs (on an
        idemlock thread; an exception it raises is logged), and leaving the block
        raises ``LockLost`` unless the body already raised. Leaving waits at most the
        store's ``timeout`` for the store."""
        every = self._renew_every(renew_every)
        max_hold_s = seconds(max_hold, "max_hold")
        lease = self.acquire(key, owner=owner, wait=wait)
        if lease is None:
            raise LockNotAcquired(self._not_acquired(key, wait))
        state = self._renew_state(lease, on_lost)
        reporters: list[threading.Thread] = []

        def expire() -> None:
            # On the watchdog's thread: mark at once, report on a thread of its own so
            # a slow on_lost never delays the deadlines of other leases.
            if state.mark_lost(state.expired_reason()):
                reporter = threading.Thread(
                    target=state.report_lost, name=f"idemlock-lost-{key}", daemon=True
                )
                # Started before it is listed: _leave() may join it at once.
                reporter.start()
                reporters.append(reporter)

        watchdog: Watchdog = self._coord._watchdog
        entry = watchdog.watch(state.deadline(), expire)
        state.moved = lambda at: watchdog.move(entry, at)
        # Renewed by the coordinator's one renewer, with every claim and lease it keeps.
        renewal = self._renewal(lease, every, max_hold_s, state)
        self._coord._renewer.add(renewal)
        try:
            yield lease
        except BaseException:
            self._leave(state, entry, renewal, reporters)
            raise
        if self._leave(state, entry, renewal, reporters):
            raise LockLost(self._lost_message(lease, state.reason))

    def _leave(
        self,
        state: RenewState,
        entry: Any,
        renewal: Renewal,
        reporters: list[threading.Thread],
    ) -> bool:
        """End a hold: stop renewing, release, and return whether the lease was lost.
        Waits at most the store's bound for the release (a store gone silent)."""
        lost = state.end(self._coord.clock.monotonic())
        self._coord._renewer.remove(renewal)
        self._coord._watchdog.cancel(entry)
        lease = state.lease
        assert lease is not None
        bound = self._bound()
        until = time.monotonic() + bound
        releaser = threading.Thread(
            target=self._release_quietly,
            args=(lease,),
            name=f"idemlock-release-{lease.key}",
            daemon=True,
        )
        releaser.start()
        releaser.join(bound)
        if releaser.is_alive():
            log.warning(
                "leaving hold() of a lock of spec %s without its release: the store did not "
                "answer within %gs (its timeout); the lock is released when it answers, "
                "or frees itself when its lease ends",
                self.spec.name,
                bound,
                extra=port_fields(self, "release", "timeout"),
            )
        for reporter in list(reporters):
            # on_lost has run by the time the block raises LockLost (bounded all the same).
            reporter.join(max(0.0, until - time.monotonic()))
        return lost

    def _release_quietly(self, lease: Lease) -> None:
        try:
            self.release(lease)
        except Exception:
            log.warning(
                "could not release a lock of spec %s; it frees itself when its lease ends",
                self.spec.name,
                exc_info=True,
                extra=port_fields(self, "release", "error"),
            )
