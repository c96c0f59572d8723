"""The blocking API: :class:`Coordinator` and its ports."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar, cast

from ._context import enter_claim, leave_claim
from ._coordinator import CoordinatorBase
from ._core.clock import Clock
from ._core.flows import Renewal, RenewState, acquire_flow, claim_flow
from ._core.keys import validate_key
from ._core.port import SyncStore
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
from ._drive import run_sync
from ._durations import seconds
from ._errors import FencedOut, InFlightError, LockLost, LockNotAcquired, StaleClaim
from ._ports import Attempt, FenceBase, Heartbeat, IdempotencyBase, LockBase
from ._renewer import Renewer
from ._tokens import check_token
from ._watchdog import Watchdog

F = TypeVar("F", bound=Callable[..., Any])
log = logging.getLogger("idemlock")

__all__ = ["Coordinator", "FenceGate", "IdempotencyPort", "LockPort"]


class Coordinator(CoordinatorBase):
    """Entry point of the blocking API; made by :func:`idemlock.connect`."""

    _store: SyncStore

    def _make_watchdog(self, clock: Clock) -> Watchdog:
        return Watchdog(clock)

    def _make_renewer(self, store: Any, clock: Clock) -> Renewer:
        return Renewer(store, clock)

    def idempotency(self, spec: IdempotencySpec | str) -> IdempotencyPort:
        """The claim/complete port of one kind of operation."""
        return IdempotencyPort(self, self._idem_spec(spec))

    def lock(self, spec: LockSpec | str) -> LockPort:
        """The fenced-lease port of one family of locks."""
        return LockPort(self, self._lock_spec(spec))

    def fence(self, resource: str) -> FenceGate:
        """The gate that guards one resource with fencing tokens."""
        return FenceGate(self, resource)

    def keys(self) -> list[RecordStatus]:
        """Every live idempotency record under this coordinator's prefix: the root's
        listing covers its tenants' too, each row naming its ``tenant`` and ``spec``. A
        value the store cannot read is listed with state ``"corrupt"`` (and a warning)."""
        return [self._record_status(r) for r in self._store.records(self._ns_prefix())]

    def purge(self) -> int:
        """Delete expired records and locks from the store; returns how many went."""
        return self._store.purge()

    def locks(self) -> list[LockInfo]:
        """Every held lock under this coordinator's prefix, each naming its ``tenant``
        (as ``keys()``); an unreadable value is listed with ``corrupt=True``."""
        return [self._lock_info(r) for r in self._store.locks(self._ns_prefix())]

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
        """Make a function idempotent: claim, run, complete; replay on a retry.

        ``key`` is a callable of the call's arguments returning the idempotency key;
        None uses the fingerprint of the canonical arguments. The canonical arguments
        are always the payload, so reusing a key with other arguments raises
        :class:`~idemlock.PayloadMismatch`. The return annotation decides how the
        result is stored and restored on replay. An exception of a type listed in
        ``replay_errors`` is recorded and raised again on every replay; any other
        exception abandons the claim (a retry runs again) and propagates. Works on
        plain and ``async def`` functions.

        Heartbeats: while the body runs its claim is renewed every ``renew_every``
        (default: a third of the spec's lease) by the coordinator's one renewer, so the
        lease only bounds how long a crashed worker blocks the key. ``max_run`` stops
        renewing after that long (runaway protection); ``heartbeat=False`` never
        renews. A claim is lost when a renewal is refused or none was confirmed before
        its lease ran out: ``current_claim().lost`` turns True, ``on_lost(token)`` runs
        (on an idemlock thread; its error is logged) and an ``async def`` body is
        cancelled. When the body returns, its result is still recorded if nobody took
        the key over (late completion); otherwise nothing is recorded and the call
        raises :class:`~idemlock.ClaimLost`.
        """
        wrap_options(spec_or_name, key, on_in_flight, wait)
        port = self.idempotency(spec_or_name)
        wait_s = port._wait_for(wait) if on_in_flight == "wait" else None
        every, limit = heartbeat_options(port, heartbeat, renew_every, max_run, on_lost)

        def decorate(fn: F) -> F:
            plan = WrapPlan(fn, key, replay_errors)
            if inspect.iscoroutinefunction(fn):

                @functools.wraps(fn)
                async def awrapper(*args: Any, **kwargs: Any) -> Any:
                    # The sync store is called from a worker thread so a busy store
                    # never blocks the event loop.
                    claim, sent = await asyncio.to_thread(
                        port._begin_at, plan, args, kwargs, wait_s
                    )
                    if isinstance(claim, Completed):
                        return plan.replay(claim)
                    token = claim.token
                    body = asyncio.current_task()
                    loop = asyncio.get_running_loop()
                    cancelled: list[bool] = []

                    def cancel(state: RenewState) -> None:
                        # From the watchdog's or renewer's thread: cancel on the loop,
                        # unless the body finished meanwhile.
                        def now() -> None:
                            if not state.ended and body is not None:
                                cancelled.append(True)
                                body.cancel()

                        loop.call_soon_threadsafe(now)

                    hb = (
                        None
                        if every is None
                        else port._heartbeat(token, sent, every, limit, on_lost, cancel)
                    )
                    mark = enter_claim(token)
                    try:
                        result = await fn(*args, **kwargs)
                    except asyncio.CancelledError as exc:
                        if hb is not None:
                            hb.stop()
                        if cancelled and _uncancel(body):
                            await asyncio.to_thread(port._abandon_quietly, token)
                            raise port._lost_claim(token, hb.reason if hb else "") from None
                        await asyncio.to_thread(port._fail, plan, token, exc)
                        raise
                    except BaseException as exc:
                        if hb is not None:
                            hb.stop()
                        await asyncio.to_thread(port._fail, plan, token, exc)
                        raise
                    finally:
                        leave_claim(mark)
                    if hb is not None:
                        hb.stop()
                    await asyncio.to_thread(port._record_beat, plan, token, result, hb)
                    return result

                return cast(F, awrapper)

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

    def for_tenant(self, tenant: str) -> Coordinator:
        """A view whose records, locks and fences live in ``tenant``'s namespace only
        (the tenant also binds sealed results). It shares this coordinator's store."""
        view = Coordinator.__new__(Coordinator)
        view._view_of(self, tenant)
        return view

    def close(self) -> None:
        """Close the store's connections (a tenant view leaves them to its parent)."""
        if self._owns_store:
            self._store.close()

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class IdempotencyPort(IdempotencyBase):
    """Claim, complete and abandon keyed operations of one :class:`IdempotencySpec`."""

    _store: SyncStore

    def claim(
        self, key: str, *, payload: Any = None, lease: timedelta | float | None = None
    ) -> Claim:
        """Atomically one of ``Claimed`` (run it), ``InFlight`` (someone else is) or
        ``Completed`` (replay). Raises ``PayloadMismatch`` if the key is live with
        another payload. ``lease`` overrides the spec's lease for this claim."""
        t0 = self._t0()
        args = self._claim_args(key, payload, lease)
        try:
            reply = self._store.claim(*args)
        except Exception as exc:
            self._emit_error("claim", exc, t0)
            raise
        return self._interpret(key, reply, None, t0, args[1])

    def complete(
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
                ok = call(*args, data, self._ttl_ms, extra)
            else:
                ok = self._store.complete(*args, data, self._ttl_ms)
        except Exception as exc:
            self._emit_error("complete", exc, t0)
            raise
        self._finish_claim(token, ok, "complete", t0)

    def abandon(self, token: ClaimToken) -> None:
        """Release the claim so a retry runs the operation again."""
        t0 = self._t0()
        args = self._token_args(token)
        try:
            ok = self._store.abandon(*args)
        except Exception as exc:
            self._emit_error("abandon", exc, t0)
            raise
        self._finish_claim(token, ok, "abandon", t0)

    def extend(self, token: ClaimToken, lease: timedelta | float | None = None) -> ClaimToken:
        """Push the end of a running claim's lease to ``lease`` (default: the spec's)
        from now, for work that runs longer than planned; the fence stays. Returns the
        token with its new ``expires_at``. ``StaleClaim`` if the claim no longer holds
        its key (an expired claim is never revived)."""
        args = self._token_args(token)
        lease_ms = self._lease_ms if lease is None else to_ms(lease, "lease")
        return self._extend_token(token, self._store.extend(*args, lease_ms))

    def status(self, key: str) -> RecordStatus | None:
        """What the store holds for ``key``: None, in flight or completed, with expiry."""
        return self._status(key, self._store.record(self._ns, self._skey(key)))

    def forget(self, key: str) -> bool:
        """Delete the record of ``key`` (operators only: a retry will run again)."""
        return self._store.forget(self._ns, self._skey(key))

    def wait(
        self, key: str, *, payload: Any = None, timeout: timedelta | float | None = None
    ) -> Claim:
        """Claim, and while the key is in flight wait up to ``timeout`` (default: the
        lease) for it to complete (returns ``Completed``) or be freed (returns
        ``Claimed``: this caller must run it). Still in flight at the end: ``InFlight``."""
        t0 = self._t0()
        args = self._claim_args(key, payload)
        flow = claim_flow(*args, self._wait_for(timeout), self._coord.clock, self._coord.poll_cap)
        try:
            reply = run_sync(flow, self._store)
        except Exception as exc:
            self._emit_error("claim", exc, t0)
            raise
        return self._interpret(key, reply, None, t0, args[1])

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

    # ---- the decorator's steps -------------------------------------------------

    def _expire_callback(self, state: RenewState) -> Callable[[], None]:
        def expire() -> None:
            # On the watchdog's thread: mark at once, report on a thread of its own so
            # a slow on_lost never delays the deadlines of other claims.
            if state.mark_lost(state.expired_reason()):
                threading.Thread(
                    target=state.report_lost, name="idemlock-claim-lost", daemon=True
                ).start()

        return expire

    def _claim_at(self, key: str, payload: Any, wait: float | None) -> tuple[Claim, float]:
        """Claim (waiting up to ``wait`` while in flight): the claim and the clock's time
        its last request was sent (its heartbeat counts the local deadline from it)."""
        t0 = self._t0()
        cargs = self._claim_args(key, payload)
        clock = self._coord.clock
        try:
            if wait is None:
                sent = clock.monotonic()
                reply = self._store.claim(*cargs)
            else:
                stamp = [clock.monotonic()]
                flow = claim_flow(*cargs, wait, clock, self._coord.poll_cap, stamp)
                reply = run_sync(flow, self._store)
                sent = stamp[0]
        except Exception as exc:
            self._emit_error("claim", exc, t0)
            raise
        return self._interpret(key, reply, None, t0, cargs[1]), sent

    def _begin(
        self, plan: WrapPlan, args: Any, kwargs: Any, wait: float | None
    ) -> Claimed | Completed:
        return self._begin_at(plan, args, kwargs, wait)[0]

    def _begin_at(
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
                reply = self._store.claim(*cargs)
            else:
                stamp = [clock.monotonic()]
                flow = claim_flow(*cargs, wait, clock, self._coord.poll_cap, stamp)
                reply = run_sync(flow, self._store)
                sent = stamp[0]
        except Exception as exc:
            self._emit_error("claim", exc, t0)
            raise
        claim = self._replay_or_raise(key, reply, load, t0, cargs[1])
        return cast("Claimed | Completed", claim), sent

    def _record_beat(
        self, plan: WrapPlan, token: ClaimToken, result: Any, hb: Heartbeat | None
    ) -> None:
        """Record the body's result; a refusal after a heartbeat lost the claim is
        ``ClaimLost`` (another attempt took the key over: nothing recorded)."""
        try:
            self._record(plan, token, result)
        except StaleClaim:
            if hb is None:
                raise
            raise self._lost_claim(token, hb.reason) from None

    def _record(self, plan: WrapPlan, token: ClaimToken, result: Any) -> None:
        t0 = self._t0()
        try:
            data = self._encode(token.key, result, *plan.types())
        except BaseException:
            self._abandon_quietly(token)
            raise
        try:
            ok = self._store.complete(*self._token_args(token), data, self._ttl_ms)
        except Exception as exc:
            self._emit_error("complete", exc, t0)
            raise
        self._finish_claim(token, ok, "complete", t0)

    def _fail(self, plan: WrapPlan, token: ClaimToken, exc: BaseException) -> None:
        data = self._error_record(plan, token, exc)
        if data is None:
            self._abandon_quietly(token)
            return
        t0 = self._t0()
        try:
            ok = self._store.complete(*self._token_args(token), data, self._ttl_ms)
        except Exception as exc:
            self._emit_error("complete", exc, t0)
            raise
        self._emit("complete", "ok" if ok else "stale", t0)
        if not ok:
            log.warning("could not record the error of %r: the claim was lost", token.key)

    def _abandon_quietly(self, token: ClaimToken) -> None:
        # The operation failed; its error matters more than a failed abandon (the
        # lease frees the key anyway).
        t0 = self._t0()
        try:
            ok = self._store.abandon(*self._token_args(token))
            self._emit("abandon", "ok" if ok else "stale", t0)
        except Exception as exc:
            self._emit_error("abandon", exc, t0)
            log.warning(
                "could not abandon claim on %r; it frees itself when its lease ends",
                token.key,
                exc_info=True,
            )


def _uncancel(task: asyncio.Task[Any] | None) -> bool:
    """Take back our own cancellation of the body (claim lost); True if it was ours
    alone (nobody else cancelled the task too)."""
    uncancel = getattr(task, "uncancel", None)
    if uncancel is None:  # Python 3.10: no count of cancellations to consult
        return True
    return bool(uncancel() == 0)


class LockPort(LockBase):
    """Fenced leases of one :class:`LockSpec`."""

    _store: SyncStore

    def acquire(
        self, key: str, *, owner: str | None = None, wait: timedelta | float | None = None
    ) -> Lease | None:
        """Take the lock, waiting up to ``wait``; None if it stayed held. Acquiring a
        key the same ``owner`` holds returns that lease again (same token)."""
        t0 = self._t0()
        who = self._owner(owner)
        wait_s = seconds(wait, "wait")
        if not wait_s:
            # No waiting: one call, no flow to drive.
            sent = self._coord.clock.monotonic()
            try:
                reply = self._store.acquire(self._ns, validate_key(key), who, self._ttl_ms)
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
            result = run_sync(flow, self._store)
        except Exception as exc:
            self._emit_error("acquire", exc, t0)
            raise
        return self._finish_acquire(key, who, result, t0)

    def release(self, lease: Lease) -> bool:
        """Free the lock if this lease still holds it; False if it had expired or was
        released already (releasing twice is harmless)."""
        t0 = self._t0()
        args = self._release_args(lease)
        if args is None:
            return self._finish_release(lease, False, t0)
        try:
            ok = self._store.release(*args)
        except Exception as exc:
            self._emit_error("release", exc, t0)
            raise
        return self._finish_release(lease, ok, t0)

    def break_lock(self, key: str, *, token: int | None = None) -> bool:
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
                ok = self._store.break_lock(ns, skey)
            else:
                held = self._break_guarded(self._store.lock(ns, skey), guard)
                ok = held is not None and self._store.release(ns, skey, *held)
        except Exception as exc:
            self._emit_error("break", exc, t0)
            raise
        return self._finish_break(ok, t0)

    def renew(self, lease: Lease, ttl: timedelta | float | None = None) -> bool:
        """Reset the lease to ``ttl`` (default: the spec's) from now; the token stays.
        False (and ``lease.lost``) if the lease had already expired."""
        t0 = self._t0()
        args = self._check_lease(lease, "renew")
        ttl_ms = self._renew_ttl(ttl)
        sent = self._coord.clock.monotonic()
        try:
            new_exp = self._store.renew(*args, ttl_ms)
        except Exception as exc:
            self._emit_error("renew", exc, t0)
            raise
        return self._finish_renew(lease, sent, ttl_ms, new_exp, t0)

    def is_locked(self, key: str) -> bool:
        return self._store.lock(self._ns, validate_key(key)) is not None

    def owner(self, key: str) -> str | None:
        return self._row_owner(self._store.lock(self._ns, validate_key(key)))

    def ttl(self, key: str) -> timedelta | None:
        """Time left on the current holder's lease (None if free)."""
        return self._row_ttl(self._store.lock(self._ns, validate_key(key)))

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
        assert lease.token is not None
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
                "leaving hold() of lock %s:%s without its release: the store did not "
                "answer within %gs (its timeout); the lock is released when it answers, "
                "or frees itself when its lease ends",
                self.spec.name,
                lease.key,
                bound,
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
                "could not release lock on %r; it frees itself when its lease ends",
                lease.key,
                exc_info=True,
            )


class FenceGate(FenceBase):
    """Accepts fencing tokens at least as high as the highest accepted for a resource."""

    _store: SyncStore

    def check_and_advance(self, token: int) -> int:
        """Accept ``token`` (it becomes the highest) or raise ``FencedOut``, changing nothing."""
        token = check_token(token)
        ok, highest = self._store.fence_advance(self._ns, self.resource, token)
        if not ok:
            raise FencedOut(self.resource, token, highest)
        return highest

    def set_if_fresh(self, token: int, key: str, value: bytes | str) -> int:
        """Atomically accept ``token`` (as ``check_and_advance``) and, only if it is
        accepted, write ``value`` at ``key`` in the store itself (Redis). Raises
        ``FencedOut`` and writes nothing for a stale token."""
        token = check_token(token)
        fence_set = self._fence_set()
        data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
        ok, highest = fence_set(self._ns, self.resource, token, key, data)
        if not ok:
            raise FencedOut(self.resource, token, highest)
        return int(highest)

    def current(self) -> int | None:
        """The highest token accepted so far (None before the first)."""
        return self._store.fence_current(self._ns, self.resource)
