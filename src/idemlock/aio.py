"""The asyncio API: :func:`connect` returns an :class:`AsyncCoordinator` with the
same surface as :class:`idemlock.Coordinator`, its I/O methods being coroutines."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any, TypeVar, cast

from ._context import enter_claim, leave_claim
from ._coordinator import CoordinatorBase
from ._core.clock import Clock
from ._core.codec import COMPRESS_OVER, MAX_RESULT_BYTES
from ._core.events import Hook
from ._core.flows import Renewal, RenewState, acquire_flow, claim_flow
from ._core.keys import validate_key
from ._core.port import AsyncStore
from ._core.types import (
    Claim,
    Claimed,
    ClaimToken,
    Completed,
    IdempotencySpec,
    Lease,
    LockInfo,
    LockSpec,
    RecordStatus,
    to_ms,
)
from ._decorator import WrapPlan, heartbeat_options, wrap_options
from ._drive import run_async
from ._durations import seconds
from ._errors import (
    ConfigurationError,
    FencedOut,
    InFlightError,
    LockLost,
    LockNotAcquired,
    StaleClaim,
)
from ._keyring import Keyring
from ._ports import Attempt, FenceBase, Heartbeat, IdempotencyBase, LockBase
from ._renewer import AsyncRenewer
from ._tokens import check_token
from ._watchdog import AsyncWatchdog

F = TypeVar("F", bound=Callable[..., Any])

__all__ = [
    "AsyncCoordinator",
    "AsyncFenceGate",
    "AsyncIdempotencyPort",
    "AsyncLockPort",
    "connect",
]

log = logging.getLogger("idemlock")


def connect(
    url: Any = None,
    *,
    key_prefix: str = "idemlock",
    keyring: Keyring | None = None,
    tenant: str | None = None,
    max_result_bytes: int = MAX_RESULT_BYTES,
    compress_over: int | None = COMPRESS_OVER,
    hooks: Iterable[Hook] | None = None,
    **options: Any,
) -> AsyncCoordinator:
    """Open an :class:`AsyncCoordinator` on the store named by ``url`` (see
    :func:`idemlock.connect`)."""
    from ._urls import open_store

    store, clock, shown = open_store(url, asynchronous=True, **options)
    return AsyncCoordinator(
        store,
        key_prefix=key_prefix,
        clock=clock,
        url=shown,
        keyring=keyring,
        tenant=tenant,
        max_result_bytes=max_result_bytes,
        compress_over=compress_over,
        hooks=hooks,
    )


class AsyncCoordinator(CoordinatorBase):
    """Entry point of the asyncio API; made by :func:`idemlock.aio.connect`."""

    _store: AsyncStore

    def _make_watchdog(self, clock: Clock) -> AsyncWatchdog:
        return AsyncWatchdog(clock)

    def _make_renewer(self, store: Any, clock: Clock) -> AsyncRenewer:
        return AsyncRenewer(store, clock)

    def idempotency(self, spec: IdempotencySpec | str) -> AsyncIdempotencyPort:
        """The claim/complete port of one kind of operation."""
        return AsyncIdempotencyPort(self, self._idem_spec(spec))

    def lock(self, spec: LockSpec | str) -> AsyncLockPort:
        """The fenced-lease port of one family of locks."""
        return AsyncLockPort(self, self._lock_spec(spec))

    def fence(self, resource: str) -> AsyncFenceGate:
        """The gate that guards one resource with fencing tokens."""
        return AsyncFenceGate(self, resource)

    async def keys(self) -> list[RecordStatus]:
        """Every live idempotency record under this coordinator's prefix: the root's
        listing covers its tenants' too, each row naming its ``tenant`` and ``spec``. A
        value the store cannot read is listed with state ``"corrupt"`` (and a warning)."""
        return [self._record_status(r) for r in await self._store.records(self._ns_prefix())]

    async def purge(self) -> int:
        """Delete expired records and locks from the store; returns how many went."""
        return await self._store.purge()

    async def locks(self) -> list[LockInfo]:
        """Every held lock under this coordinator's prefix, each naming its ``tenant``
        (as ``keys()``); an unreadable value is listed with ``corrupt=True``."""
        return [self._lock_info(r) for r in await self._store.locks(self._ns_prefix())]

    def idempotent(
        self,
        spec_or_name: IdempotencySpec | str,
        key: Callable[..., str] | None = None,
        on_in_flight: str = "raise",
        wait: timedelta | float | None = None,
        *,
        replay_errors: tuple[type[BaseException], ...] = (),
        heartbeat: bool = True,
        renew_every: timedelta | float | None = None,
        max_run: timedelta | float | None = None,
        on_lost: Callable[[ClaimToken], object] | None = None,
    ) -> Callable[[F], F]:
        """Make an ``async def`` function idempotent (see ``Coordinator.idempotent``,
        heartbeats included: a lost claim cancels the body and the call raises
        ``ClaimLost``)."""
        wrap_options(spec_or_name, key, on_in_flight, wait)
        port = self.idempotency(spec_or_name)
        wait_s = port._wait_for(wait) if on_in_flight == "wait" else None
        every, limit = heartbeat_options(port, heartbeat, renew_every, max_run, on_lost)

        def decorate(fn: F) -> F:
            if not inspect.iscoroutinefunction(fn):
                raise ConfigurationError(
                    f"{fn.__qualname__} is not an async def function; an AsyncCoordinator "
                    "wraps coroutines only (use idemlock.connect() for plain functions)"
                )
            plan = WrapPlan(fn, key, replay_errors)

            @functools.wraps(fn)
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                claim, sent = await port._begin_at(plan, args, kwargs, wait_s)
                if isinstance(claim, Completed):
                    return plan.replay(claim)
                token = claim.token
                cancels = _OwnCancels(asyncio.current_task())
                hb = (
                    None
                    if every is None
                    else port._heartbeat(token, sent, every, limit, on_lost, cancels.cancel)
                )
                mark = enter_claim(token)
                try:
                    result = await fn(*args, **kwargs)
                except asyncio.CancelledError as exc:
                    if hb is not None:
                        hb.stop()
                    if cancels.absorb():
                        await port._abandon_quietly(token)
                        raise port._lost_claim(token, hb.reason if hb else "") from None
                    await port._fail(plan, token, exc)
                    raise
                except BaseException as exc:
                    if hb is not None:
                        hb.stop()
                    await port._fail(plan, token, exc)
                    raise
                finally:
                    leave_claim(mark)
                if hb is not None:
                    hb.stop()
                await port._record_beat(plan, token, result, hb)
                return result

            return cast(F, wrapper)

        return decorate

    def for_tenant(self, tenant: str) -> AsyncCoordinator:
        """A view whose records, locks and fences live in ``tenant``'s namespace only."""
        view = AsyncCoordinator.__new__(AsyncCoordinator)
        view._view_of(self, tenant)
        return view

    async def close(self) -> None:
        """Close the store's connections (a tenant view leaves them to its parent)."""
        if self._owns_store:
            await self._store.aclose()

    async def __aenter__(self) -> AsyncCoordinator:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class AsyncIdempotencyPort(IdempotencyBase):
    """Claim, complete and abandon keyed operations of one :class:`IdempotencySpec`."""

    _store: AsyncStore

    async def claim(
        self, key: str, *, payload: Any = None, lease: timedelta | float | None = None
    ) -> Claim:
        """Atomically one of ``Claimed``, ``InFlight`` or ``Completed``."""
        t0 = self._t0()
        args = self._claim_args(key, payload, lease)
        try:
            reply = await self._store.claim(*args)
        except Exception as exc:
            self._emit_error("claim", exc, t0)
            raise
        return self._interpret(key, reply, None, t0, args[1])

    async def complete(
        self,
        token: ClaimToken,
        result: Any,
        *,
        writes: Mapping[str, bytes | str] | None = None,
    ) -> None:
        """Record ``result`` (JSON data) for the spec's ttl. ``StaleClaim`` if the token
        lost its key; ``ResultEncodeError`` (nothing stored) if JSON cannot hold it.

        ``writes`` (Redis): keys of the store to SET in the same atomic step, so the
        job's effects and its record commit together or not at all (on PostgreSQL use
        ``complete_in_transaction`` for the same)."""
        t0 = self._t0()
        args = self._token_args(token)
        data = self._encode(token.key, result)
        call = self._complete_with() if writes else None
        extra = self._writes(writes) if writes else None
        try:
            if call is not None:
                ok = await call(*args, data, self._ttl_ms, extra)
            else:
                ok = await self._store.complete(*args, data, self._ttl_ms)
        except Exception as exc:
            self._emit_error("complete", exc, t0)
            raise
        self._finish_claim(token, ok, "complete", t0)

    async def abandon(self, token: ClaimToken) -> None:
        """Release the claim so a retry runs the operation again."""
        t0 = self._t0()
        args = self._token_args(token)
        try:
            ok = await self._store.abandon(*args)
        except Exception as exc:
            self._emit_error("abandon", exc, t0)
            raise
        self._finish_claim(token, ok, "abandon", t0)

    async def extend(self, token: ClaimToken, lease: timedelta | float | None = None) -> ClaimToken:
        """Push the end of a running claim's lease to ``lease`` (default: the spec's)
        from now, for work that runs longer than planned; the fence stays. Returns the
        token with its new ``expires_at``. ``StaleClaim`` if the claim no longer holds
        its key (an expired claim is never revived)."""
        args = self._token_args(token)
        lease_ms = self._lease_ms if lease is None else to_ms(lease, "lease")
        return self._extend_token(token, await self._store.extend(*args, lease_ms))

    async def status(self, key: str) -> RecordStatus | None:
        """What the store holds for ``key``."""
        return self._status(key, await self._store.record(self._ns, self._skey(key)))

    async def forget(self, key: str) -> bool:
        """Delete the record of ``key`` (operators only: a retry will run again)."""
        return await self._store.forget(self._ns, self._skey(key))

    async def wait(
        self, key: str, *, payload: Any = None, timeout: timedelta | float | None = None
    ) -> Claim:
        """Claim, waiting up to ``timeout`` while the key is in flight."""
        t0 = self._t0()
        args = self._claim_args(key, payload)
        flow = claim_flow(*args, self._wait_for(timeout), self._coord.clock, self._coord.poll_cap)
        try:
            reply = await run_async(flow, self._store)
        except Exception as exc:
            self._emit_error("claim", exc, t0)
            raise
        return self._interpret(key, reply, None, t0, args[1])

    @asynccontextmanager
    async def run(
        self,
        key: str,
        *,
        payload: Any = None,
        wait: timedelta | float | None = None,
        heartbeat: bool = True,
        renew_every: timedelta | float | None = None,
        max_run: timedelta | float | None = None,
        on_lost: Callable[[ClaimToken], object] | None = None,
        cancel_on_lost: bool = True,
    ) -> AsyncIterator[Attempt]:
        """Claim or replay ``key`` for an ``async with`` block (see
        ``IdempotencyPort.run``). A claim lost while the block runs also cancels the
        block's task (unless ``cancel_on_lost=False``); leaving then raises
        ``ClaimLost``, recording nothing."""
        every, limit = heartbeat_options(self, heartbeat, renew_every, max_run, on_lost)
        wait_s = None if wait is None else self._wait_for(wait)
        claim, sent = await self._claim_at(key, payload, wait_s)
        if isinstance(claim, Completed):
            yield Attempt(key, None, claim.result)
            return
        if not isinstance(claim, Claimed):
            raise InFlightError(key, claim.expires_at)
        token = claim.token
        cancels = _OwnCancels(asyncio.current_task() if cancel_on_lost else None)
        hb = (
            None
            if every is None
            else self._heartbeat(token, sent, every, limit, on_lost, cancels.cancel)
        )
        attempt = Attempt(key, token)
        mark = enter_claim(token)
        try:
            yield attempt
        except asyncio.CancelledError:
            if hb is not None:
                hb.stop()
            await self._abandon_quietly(token)
            if cancels.absorb():
                raise self._lost_claim(token, hb.reason if hb else "") from None
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
        except StaleClaim:
            if hb is None:
                raise
            raise self._lost_claim(token, hb.reason) from None

    # ---- the decorator's steps -------------------------------------------------

    def _expire_callback(self, state: RenewState) -> Callable[[], None]:
        # On the loop (the async watchdog): report at once.
        return lambda: state.lose(state.expired_reason())

    async def _claim_at(self, key: str, payload: Any, wait: float | None) -> tuple[Claim, float]:
        t0 = self._t0()
        cargs = self._claim_args(key, payload)
        clock = self._coord.clock
        try:
            if wait is None:
                sent = clock.monotonic()
                reply = await self._store.claim(*cargs)
            else:
                stamp = [clock.monotonic()]
                flow = claim_flow(*cargs, wait, clock, self._coord.poll_cap, stamp)
                reply = await run_async(flow, self._store)
                sent = stamp[0]
        except Exception as exc:
            self._emit_error("claim", exc, t0)
            raise
        return self._interpret(key, reply, None, t0, cargs[1]), sent

    async def _begin(
        self, plan: WrapPlan, args: Any, kwargs: Any, wait: float | None
    ) -> Claimed | Completed:
        return (await self._begin_at(plan, args, kwargs, wait))[0]

    async def _begin_at(
        self, plan: WrapPlan, args: Any, kwargs: Any, wait: float | None
    ) -> tuple[Claimed | Completed, float]:
        t0 = self._t0()
        key, payload = plan.key_payload(args, kwargs)
        _, load = plan.types()
        cargs = self._claim_args(key, payload)
        clock = self._coord.clock
        try:
            if wait is None:
                sent = clock.monotonic()
                reply = await self._store.claim(*cargs)
            else:
                stamp = [clock.monotonic()]
                flow = claim_flow(*cargs, wait, clock, self._coord.poll_cap, stamp)
                reply = await run_async(flow, self._store)
                sent = stamp[0]
        except Exception as exc:
            self._emit_error("claim", exc, t0)
            raise
        claim = self._replay_or_raise(key, reply, load, t0, cargs[1])
        return cast("Claimed | Completed", claim), sent

    async def _record_beat(
        self, plan: WrapPlan, token: ClaimToken, result: Any, hb: Heartbeat | None
    ) -> None:
        try:
            await self._record(plan, token, result)
        except StaleClaim:
            if hb is None:
                raise
            raise self._lost_claim(token, hb.reason) from None

    async def _record(self, plan: WrapPlan, token: ClaimToken, result: Any) -> None:
        t0 = self._t0()
        try:
            data = self._encode(token.key, result, *plan.types())
        except BaseException:
            await self._abandon_quietly(token)
            raise
        try:
            ok = await self._store.complete(*self._token_args(token), data, self._ttl_ms)
        except Exception as exc:
            self._emit_error("complete", exc, t0)
            raise
        self._finish_claim(token, ok, "complete", t0)

    async def _fail(self, plan: WrapPlan, token: ClaimToken, exc: BaseException) -> None:
        data = self._error_record(plan, token, exc)
        if data is None:
            await self._abandon_quietly(token)
            return
        t0 = self._t0()
        try:
            ok = await self._store.complete(*self._token_args(token), data, self._ttl_ms)
        except Exception as exc:
            self._emit_error("complete", exc, t0)
            raise
        self._emit("complete", "ok" if ok else "stale", t0)
        if not ok:
            log.warning("could not record the error of %r: the claim was lost", token.key)

    async def _abandon_quietly(self, token: ClaimToken) -> None:
        t0 = self._t0()
        try:
            ok = await self._store.abandon(*self._token_args(token))
            self._emit("abandon", "ok" if ok else "stale", t0)
        except Exception as exc:
            self._emit_error("abandon", exc, t0)
            log.warning(
                "could not abandon claim on %r; it frees itself when its lease ends",
                token.key,
                exc_info=True,
            )


class AsyncLockPort(LockBase):
    """Fenced leases of one :class:`LockSpec`."""

    _store: AsyncStore

    async def acquire(
        self, key: str, *, owner: str | None = None, wait: timedelta | float | None = None
    ) -> Lease | None:
        """Take the lock, waiting up to ``wait``; None if it stayed held."""
        t0 = self._t0()
        who = self._owner(owner)
        wait_s = seconds(wait, "wait")
        if not wait_s:
            # No waiting: one call, no flow to drive.
            sent = self._coord.clock.monotonic()
            try:
                reply = await self._store.acquire(self._ns, validate_key(key), who, self._ttl_ms)
            except Exception as exc:
                self._emit_error("acquire", exc, t0)
                raise
            return self._finish_acquire(key, who, (reply, sent, 1), t0)
        flow = acquire_flow(
            self._ns,
            validate_key(key),
            who,
            self._ttl_ms,
            wait_s,
            self._coord.clock,
            self._coord.poll_cap,
        )
        try:
            result = await run_async(flow, self._store)
        except Exception as exc:
            self._emit_error("acquire", exc, t0)
            raise
        return self._finish_acquire(key, who, result, t0)

    async def release(self, lease: Lease) -> bool:
        """Free the lock if this lease still holds it; False if it had expired or was
        released already (releasing twice is harmless)."""
        t0 = self._t0()
        args = self._release_args(lease)
        if args is None:
            return self._finish_release(lease, False, t0)
        try:
            ok = await self._store.release(*args)
        except Exception as exc:
            self._emit_error("release", exc, t0)
            raise
        return self._finish_release(lease, ok, t0)

    async def break_lock(self, key: str, *, token: int | None = None) -> bool:
        """Free the lock whoever holds it (an operator's forced unlock, like
        python-redis-lock's ``reset`` or Redisson's ``forceUnlock``); True if it was held.

        The token counter is kept, so the next acquire gets a higher token: wherever the
        new holder writes through a fence gate, the old holder's late writes are refused
        (FencedOut). The old holder's renew and release fail, and its ``hold()`` block
        reports the loss (``LockLost``). With ``token``, only a holder that still has
        that token is freed (the one you saw in ``locks()``), never one that took the
        lock over meanwhile. Emits the ``break`` event (broken, not_held, error)."""
        t0 = self._t0()
        ns, skey, guard = self._break_args(key, token)
        try:
            if guard is None:
                ok = await self._store.break_lock(ns, skey)
            else:
                held = self._break_guarded(await self._store.lock(ns, skey), guard)
                ok = held is not None and await self._store.release(ns, skey, *held)
        except Exception as exc:
            self._emit_error("break", exc, t0)
            raise
        return self._finish_break(ok, t0)

    async def renew(self, lease: Lease, ttl: timedelta | float | None = None) -> bool:
        """Reset the lease to ``ttl`` from now; the token stays. False if it had expired."""
        t0 = self._t0()
        args = self._check_lease(lease, "renew")
        ttl_ms = self._renew_ttl(ttl)
        sent = self._coord.clock.monotonic()
        try:
            new_exp = await self._store.renew(*args, ttl_ms)
        except Exception as exc:
            self._emit_error("renew", exc, t0)
            raise
        return self._finish_renew(lease, sent, ttl_ms, new_exp, t0)

    async def is_locked(self, key: str) -> bool:
        return await self._store.lock(self._ns, validate_key(key)) is not None

    async def owner(self, key: str) -> str | None:
        return self._row_owner(await self._store.lock(self._ns, validate_key(key)))

    async def ttl(self, key: str) -> timedelta | None:
        """Time left on the current holder's lease (None if free)."""
        return self._row_ttl(await self._store.lock(self._ns, validate_key(key)))

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
    ) -> AsyncIterator[Lease]:
        """Hold the lock for an ``async with`` block, renewing it in a background task.

        The lease is lost when ``lease.remaining()`` reaches zero without a confirmed
        renewal (a timer on the loop decides, whatever a renewal in progress is doing)
        or when the store says it is gone: ``lease.lost`` turns True, ``on_lost(lease)``
        runs (an exception it raises is logged), the body's task is cancelled (unless
        ``cancel_on_lost=False``) and leaving the block raises ``LockLost``. Leaving
        waits at most the store's ``timeout`` for the release; a cancellation that
        lands while leaving reaches the caller as ``CancelledError``."""
        every = self._renew_every(renew_every)
        max_hold_s = seconds(max_hold, "max_hold")
        lease = await self.acquire(key, owner=owner, wait=wait)
        if lease is None:
            raise LockNotAcquired(self._not_acquired(key, wait))
        assert lease.token is not None
        state = self._renew_state(lease, on_lost)
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
        watchdog: AsyncWatchdog = self._coord._watchdog
        entry = watchdog.watch(state.deadline(), lambda: state.lose(state.expired_reason()))
        state.moved = lambda at: watchdog.move(entry, at)
        # Renewed by the coordinator's one renewer (a task per loop), with every claim
        # and lease it keeps.
        renewal = self._renewal(lease, every, max_hold_s, state)
        self._coord._renewer.add(renewal)
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
        lost = state.end(self._coord.clock.monotonic())
        self._coord._watchdog.cancel(entry)
        self._coord._renewer.remove(renewal)
        assert state.lease is not None
        finisher = asyncio.ensure_future(self._finish(state.lease))
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
            log.warning(
                "leaving hold() of lock %s:%s without its release: the store did not "
                "answer within %gs (its timeout); the lock frees itself when its lease ends",
                self.spec.name,
                lease.key,
                bound,
            )

    async def _wind_down(self, lease: Lease) -> None:
        try:
            await self.release(lease)
        except Exception:
            log.warning(
                "could not release lock on %r; it frees itself when its lease ends",
                lease.key,
                exc_info=True,
            )


#: exits still releasing after their caller was cancelled (strong references)
_BACKGROUND: set[asyncio.Future[None]] = set()


class _OwnCancels:
    """Tells the body's cancellation by ``hold()`` (lease lost) from anyone else's."""

    __slots__ = ("body", "pending")

    def __init__(self, body: asyncio.Task[Any] | None) -> None:
        self.body = body
        self.pending = False

    def cancel(self, state: RenewState) -> None:
        """Cancel the body because its claim was lost (on the loop), unless it ended."""
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


class AsyncFenceGate(FenceBase):
    """Accepts fencing tokens at least as high as the highest accepted for a resource."""

    _store: AsyncStore

    async def check_and_advance(self, token: int) -> int:
        """Accept ``token`` (it becomes the highest) or raise ``FencedOut``, changing nothing."""
        token = check_token(token)
        ok, highest = await self._store.fence_advance(self._ns, self.resource, token)
        if not ok:
            raise FencedOut(self.resource, token, highest)
        return highest

    async def set_if_fresh(self, token: int, key: str, value: bytes | str) -> int:
        """Atomically accept ``token`` (as ``check_and_advance``) and, only if it is
        accepted, write ``value`` at ``key`` in the store itself (Redis). Raises
        ``FencedOut`` and writes nothing for a stale token."""
        token = check_token(token)
        fence_set = self._fence_set()
        data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        ok, highest = await fence_set(self._ns, self.resource, token, key, data)
        if not ok:
            raise FencedOut(self.resource, token, highest)
        return int(highest)

    async def current(self) -> int | None:
        """The highest token accepted so far (None before the first)."""
        return await self._store.fence_current(self._ns, self.resource)
