"""What the asyncio API does its own way, with tasks: the wrapper of an ``async def``
function (also used by the blocking Coordinator, with its store calls in threads),
``run()`` and ``hold()`` cancelling the body's task when the claim or lease is lost,
and leaving a hold while the caller is cancelled.

:mod:`idemlock.aio` (the source of the generated :mod:`idemlock._sync`) takes these
from here; :mod:`idemlock._threads` has the blocking versions under the same names.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ._base.idempotency import AttemptBase, IdempotencyBase
from ._base.lock import LockBase
from ._context import enter_claim, leave_claim
from ._core.flows import Renewal, RenewState
from ._core.jsontypes import JSONValue
from ._core.types import Claim, ClaimToken, Completed, InFlight, Lease
from ._decorator import DECORATOR_WAIT, RUN_WAIT, Wrapping
from ._errors import ConfigurationError, InFlightError, LockLost, StaleClaim

F = TypeVar("F", bound=Callable[..., Any])

log = logging.getLogger("idemlock")


def decorator(w: Wrapping) -> Callable[[F], F]:
    """``AsyncCoordinator.idempotent``'s decorator: ``async def`` functions only."""

    def decorate(fn: F) -> F:
        if not inspect.iscoroutinefunction(fn):
            raise ConfigurationError(
                f"{fn.__qualname__} is not an async def function; an AsyncCoordinator "
                "wraps coroutines only (use idemlock.connect() for plain functions)"
            )
        return cast(F, coroutine_wrapper(fn, w))

    return decorate


def coroutine_wrapper(
    fn: Callable[..., Awaitable[Any]], w: Wrapping, *, threads: bool = False
) -> Callable[..., Awaitable[Any]]:
    """The wrapper of an ``async def`` function: claim, run, record. ``threads``: the
    port is a blocking one (a Coordinator's), called in worker threads so a busy store
    never blocks the event loop, and its watchdog and renewer cancel the body from
    their own threads."""
    plan = w.plan(fn)
    port, wait_s, every, limit, on_lost = w.port, w.wait_s, w.every, w.limit, w.on_lost
    wait_with = None if wait_s is None else DECORATOR_WAIT

    async def call(method: Callable[..., Any], *args: Any) -> Any:
        if threads:
            return await asyncio.to_thread(method, *args)
        return await method(*args)

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        claim, sent = await call(port._begin_at, plan, args, kwargs, wait_s, wait_with)
        if isinstance(claim, Completed):
            return plan.replay(claim)
        token = claim.token
        loop = asyncio.get_running_loop() if threads else None
        cancels = _OwnCancels(asyncio.current_task(), loop)
        hb = (
            None
            if every is None
            else port._heartbeat(token, sent, every, limit, on_lost, cancels.cancel)
        )
        mark = enter_claim(token, AsyncAttempt(token.key, token, port=port, in_thread=threads))
        try:
            result = await fn(*args, **kwargs)
        except asyncio.CancelledError as exc:
            if hb is not None:
                hb.stop()
            if cancels.absorb():
                await call(port._abandon_quietly, token)
                raise port._replies.lost_claim(token, hb.reason if hb else "") from None
            await call(port._fail, plan, token, exc)
            raise
        except BaseException as exc:
            if hb is not None:
                hb.stop()
            await call(port._fail, plan, token, exc)
            raise
        finally:
            leave_claim(mark)
        if hb is not None:
            hb.stop()
        await call(port._record_beat, plan, token, result, hb)
        return result

    return wrapper


class AsyncAttempt(AttemptBase):
    __doc__ = AttemptBase.__doc__

    __slots__ = ("_in_thread",)

    def __init__(
        self,
        key: str,
        token: ClaimToken | None,
        result: Any = None,
        port: IdempotencyBase | None = None,
        *,
        in_thread: bool = False,
    ) -> None:
        super().__init__(key, token, result, port)
        #: a blocking port's (an ``async def`` under ``Coordinator.idempotent``): its
        #: store is called in worker threads, as the decorator calls it
        self._in_thread = in_thread

    async def _call(self, method: Callable[..., Any], *args: Any) -> Any:
        if self._in_thread:
            return await asyncio.to_thread(method, *args)
        return await method(*args)

    async def step(
        self,
        name: str,
        fn: Callable[..., Any],
        /,
        *args: Any,
        once: bool = False,
        replay_errors: tuple[type[BaseException], ...] = (),
        **kwargs: Any,
    ) -> Any:
        """Run step ``name`` as ``fn(*args, **kwargs)`` (awaited if it returns an
        awaitable) and record its result (JSON,
        through the spec's format and sealing) under the claim, fenced by it; if an
        earlier attempt recorded it, return that instead of calling ``fn``. An
        exception records nothing (unless listed in ``replay_errors``: recorded, and
        raised again on replay). ``once=True`` marks the step started before ``fn``
        runs, so a retry after a crash inside it raises ``StepInterrupted`` instead
        of running it again. ``ClaimLost`` if the claim is no longer this attempt's."""
        if self._txn_unsure(name):  # recorded in a transaction of the caller's
            store = self._steps_port()._store
            self._txn_ended(name, await self._call(store.steps, *self._steps_key()))
        found = self._step_begin(name, once)
        if found is not None:
            return self._replay(name, found, replay_errors)
        if once:
            await self._write(name, None)
        try:
            value = fn(*args, **kwargs)
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:
            self._txn.pop(name, None)
            data = self._error_data(exc, replay_errors)
            if data is not None:
                await self._write(name, data)
            raise
        if not self._txn_took(name):
            await self._write(name, self._step_data(name, value))
        return value

    async def settle(self, name: str, value: Any) -> None:
        """Record ``value`` as step ``name``'s result without running it (after
        checking what an interrupted ``once=True`` step did)."""
        self._step_begin(name, once=False)
        await self._write(name, self._step_data(name, value))

    async def retry_step(self, name: str) -> None:
        """Drop step ``name``'s record, so that it runs (once more) when reached."""
        await self._write(name, None, drop=True)

    async def _write(self, name: str, data: bytes | None, *, drop: bool = False) -> None:
        store = self._steps_port()._store
        args = self._drop_args(name) if drop else self._step_args(name, data)
        t0 = self._step_t0()
        try:
            expires = await self._call(store.drop_step if drop else store.step, *args)
        except Exception as exc:
            self._step_error(exc, t0)
            raise
        self._stepped(name, expires, data, t0, final=data is not None)


class IdempotencyRun(IdempotencyBase):
    """``run()`` of :class:`~idemlock.aio.AsyncIdempotencyPort`."""

    if TYPE_CHECKING:

        async def _claim_at(
            self, key: str, payload: Any, wait: float | None
        ) -> tuple[Claim, float]: ...

        async def complete(self, token: ClaimToken, result: Any) -> None: ...

        async def _abandon_quietly(self, token: ClaimToken) -> None: ...

    @asynccontextmanager
    async def run(
        self,
        key: str,
        *,
        payload: JSONValue = None,
        wait: timedelta | float | None = None,
        heartbeat: bool = True,
        renew_every: timedelta | float | None = None,
        max_run: timedelta | float | None = None,
        on_lost: Callable[[ClaimToken], object] | None = None,
        cancel_on_lost: bool = True,
    ) -> AsyncIterator[AsyncAttempt]:
        """Claim or replay ``key`` for an ``async with`` block (see
        ``IdempotencyPort.run``). A claim lost while the block runs also cancels the
        block's task (unless ``cancel_on_lost=False``); leaving then raises
        ``ClaimLost``, recording nothing."""
        every, limit, wait_s = self._run_options(wait, heartbeat, renew_every, max_run, on_lost)
        claim, sent = await self._claim_at(key, payload, wait_s)
        if isinstance(claim, InFlight):
            raise InFlightError(key, claim.expires_at, waited=wait_s, wait_with=RUN_WAIT)
        token = self._begun(key, claim)
        if isinstance(token, Completed):
            yield AsyncAttempt(key, None, token.result)
            return
        cancels = _OwnCancels(asyncio.current_task() if cancel_on_lost else None)
        hb = (
            None
            if every is None
            else self._heartbeat(token, sent, every, limit, on_lost, cancels.cancel)
        )
        attempt = AsyncAttempt(key, token, port=self)
        mark = enter_claim(token, attempt)
        try:
            yield attempt
        except asyncio.CancelledError:
            if hb is not None:
                hb.stop()
            await self._abandon_quietly(token)
            if cancels.absorb():
                raise self._replies.lost_claim(token, hb.reason if hb else "") from None
            raise
        except BaseException:
            if hb is not None:
                hb.stop()
            await self._abandon_quietly(token)
            raise
        finally:
            leave_claim(mark)
        if hb is not None:
            hb.stop()
        try:
            await self.complete(token, attempt.result)
        except StaleClaim as exc:
            raise self._not_recorded(exc, token, hb) from None

    def _expire_callback(self, state: RenewState) -> Callable[[], None]:
        # On the loop (the async watchdog): report at once.
        return lambda: state.lose(state.expired_reason())


class LockHold(LockBase):
    """``hold()`` of :class:`~idemlock.aio.AsyncLockPort`."""

    if TYPE_CHECKING:

        async def acquire(
            self,
            key: str,
            *,
            owner: str | None = None,
            wait: timedelta | float | None = None,
            value: str | None = None,
        ) -> Lease | None: ...

        async def release(self, lease: Lease) -> bool: ...

    @asynccontextmanager
    async def hold(
        self,
        key: str,
        *,
        wait: timedelta | float | None = None,
        renew_every: timedelta | float | None = None,
        max_hold: timedelta | float | None = None,
        owner: str | None = None,
        on_lost: Callable[[Lease], object] | None = None,
        cancel_on_lost: bool = True,
        value: str | None = None,
    ) -> AsyncIterator[Lease]:
        """Hold the lock for an ``async with`` block, renewing it in a background task.

        The lease is lost when ``lease.remaining()`` reaches zero without a confirmed
        renewal (a timer on the loop decides, whatever a renewal in progress is doing)
        or when the store says it is gone: ``lease.lost`` turns True, ``on_lost(lease)``
        runs (an exception it raises is logged), the body's task is cancelled (unless
        ``cancel_on_lost=False``) and leaving the block raises ``LockLost``. Leaving
        waits at most the store's ``timeout`` for the release; a cancellation that
        lands while leaving reaches the caller as ``CancelledError``."""
        every, max_hold_s = self._hold_options(renew_every, max_hold)
        got = await self.acquire(key, owner=owner, wait=wait, value=value)
        lease, state = self._held(key, got, wait, on_lost)
        body = asyncio.current_task()
        cancels = _OwnCancels(body)
        report = state.notify
        assert report is not None

        def notify() -> None:
            report()
            if cancel_on_lost and body is not None and not state.ended:
                cancels.pending = True
                body.cancel()

        state.notify = notify
        # The coordinator's one renewer is a task per loop.
        entry, renewal = self._start_renewing(
            state, every, max_hold_s, lambda: state.lose(state.expired_reason())
        )
        try:
            yield lease
        except asyncio.CancelledError:
            await self._leave(state, entry, renewal, cancels)
            if cancels.absorb():
                raise LockLost(self._lost_message(lease, state.reason)) from None
            raise
        except BaseException:
            await self._leave(state, entry, renewal, cancels)
            raise
        if await self._leave(state, entry, renewal, cancels):
            raise LockLost(self._lost_message(lease, state.reason))

    async def _leave(
        self,
        state: RenewState,
        entry: Any,
        renewal: Renewal,
        cancels: _OwnCancels,
    ) -> bool:
        """End a hold: stop renewing, release (bounded by the store's timeout) and
        return whether the lease was lost. A cancellation of the caller meanwhile
        propagates; the release carries on in the background."""
        lost, lease = self._stop_renewing(state, entry, renewal)
        finisher = asyncio.ensure_future(self._finish(lease))
        _BACKGROUND.add(finisher)
        finisher.add_done_callback(_BACKGROUND.discard)
        while True:
            try:
                await asyncio.shield(finisher)
                return lost
            except asyncio.CancelledError:
                if cancels.absorb():
                    continue  # our own cancellation of the body, delivered only here
                raise

    async def _finish(self, lease: Lease) -> None:
        bound = self._bound()
        try:
            await asyncio.wait_for(self._wind_down(lease), bound)
        except asyncio.TimeoutError:
            self._unreleased(bound, "the lock frees itself when its lease ends")

    async def _wind_down(self, lease: Lease) -> None:
        try:
            await self.release(lease)
        except Exception:
            self._release_failed()


#: exits still releasing after their caller was cancelled (strong references)
_BACKGROUND: set[asyncio.Future[None]] = set()


class _OwnCancels:
    """Tells the body's cancellation by ``hold()`` (lease lost) from anyone else's."""

    __slots__ = ("body", "loop", "pending")

    def __init__(
        self, body: asyncio.Task[Any] | None, loop: asyncio.AbstractEventLoop | None = None
    ) -> None:
        self.body = body
        #: set when ``cancel`` is called from other threads (a Coordinator's watchdog or
        #: renewer): the body is then cancelled on its loop
        self.loop = loop
        self.pending = False

    def cancel(self, state: RenewState) -> None:
        """Cancel the body because its claim was lost, unless it ended."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._cancel_now, state)
        else:
            self._cancel_now(state)

    def _cancel_now(self, state: RenewState) -> None:
        if self.body is not None and not state.ended:
            self.pending = True
            self.body.cancel()

    def absorb(self) -> bool:
        """A CancelledError reached the block: True if it was only ours (then it is
        taken back, and the block raises LockLost instead)."""
        if not self.pending:
            return False
        self.pending = False
        uncancel = getattr(self.body, "uncancel", None)
        if uncancel is None:  # Python 3.10: no count of cancellations to consult
            return True
        return bool(uncancel() == 0)
