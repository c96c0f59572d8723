"""The asyncio API: :func:`connect` returns an :class:`AsyncCoordinator` with the
same surface as :class:`idemlock.Coordinator`, its I/O methods being coroutines."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ._base.coordinator import CoordinatorBase
from ._base.fence import FenceBase
from ._base.idempotency import Heartbeat
from ._core.clock import MAX_SECONDS, Clock, duration, whole_ms
from ._core.codec import COMPRESS_OVER, MAX_RESULT_BYTES
from ._core.events import Hook, answered
from ._core.flows import acquire_flow, claim_flow
from ._core.jsontypes import JSONValue
from ._core.keys import validate_key
from ._core.port import AsyncStore, Channel, ClaimReply
from ._core.types import (
    Claim,
    Claimed,
    ClaimToken,
    Completed,
    ElectionSpec,
    IdempotencySpec,
    Leader,
    Lease,
    LockInfo,
    LockSpec,
    RecordStatus,
    SemaphoreSpec,
)
from ._decorator import Wrapping, WrapPlan, heartbeat_options, wrap_options
from ._drive import run_async
from ._errors import (
    FencedOut,
    LockLost,
    StaleClaim,
)
from ._logfields import port_fields
from ._renewer import AsyncRenewer
from ._tasks import AsyncAttempt, IdempotencyRun, LockHold, decorator
from ._tokens import check_token
from ._watchdog import AsyncWatchdog

if TYPE_CHECKING:
    from ._keyring import Keyring  # hmac and hashlib load with it, on first use

F = TypeVar("F", bound=Callable[..., Any])

# sync-only: __all__ = [
# sync-only:     "Coordinator", "ElectionPort", "FenceGate", "IdempotencyPort", "LockPort",
# sync-only:     "SemaphorePort", "Term", "connect",
# sync-only: ]
__all__ = [  # async-only
    "AsyncAttempt",
    "AsyncCoordinator",
    "AsyncElectionPort",
    "AsyncFenceGate",
    "AsyncIdempotencyPort",
    "AsyncLockPort",
    "AsyncSemaphorePort",
    "AsyncTerm",
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
    """Open an :class:`AsyncCoordinator` on a store.

    ``url`` is ``memory://``, ``sqlite:///path/to/file.db``, ``redis://...``,
    ``rediss://...``, ``unix://...``, ``redis+cluster://h:p[,h:p...]``,
    ``postgresql://...``; or an existing redis-py client or psycopg_pool pool. None
    means ``$IDEMLOCK_URL``, else SQLite in the user's state directory. Store options
    (``max_keys=``, ``clock=`` for memory; ``busy_timeout=`` for SQLite; ...) are
    passed as keywords. ``key_prefix`` namespaces everything this coordinator stores.
    (``url`` and the store options are typed ``Any``: a client object of whichever
    store library, and each store's own options, checked when the store opens.)

    ``keyring`` seals results of specs with ``encrypt_result=True`` and stores keys and
    payload fingerprints as HMACs; ``tenant`` puts everything in one tenant's namespace
    (see also ``AsyncCoordinator.for_tenant``). Results larger than ``max_result_bytes``
    (stored, after compression) raise ``ResultTooLarge``; bodies over ``compress_over``
    bytes are zlib-compressed (None: never). ``hooks`` receive an :class:`Event` for
    every outcome (metrics, tracing).
    """
    from ._urls import open_store

    store, clock, shown = open_store(url, asynchronous=True, **options)  # async-only
    # sync-only: store, clock, shown = open_store(url, asynchronous=False, **options)
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

    def election(self, spec: ElectionSpec | str) -> AsyncElectionPort:
        """The leader-election port of one family of elections."""
        return AsyncElectionPort(self, self._election_spec(spec))

    def semaphore(self, spec: SemaphoreSpec) -> AsyncSemaphorePort:
        """The fenced-permit port of one family of semaphores (up to ``spec.limit``
        holders per key)."""
        return AsyncSemaphorePort(self, self._semaphore_spec(spec))

    def fence(self, resource: str) -> AsyncFenceGate:
        """The gate that guards one resource with fencing tokens."""
        return AsyncFenceGate(self, resource)

    async def keys(self) -> list[RecordStatus]:
        """Every live idempotency record under this coordinator's prefix: the root's
        listing covers its tenants' too, each row naming its ``tenant`` and ``spec``. A
        value the store cannot read is listed with state ``"corrupt"`` (and a warning)."""
        return [self._record_status(r) for r in await self._store.records(self._ns_prefix())]

    async def purge(self, *, dry_run: bool = False) -> int:
        """Delete expired records and locks from the store; returns how many went.
        With ``dry_run=True`` nothing is deleted: returns how many would go."""
        return await self._store.purge(dry_run)

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
        """Make a function idempotent: claim, run, complete; replay on a retry.

        ``key`` is a callable of the call's arguments returning the idempotency key;
        None uses the fingerprint of the canonical arguments. The canonical arguments
        are always the payload, so reusing a key with other arguments raises
        :class:`~idemlock.PayloadMismatch`. The return annotation decides how the
        result is stored and restored on replay. An exception of a type listed in
        ``replay_errors`` is recorded and raised again on every replay; any other
        exception abandons the claim (a retry runs again) and propagates. Works on
        ``async def`` functions.

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
        return decorator(Wrapping(port, key, replay_errors, wait_s, every, limit, on_lost))

    def for_tenant(self, tenant: str) -> AsyncCoordinator:
        """A view whose records, locks and fences live in ``tenant``'s namespace only
        (the tenant also binds sealed results). It shares this coordinator's store."""
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


class AsyncIdempotencyPort(IdempotencyRun):
    """Claim, complete and abandon keyed operations of one :class:`IdempotencySpec`."""

    _store: AsyncStore

    async def claim(
        self, key: str, *, payload: JSONValue = None, lease: timedelta | float | None = None
    ) -> Claim:
        """Atomically one of ``Claimed`` (run it), ``InFlight`` (someone else is) or
        ``Completed`` (replay). Raises ``PayloadMismatch`` if the key is live with
        another payload. ``lease`` overrides the spec's lease for this claim."""
        t0 = self._events.t0()
        args = self._claim_args(key, payload, lease)
        try:
            reply = await self._store.claim(*args)
        except Exception as exc:
            self._events.error("claim", exc, t0)
            raise
        return self._replies.interpret(key, reply, None, t0, args[1])

    async def complete(
        self,
        token: ClaimToken,
        result: JSONValue,
        *,
        writes: Mapping[str, bytes | str] | None = None,
    ) -> None:
        """Record ``result`` (JSON data) for the spec's ttl. ``StaleClaim`` if the token
        lost its key; ``ResultEncodeError`` (nothing stored) if JSON cannot hold it.

        ``writes`` (Redis): keys of the store to SET in the same atomic step, so the
        job's effects and its record commit together or not at all (on PostgreSQL use
        ``complete_in_transaction`` for the same)."""
        t0 = self._events.t0()
        args = self._token_args(token)
        data = self._records.encode(token.key, result)
        call = self._complete_with() if writes else None
        extra = self._writes(writes) if writes else None
        try:
            if call is not None:
                ok = await call(*args, data, self._ttl_ms, extra)
            else:
                ok = await self._store.complete(*args, data, self._ttl_ms)
        except Exception as exc:
            self._events.error("complete", exc, t0)
            raise
        self._replies.finish_claim(token, ok, "complete", t0)

    async def abandon(self, token: ClaimToken) -> None:
        """Release the claim so a retry runs the operation again."""
        t0 = self._events.t0()
        args = self._token_args(token)
        try:
            ok = await self._store.abandon(*args)
        except Exception as exc:
            self._events.error("abandon", exc, t0)
            raise
        self._replies.finish_claim(token, ok, "abandon", t0)

    async def extend(self, token: ClaimToken, lease: timedelta | float | None = None) -> ClaimToken:
        """Push the end of a running claim's lease to ``lease`` (default: the spec's)
        from now, for work that runs longer than planned; the fence stays. Returns the
        token with its new ``expires_at``. ``StaleClaim`` if the claim no longer holds
        its key (an expired claim is never revived)."""
        args = self._token_args(token)
        lease_ms = (
            self._lease_ms if lease is None else whole_ms(duration(lease, "lease", positive=True))
        )
        return self._replies.extend_token(token, await self._store.extend(*args, lease_ms))

    async def status(self, key: str) -> RecordStatus | None:
        """What the store holds for ``key``: None, in flight or completed, with expiry
        and, on a store that records steps, the operation's recorded steps."""
        # Any: steps() is an optional method (capability steps), not in the store protocol
        skey, store = self._skey(key), cast(Any, self._store)
        row = await store.record(self._ns, skey)
        if row is None or not store.capabilities.steps:
            return self._replies.status(key, row)
        return self._replies.status(key, row, await store.steps(self._ns, skey))

    async def forget(self, key: str) -> bool:
        """Delete the record of ``key`` (operators only: a retry will run again)."""
        return await self._store.forget(self._ns, self._skey(key))

    async def wait(
        self, key: str, *, payload: JSONValue = None, timeout: timedelta | float | None = None
    ) -> Claim:
        """Claim, and while the key is in flight wait up to ``timeout`` (default: the
        lease) for it to complete (returns ``Completed``) or be freed (returns
        ``Claimed``: this caller must run it). Still in flight at the end: ``InFlight``."""
        t0 = self._events.t0()
        args = self._claim_args(key, payload)
        flow = claim_flow(*args, self._wait_for(timeout), self._coord.poll_cap)
        try:
            reply = await run_async(flow, self._store, clock=self._coord.clock)
        except Exception as exc:
            self._events.error("claim", exc, t0)
            raise
        return self._replies.interpret(key, reply, None, t0, args[1])

    # ---- the decorator's steps -------------------------------------------------

    async def _send_claim(
        self, cargs: tuple[str, str, str | None, str, int], wait: float | None, t0: float
    ) -> tuple[ClaimReply, float]:
        """Claim (waiting up to ``wait`` while in flight): the store's reply and the
        clock's time its last request was sent (its heartbeat counts the local deadline
        from it)."""
        clock = self._coord.clock
        try:
            if wait is None:
                sent = clock.monotonic()
                reply = await self._store.claim(*cargs)
            else:
                stamp = [clock.monotonic()]
                flow = claim_flow(*cargs, wait, self._coord.poll_cap, stamp)
                reply = await run_async(flow, self._store, clock=clock)
                sent = stamp[0]
        except Exception as exc:
            self._events.error("claim", exc, t0)
            raise
        return reply, sent

    async def _claim_at(self, key: str, payload: Any, wait: float | None) -> tuple[Claim, float]:
        """Claim (waiting up to ``wait`` while in flight): the claim and the time its
        last request was sent."""
        t0 = self._events.t0()
        cargs = self._claim_args(key, payload)
        reply, sent = await self._send_claim(cargs, wait, t0)
        return self._replies.interpret(key, reply, None, t0, cargs[1]), sent

    async def _begin_at(
        self,
        plan: WrapPlan,
        args: Any,
        kwargs: Any,
        wait: float | None,
        wait_with: str | None = None,
    ) -> tuple[Claimed | Completed, float]:
        """Claim or replay a call of ``plan``'s function; ``InFlightError`` (naming
        ``wait_with``, the caller's setting to wait, if it has one) while in flight."""
        t0 = self._events.t0()
        key, payload = plan.key_payload(args, kwargs)
        _, load = plan.types()
        cargs = self._claim_args(key, payload)
        reply, sent = await self._send_claim(cargs, wait, t0)
        claim = self._replies.replay_or_raise(key, reply, load, t0, cargs[1], wait, wait_with)
        if isinstance(claim, Completed):
            # Here, where the key is known: a recorded error it cannot raise again
            # names the record to forget.
            plan.check_replayable(claim, key, self.spec.name)
        return cast("Claimed | Completed", claim), sent

    async def _record_beat(
        self, plan: WrapPlan, token: ClaimToken, result: Any, hb: Heartbeat | None
    ) -> None:
        """Record the body's result; a refusal after a heartbeat lost the claim is
        ``ClaimLost`` (another attempt took the key over: nothing recorded)."""
        try:
            await self._record(plan, token, result)
        except StaleClaim:
            if hb is None:
                raise
            raise self._replies.lost_claim(token, hb.reason) from None

    async def _record(self, plan: WrapPlan, token: ClaimToken, result: Any) -> None:
        t0 = self._events.t0()
        try:
            data = self._records.encode(token.key, result, *plan.types())
        except BaseException:
            await self._abandon_quietly(token)
            raise
        try:
            ok = await self._store.complete(*self._token_args(token), data, self._ttl_ms)
        except Exception as exc:
            self._events.error("complete", exc, t0)
            raise
        self._replies.finish_claim(token, ok, "complete", t0)

    async def _fail(self, plan: WrapPlan, token: ClaimToken, exc: BaseException) -> None:
        data = self._error_record(plan, token, exc)
        if data is None:
            await self._abandon_quietly(token)
            return
        t0 = self._events.t0()
        try:
            ok = await self._store.complete(*self._token_args(token), data, self._ttl_ms)
        except Exception as exc:
            self._events.error("complete", exc, t0)
            raise
        self._events.emit("complete", answered("complete", ok), t0)
        if not ok:
            log.warning(
                "could not record the error of a %s call: the claim was lost",
                self.spec.name,
                extra=port_fields(self, "complete", "stale"),
            )

    async def _abandon_quietly(self, token: ClaimToken) -> None:
        # The operation failed; its error matters more than a failed abandon (the
        # lease frees the key anyway).
        t0 = self._events.t0()
        try:
            ok = await self._store.abandon(*self._token_args(token))
            self._events.emit("abandon", answered("abandon", ok), t0)
        except Exception as exc:
            self._events.error("abandon", exc, t0)
            log.warning(
                "could not abandon a claim of spec %s; it frees itself when its lease ends",
                self.spec.name,
                exc_info=True,
                extra=port_fields(self, "abandon", "error"),
            )


class AsyncLockPort(LockHold):
    """Fenced leases of one :class:`LockSpec`."""

    _store: AsyncStore

    async def acquire(
        self,
        key: str,
        *,
        owner: str | None = None,
        wait: timedelta | float | None = None,
        value: str | None = None,
    ) -> Lease | None:
        """Take the lock, waiting up to ``wait``; None if it stayed held. Acquiring a
        key the same ``owner`` holds returns that lease again (same token). ``value``
        is published with the lease (an address, a host name: at most 4 KiB), listed
        by ``locks()`` and, for an election, ``leader()``."""
        t0 = self._events.t0()
        who = self._owner(owner)
        data = self._value(value)
        wait_s = None if wait is None else duration(wait, "wait")
        if not wait_s:
            # No waiting: one call, no flow to drive.
            sent = self._coord.clock.monotonic()
            try:
                reply = await self._store.acquire(
                    self._ns, validate_key(key), who, self._ttl_ms, self._limit, data
                )
            except Exception as exc:
                self._events.error("acquire", exc, t0)
                raise
            return self._finish_acquire(key, who, (reply, sent, 1), t0)
        waits = self._waits()
        flow = acquire_flow(
            self._ns,
            validate_key(key),
            who,
            self._ttl_ms,
            wait_s,
            self._coord.poll_cap,
            self._limit,
            data,
            None if waits is None else waits.start,
        )
        try:
            try:
                result = await run_async(flow, self._store, clock=self._coord.clock)
            finally:
                if waits is not None:
                    waits.end()  # also when cancelled: the waiter is gone
        except Exception as exc:
            self._events.error("acquire", exc, t0)
            raise
        return self._finish_acquire(key, who, result, t0)

    async def release(self, lease: Lease) -> bool:
        """Free the lock if this lease still holds it; False if it had expired or was
        released already (releasing twice is harmless)."""
        t0 = self._events.t0()
        args = self._release_args(lease)
        if args is None:
            return self._finish_release(lease, False, t0)
        try:
            ok = await self._store.release(*args)
        except Exception as exc:
            self._events.error("release", exc, t0, lease.token)
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
        t0 = self._events.t0()
        ns, skey, guard = self._break_args(key, token)
        try:
            ok = await self._store.break_lock(ns, skey, guard)
        except Exception as exc:
            self._events.error("break", exc, t0)
            raise
        return self._finish_break(ok, t0)

    async def renew(self, lease: Lease, ttl: timedelta | float | None = None) -> bool:
        """Reset the lease to ``ttl`` (default: the spec's) from now; the token stays.
        False (and ``lease.lost``) if the lease had already expired."""
        t0 = self._events.t0()
        args = self._check_lease(lease, "renew")
        ttl_ms = self._renew_ttl(ttl)
        sent = self._coord.clock.monotonic()
        try:
            new_exp = await self._store.renew(*args, ttl_ms)
        except Exception as exc:
            self._events.error("renew", exc, t0)
            raise
        return self._finish_renew(lease, sent, ttl_ms, new_exp, t0)

    async def is_locked(self, key: str) -> bool:
        return await self._store.lock(self._ns, validate_key(key)) is not None

    async def owner(self, key: str) -> str | None:
        return self._row_owner(await self._store.lock(self._ns, validate_key(key)))

    async def ttl(self, key: str) -> timedelta | None:
        """Time left on the current holder's lease (None if free)."""
        return self._row_ttl(await self._store.lock(self._ns, validate_key(key)))


class AsyncSemaphorePort(AsyncLockPort):
    """Fenced permits of one :class:`SemaphoreSpec`: up to ``spec.limit`` holders per
    key, each with its own lease and fencing token. ``acquire``, ``renew``,
    ``release`` and ``hold`` are the lock's (a lock is the one-permit case of the same
    rows): waiters are served in arrival order, woken by notification."""

    spec: SemaphoreSpec

    async def holders(self, key: str) -> list[LockInfo]:
        """The live permits of ``key``, lowest token first."""
        return self._holders(await self._store.holders(self._ns, validate_key(key)))

    async def available(self, key: str) -> int:
        """How many more holders ``key`` admits now under this spec's limit (0 when
        full, also when a lowered limit is still draining)."""
        held = await self._store.holders(self._ns, validate_key(key))
        return max(0, self._limit - len(held))

    async def break_permit(self, key: str, token: int) -> bool:
        """Free the one permit of ``key`` with ``token`` (an operator's forced release,
        as listed by ``holders()``); True if it was held. The token counter is kept:
        the freed holder's renew and release fail, its ``hold()`` reports the loss, and
        its late writes through a fence gate are refused."""
        return await self.break_lock(key, token=token)


class AsyncTerm:
    """One term of an election's leader, yielded by ``campaign()``. ``number`` is the
    term's fencing token (strictly increasing over the key's terms: pass it to fenced
    writes); ``lost`` turns True when the term ends under the leader."""

    __slots__ = ("_port", "lease", "value")

    def __init__(self, port: AsyncElectionPort, lease: Lease, value: str | None) -> None:
        self._port = port
        #: the lease the term is
        self.lease = lease
        #: the value the leader publishes
        self.value = value

    @property
    def number(self) -> int:
        return self.lease.token

    @property
    def key(self) -> str:
        return self.lease.key

    @property
    def lost(self) -> bool:
        return self.lease.lost

    def remaining(self) -> timedelta:
        """Time the leader may still rely on the term (zero once lost)."""
        return self.lease.remaining()

    async def proclaim(self, value: str) -> None:
        """Publish a new ``value`` in the same term (observers see it); raises
        ``LockLost`` if the term is over."""
        await self._port._proclaim(self, value)

    def __repr__(self) -> str:
        return f"Term(key={self.key!r}, number={self.number}, value={self.value!r})"


class AsyncElectionPort(AsyncLockPort):
    """Leader election over one :class:`ElectionSpec`: a lock whose holder publishes a
    value. ``campaign()`` waits its turn in arrival order and holds the term while the
    block runs (renewed in the background; lost as a ``hold()`` is lost);
    ``leader()`` and ``observe()`` tell everyone who leads."""

    @asynccontextmanager
    async def campaign(
        self,
        key: str,
        *,
        value: str | None = None,
        wait: timedelta | float | None = None,
        owner: str | None = None,
        renew_every: timedelta | float | None = None,
        on_lost: Callable[[Lease], object] | None = None,
    ) -> AsyncIterator[AsyncTerm]:
        """Become the leader of ``key`` and stay it for the block: waits until elected
        (``wait=None``) or up to ``wait`` (then ``LockNotAcquired``). Leaving the block
        ends the term; a term lost meanwhile raises ``LockLost`` on leaving (and, on the
        asyncio face, cancels the body)."""
        async with self.hold(
            key,
            wait=MAX_SECONDS if wait is None else wait,
            renew_every=renew_every,
            owner=owner,
            on_lost=on_lost,
            value=value,
        ) as lease:
            yield AsyncTerm(self, lease, value)

    async def leader(self, key: str) -> Leader | None:
        """The current leader of ``key`` (None between terms)."""
        return self._leader(await self._store.lock(self._ns, validate_key(key)))

    async def observe(
        self, key: str, *, timeout: timedelta | float = 60.0
    ) -> AsyncIterator[Leader | None]:
        """Every change of ``key``'s leader or its value, in term order, starting with
        the current state; None when a term ends without a successor. A slow reader
        gets the latest state, not a backlog. Stops after ``timeout`` or when the
        caller breaks out."""
        skey = validate_key(key)
        clock = self._coord.clock
        end = clock.monotonic() + duration(timeout, "timeout")
        every = self._observe_every()
        sub = await self._store.subscribe(Channel("leader", self._ns, skey))
        try:
            last: tuple[int, str | None] | None = (0, None)
            while True:
                leader = self._leader(await self._store.lock(self._ns, skey))
                seen = None if leader is None else (leader.term, leader.value)
                if seen != last:
                    last = seen
                    yield leader
                left = end - clock.monotonic()
                if left <= 0:
                    return
                await sub.wait(min(left, every))
        finally:
            await sub.aclose()

    async def _proclaim(self, term: AsyncTerm, value: str) -> None:
        data = self._value(value)
        args = self._check_lease(term.lease, "proclaim in")
        sent = self._coord.clock.monotonic()
        new_exp = await self._store.renew(*args, self._ttl_ms, data)
        if not self._finish_renew(term.lease, sent, self._ttl_ms, new_exp):
            raise LockLost(self._lost_message(term.lease, "the store ended the term"))
        term.value = value


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
