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

from ._base.idempotency import AttemptBase, IdempotencyBase
from ._base.lock import LockBase
from ._context import enter_claim, leave_claim
from ._core.flows import Renewal, RenewState
from ._core.jsontypes import JSONValue
from ._core.types import Claim, ClaimToken, Completed, InFlight, Lease
from ._decorator import DECORATOR_WAIT, RUN_WAIT, Wrapping
from ._errors import InFlightError, LockLost, StaleClaim

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("idemlock")


def decorator(w: Wrapping) -> Callable[[F], F]:
    """``Coordinator.idempotent``'s decorator: plain functions, and ``async def`` ones
    with the store called from worker threads."""

    def decorate(fn: F) -> F:
        if inspect.iscoroutinefunction(fn):
            # Only here: `import idemlock` alone must not load asyncio.
            from ._tasks import coroutine_wrapper

            return cast(F, coroutine_wrapper(fn, w, threads=True))
        plan = w.plan(fn)
        port, wait_s, every, limit, on_lost = w.port, w.wait_s, w.every, w.limit, w.on_lost
        wait_with = None if wait_s is None else DECORATOR_WAIT

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            claim, sent = port._begin_at(plan, args, kwargs, wait_s, wait_with)
            if isinstance(claim, Completed):
                return plan.replay(claim)
            token = claim.token
            hb = None if every is None else port._heartbeat(token, sent, every, limit, on_lost)
            mark = enter_claim(token, Attempt(token.key, token, port=port))
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


class Attempt(AttemptBase):
    __doc__ = AttemptBase.__doc__

    __slots__ = ()

    def step(
        self,
        name: str,
        fn: Callable[..., Any],
        /,
        *args: Any,
        once: bool = False,
        replay_errors: tuple[type[BaseException], ...] = (),
        **kwargs: Any,
    ) -> Any:
        """Run step ``name`` as ``fn(*args, **kwargs)`` and record its result (JSON,
        through the spec's format and sealing) under the claim, fenced by it; if an
        earlier attempt recorded it, return that instead of calling ``fn``. An
        exception records nothing (unless listed in ``replay_errors``: recorded, and
        raised again on replay). ``once=True`` marks the step started before ``fn``
        runs, so a retry after a crash inside it raises ``StepInterrupted`` instead
        of running it again. ``ClaimLost`` if the claim is no longer this attempt's."""
        if self._txn_unsure(name):  # recorded in a transaction of the caller's
            store = self._steps_port()._store
            self._txn_ended(name, store.steps(*self._steps_key()))
        found = self._step_begin(name, once)
        if found is not None:
            return self._replay(name, found, replay_errors)
        if once:
            self._write(name, None)
        try:
            value = fn(*args, **kwargs)
        except Exception as exc:
            self._txn.pop(name, None)
            data = self._error_data(exc, replay_errors)
            if data is not None:
                self._write(name, data)
            raise
        if not self._txn_took(name):
            self._write(name, self._step_data(name, value))
        return value

    def settle(self, name: str, value: Any) -> None:
        """Record ``value`` as step ``name``'s result without running it (after
        checking what an interrupted ``once=True`` step did)."""
        self._step_begin(name, once=False)
        self._write(name, self._step_data(name, value))

    def retry_step(self, name: str) -> None:
        """Drop step ``name``'s record, so that it runs (once more) when reached."""
        self._write(name, None, drop=True)

    def _write(self, name: str, data: bytes | None, *, drop: bool = False) -> None:
        store = self._steps_port()._store
        args = self._drop_args(name) if drop else self._step_args(name, data)
        t0 = self._step_t0()
        try:
            expires = store.drop_step(*args) if drop else store.step(*args)
        except Exception as exc:
            self._step_error(exc, t0)
            raise
        self._stepped(name, expires, data, t0, final=data is not None)


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
        payload: JSONValue = None,
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
        every, limit, wait_s = self._run_options(wait, heartbeat, renew_every, max_run, on_lost)
        claim, sent = self._claim_at(key, payload, wait_s)
        if isinstance(claim, InFlight):
            raise InFlightError(key, claim.expires_at, waited=wait_s, wait_with=RUN_WAIT)
        token = self._begun(key, claim)
        if isinstance(token, Completed):
            yield Attempt(key, None, token.result)
            return
        hb = None if every is None else self._heartbeat(token, sent, every, limit, on_lost)
        attempt = Attempt(key, token, port=self)
        mark = enter_claim(token, attempt)
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
        except StaleClaim as exc:
            raise self._not_recorded(exc, token, hb) from None

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
            self,
            key: str,
            *,
            owner: str | None = None,
            wait: timedelta | float | None = None,
            value: str | None = None,
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
        value: str | None = None,
    ) -> Iterator[Lease]:
        """Hold the lock for a block, renewing it in the background.

        Raises ``LockNotAcquired`` if it cannot be taken within ``wait``. The lease is
        lost when ``lease.remaining()`` reaches zero without a confirmed renewal (a
        local timer decides, whatever a renewal in progress is doing) or when the store
        says it is gone: ``lease.lost`` turns True, ``on_lost(lease)`` runs (on an
        idemlock thread; an exception it raises is logged), and leaving the block
        raises ``LockLost`` unless the body already raised. Leaving waits at most the
        store's ``timeout`` for the store."""
        every, max_hold_s = self._hold_options(renew_every, max_hold)
        got = self.acquire(key, owner=owner, wait=wait, value=value)
        lease, state = self._held(key, got, wait, on_lost)
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

        entry, renewal = self._start_renewing(state, every, max_hold_s, expire)
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
        lost, lease = self._stop_renewing(state, entry, renewal)
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
            self._unreleased(
                bound, "the lock is released when it answers, or frees itself when its lease ends"
            )
        for reporter in list(reporters):
            # on_lost has run by the time the block raises LockLost (bounded all the same).
            reporter.join(max(0.0, until - time.monotonic()))
        return lost

    def _release_quietly(self, lease: Lease) -> None:
        try:
            self.release(lease)
        except Exception:
            self._release_failed()
