"""The in-memory store: one process, thread- and task-safe, for tests and single workers.

Every transition is one critical section under a lock, applying the rows of the state
table (:mod:`idemlock._core.table`, ``docs/states.md``) to the current record.
Waiters are woken by an in-process hub. Time comes from an injectable
:class:`~idemlock.Clock`, so tests can cross an expiry without sleeping.

Locks are handed off in arrival order: an owner that waits (its channel has a
subscriber and it asked more than once) is queued per key. Once the lock is free, the
oldest queued owner is chosen and the lock is ``reserved`` for it for
:data:`HANDOFF_MS` (rows ``lock.handoff`` / ``lock.handoff.take``): nobody else, the
releasing thread included, can barge in. A chosen owner that does not come within its
window loses its turn; a registration lapses shortly after its owner's last attempt,
and a key's queue is dropped when nobody is subscribed to it any more.
"""

from __future__ import annotations

import threading
from dataclasses import replace
from typing import Any

from .._clock import SYSTEM_CLOCK
from .._core import table as T
from .._core.clock import Clock, duration
from .._core.port import (
    Acquired,
    Capabilities,
    Channel,
    ClaimReply,
    Held,
    LockRow,
    RecordRow,
    StepRow,
)
from .._errors import ConfigurationError, StoreFull, StoreUnavailable
from ._adapt import ThreadedAsyncStore
from ._local import LocalHub, LocalSubscription

__all__ = ["MemoryStore"]

#: rows that free a key: their waiters are woken (a hint; they re-check). forget
#: notifies whatever it found, as the other stores do
_FREES_CLAIM = frozenset(
    {"complete.ok", "complete.late", "abandon.ok", "abandon.late", "forget.live", "forget.dead"}
)
_FREES_LOCK = frozenset({"lock.release", "lock.break"})

#: seconds, agreement A1's default bound on one store call
DEFAULT_TIMEOUT = 5.0
#: what a bad timeout is called in the error
_TIMEOUT = "the memory store option timeout"

#: ms a free lock stays reserved for the chosen waiter (it is woken at once; the window
#: only bounds what a waiter that left costs the others)
HANDOFF_MS = 100
#: ms a registration outlives the wait its owner was told to do (a loaded machine's
#: scheduling delay), after which the owner counts as gone
REGISTER_SLACK_MS = 250


class _Queue:
    """The waiters of one lock key, oldest first, and the reservation if any."""

    __slots__ = ("chosen", "until", "waiters")

    def __init__(self) -> None:
        #: owner -> [registration expiry ms, attempts]; dict order is arrival order
        self.waiters: dict[str, list[int]] = {}
        self.chosen: str | None = None
        self.until = 0  # the reservation's end, ms


class _BoundedLock:
    """The store's one lock; entering it waits at most ``timeout`` (agreement A1), so a
    call stuck behind a stalled holder raises StoreUnavailable instead of hanging."""

    __slots__ = ("_lock", "timeout")

    def __init__(self, timeout: float) -> None:
        self._lock = threading.Lock()
        self.timeout = timeout

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> None:
        if not self._lock.acquire(True, self.timeout):
            raise StoreUnavailable(
                f"the memory store did not answer within timeout={self.timeout:g}s: "
                "another thread held it all that time; nothing was changed"
            )

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class MemoryStore:
    """Records, locks and fences in a dict. ``max_keys`` bounds records plus locks;
    when full, expired entries are dropped and, if none were, ``StoreFull`` is raised
    (a recorded result is never evicted early)."""

    kind = "memory"
    #: one process: its condition variables wake every waiter there is
    capabilities = Capabilities(handoff=True, renew_many=True, steps=True)

    def __init__(
        self,
        *,
        clock: Clock = SYSTEM_CLOCK,
        max_keys: int | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        if max_keys is not None and (
            isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1
        ):
            raise ConfigurationError(f"max_keys must be a positive int or None, got {max_keys!r}")
        #: the bound on one call (agreement A1). Memory calls never wait on a network,
        #: only on each other's short critical sections; the coordinator bounds what it
        #: waits for by it (leaving a ``hold()`` block).
        self.timeout = duration(timeout, _TIMEOUT, positive=True, text=True)
        self._clock = clock
        self._max_keys = max_keys
        self._lock = _BoundedLock(self.timeout)
        self._claims: dict[tuple[str, str], T.ClaimRec] = {}
        #: the recorded steps of a claim key, kept apart from its record (table.Steps)
        self._steps: dict[tuple[str, str], T.Steps] = {}
        self._locks: dict[tuple[str, str], T.LockRec] = {}
        self._fences: dict[tuple[str, str], int] = {}
        self._counter = 0
        self._hub = LocalHub()
        self._queues: dict[tuple[str, str], _Queue] = {}

    def _now(self) -> int:
        return int(self._clock.time() * 1000)

    def _next_fence(self) -> int:
        self._counter += 1
        return self._counter

    def _make_room(self, now: int) -> None:
        # Called with the lock held, before adding a new key.
        if self._max_keys is None or len(self._claims) + len(self._locks) < self._max_keys:
            return
        for k in [k for k, rec in self._claims.items() if rec.expires_ms <= now]:
            del self._claims[k]
        for k in [k for k, lrec in self._locks.items() if not lrec.alive(now)]:
            del self._locks[k]
        for k in [k for k, st in self._steps.items() if st.until_ms <= now]:
            del self._steps[k]
        if len(self._claims) + len(self._locks) >= self._max_keys:
            raise StoreFull(
                f"the memory store holds {self._max_keys} live keys (max_keys) and none has "
                "expired; raise max_keys, shorten ttl, or forget records you no longer need"
            )

    # ---- idempotency -----------------------------------------------------------

    def _claim_op(self, op: str, ns: str, key: str, **args: Any) -> Any:
        """Apply the table's row for ``op`` to the record of (ns, key); notify waiters
        when it freed the key."""
        k = (ns, key)
        with self._lock:
            now = self._now()
            rec = self._claims.get(k)
            if op == "claim" and not T.live(rec, now):
                self._make_room(now)
            row, new, reply = T.apply_claim(op, rec, now, args, self._next_fence)
            if new is not rec:
                if new is None:
                    self._claims.pop(k, None)
                else:
                    self._claims[k] = new
            if k in self._steps:
                reply = self._steps_after(k, row, new, reply, now)
            if row.id in _FREES_CLAIM:
                self._hub.notify(("claim", ns, key))
            return reply

    def _steps_after(
        self, k: tuple[str, str], row: T.Row, rec: T.ClaimRec | None, reply: Any, now: int
    ) -> Any:
        """What a claim operation does to the key's steps: a grant carries them, a
        completion keeps them as long as its record, forget drops them."""
        steps = T.live_steps(self._steps[k], now)
        if steps is None or row.op == "forget":
            del self._steps[k]
        elif row.reply is T.GRANTED:
            return replace(reply, steps=steps.rows())
        elif row.next == "completed" and rec is not None:
            steps.until_ms = rec.expires_ms
        return reply

    def step(
        self,
        ns: str,
        key: str,
        token: str,
        name: str,
        result: bytes | None,
        lease_ms: int,
        ttl_ms: int,
    ) -> int | None:
        """Rows step.record / step.stale: the claim's new expiry, or None."""
        args = {"token": token, "name": name, "lease_ms": lease_ms, "ttl_ms": ttl_ms}
        args["result"] = None if result is None else bytes(result)
        return self._step_op("step", ns, key, args)

    def drop_step(self, ns: str, key: str, token: str, name: str, lease_ms: int) -> int | None:
        """Rows step.drop / step.drop.stale: the claim's new expiry, or None."""
        return self._step_op(
            "unstep", ns, key, {"token": token, "name": name, "lease_ms": lease_ms}
        )

    def _step_op(self, op: str, ns: str, key: str, args: dict[str, Any]) -> int | None:
        k = (ns, key)
        with self._lock:
            now = self._now()
            _, rec, steps, exp = T.apply_step(
                op, self._claims.get(k), self._steps.get(k), now, args
            )
            if exp is not None:
                assert rec is not None
                self._claims[k] = rec
                if steps is None:
                    self._steps.pop(k, None)
                else:
                    self._steps[k] = steps
            return exp

    def steps(self, ns: str, key: str) -> list[StepRow]:
        with self._lock:
            steps = T.live_steps(self._steps.get((ns, key)), self._now())
            return [] if steps is None else list(steps.rows())

    def claim(self, ns: str, key: str, fp: str | None, token: str, lease_ms: int) -> ClaimReply:
        reply: ClaimReply = self._claim_op("claim", ns, key, fp=fp, token=token, lease_ms=lease_ms)
        return reply

    def complete(self, ns: str, key: str, token: str, result: bytes, ttl_ms: int) -> bool:
        return bool(
            self._claim_op("complete", ns, key, token=token, result=bytes(result), ttl_ms=ttl_ms)
        )

    def abandon(self, ns: str, key: str, token: str) -> bool:
        return bool(self._claim_op("abandon", ns, key, token=token))

    def extend(self, ns: str, key: str, token: str, lease_ms: int) -> int | None:
        exp: int | None = self._claim_op("extend", ns, key, token=token, lease_ms=lease_ms)
        return exp

    def renew_many(self, items: list[tuple[Any, ...]]) -> list[int | None]:
        """Renew many claims and leases in one critical section (the batched renewal of
        a coordinator's renewer): ``("claim", ns, key, token, lease_ms)`` extends a
        claim, ``("lock", ns, key, owner, token, ttl_ms)`` renews a lease. Each answer
        is the new expiry (store ms) or None where the store no longer holds it."""
        out: list[int | None] = []
        with self._lock:
            now = self._now()
            for item in items:
                if item[0] == "claim":
                    _, ns, key, token, lease_ms = item
                    args = {"token": token, "lease_ms": int(lease_ms)}
                    row, new, exp = T.apply_claim(
                        "extend", self._claims.get((ns, key)), now, args, self._next_fence
                    )
                    if row.reply is T.OK and new is not None:
                        self._claims[(ns, key)] = new
                else:
                    _, ns, key, owner, token, ttl_ms = item
                    args = {"owner": owner, "token": token, "ttl_ms": int(ttl_ms)}
                    row, lnew, exp = T.apply_lock(
                        "renew", self._locks.get((ns, key)), now, args, self._next_fence
                    )
                    if row.reply is T.OK and lnew is not None:
                        self._locks[(ns, key)] = T.LockRec(lnew.holders)
                out.append(exp)
        return out

    def record(self, ns: str, key: str) -> RecordRow | None:
        with self._lock:
            rec = self._claims.get((ns, key))
            if rec is None or not T.live(rec, self._now()):
                return None
            return RecordRow(ns, key, rec.state, rec.fence, rec.expires_ms)

    def forget(self, ns: str, key: str) -> bool:
        return bool(self._claim_op("forget", ns, key))

    def records(self, ns_prefix: str) -> list[RecordRow]:
        with self._lock:
            now = self._now()
            return [
                RecordRow(ns, key, rec.state, rec.fence, rec.expires_ms)
                for (ns, key), rec in self._claims.items()
                if ns.startswith(ns_prefix) and rec.expires_ms > now
            ]

    # ---- locks -----------------------------------------------------------------

    def _lock_op(self, op: str, ns: str, key: str, **args: Any) -> Any:
        k = (ns, key)
        with self._lock:
            now = self._now()
            rec = self._locks.get(k)
            q = self._queues.get(k)
            if op == "acquire":
                alive = {} if rec is None else rec.alive(now)
                if q is not None and len(alive) < args["limit"] and args["owner"] not in alive:
                    self._reserve(k, q, now)  # room: the oldest waiter's turn first
                    q = self._queues.get(k)
                if rec is None:
                    self._make_room(now)
            view = T.LockRec(
                {} if rec is None else rec.holders,
                None if q is None else q.chosen,
                0 if q is None else q.until,
            )
            row, new, reply = T.apply_lock(op, view, now, args, self._next_fence)
            if new is None or not new.holders:
                self._locks.pop(k, None)
            else:
                self._locks[k] = T.LockRec(new.holders)
            if q is not None:
                q.chosen = None if new is None else new.chosen
            if op == "acquire":
                if type(reply) is Held:
                    self._register(k, args["owner"], now, reply.ttl_ms)
                elif q is not None:
                    q.waiters.pop(args["owner"], None)
                    if not q.waiters and q.chosen is None:
                        del self._queues[k]
            freed = row.id in _FREES_LOCK
            if freed:
                self._hub.notify(("lock", ns, key))  # a freed permit wakes waiters
            if freed or (args.get("value") is not None and row.reply in (T.ACQUIRED, T.OK)):
                self._hub.notify(("leader", ns, key))  # observers see every change
            return reply

    # The hand-off queue; every method runs with the store's lock held.

    def _register(self, k: tuple[str, str], owner: str, now: int, wait_ms: int) -> None:
        """Queue (or keep queued) an owner refused the lock, if it waits: its channel
        has a subscriber. A one-shot try is queued too but not chosen until it asks
        again, as every waiter does right after subscribing."""
        if ("lock", *k) not in self._hub._subs:
            return
        q = self._queues.get(k)
        if q is None:
            q = self._queues[k] = _Queue()
        until = now + min(wait_ms + 1, 1000) + REGISTER_SLACK_MS
        entry = q.waiters.get(owner)
        if entry is None:
            q.waiters[owner] = [until, 1]
        else:
            entry[0] = until
            entry[1] += 1

    def _reserve(self, k: tuple[str, str], q: _Queue, now: int) -> str | None:
        """The owner a free lock is reserved for, choosing the oldest waiter when no
        window is open (and waking it); None when nobody waits."""
        if q.chosen is not None:
            if q.until > now and q.chosen in q.waiters:
                return q.chosen
            q.waiters.pop(q.chosen, None)  # its window passed untaken: it lost its turn
            q.chosen = None
        if ("lock", *k) not in self._hub._subs:
            q.waiters.clear()  # nobody waits on this key any more
        for owner in [o for o, (until, _) in q.waiters.items() if until <= now]:
            del q.waiters[owner]
        head = next((o for o, (_, n) in q.waiters.items() if n > 1), None)
        if head is None:
            if not q.waiters:
                del self._queues[k]
            return None
        q.chosen, q.until = head, now + HANDOFF_MS
        self._hub.notify(("lock", *k))
        return head

    def acquire(
        self, ns: str, key: str, owner: str, ttl_ms: int, limit: int = 1, value: bytes | None = None
    ) -> Acquired | Held:
        reply: Acquired | Held = self._lock_op(
            "acquire", ns, key, owner=owner, ttl_ms=ttl_ms, limit=limit, value=value
        )
        return reply

    def release(self, ns: str, key: str, owner: str, token: int) -> bool:
        return bool(self._lock_op("release", ns, key, owner=owner, token=token))

    def renew(
        self, ns: str, key: str, owner: str, token: int, ttl_ms: int, value: bytes | None = None
    ) -> int | None:
        exp: int | None = self._lock_op(
            "renew", ns, key, owner=owner, token=token, ttl_ms=ttl_ms, value=value
        )
        return exp

    def break_lock(self, ns: str, key: str, token: int | None = None) -> bool:
        """Free every holder, or the permit with ``token`` (row lock.break; the token
        counter is kept). True if something held was freed."""
        return bool(self._lock_op("break", ns, key, token=token))

    def holders(self, ns: str, key: str) -> list[LockRow]:
        with self._lock:
            rec = self._locks.get((ns, key))
            alive = [] if rec is None else list(rec.alive(self._now()).values())
            return [
                LockRow(ns, key, p.owner, p.token, p.expires_ms, value=p.value)
                for p in sorted(alive, key=lambda p: p.token)
            ]

    def lock(self, ns: str, key: str) -> LockRow | None:
        rows = self.holders(ns, key)
        return rows[0] if rows else None

    def locks(self, ns_prefix: str) -> list[LockRow]:
        with self._lock:
            now = self._now()
            return [
                LockRow(ns, key, p.owner, p.token, p.expires_ms, value=p.value)
                for (ns, key), rec in self._locks.items()
                if ns.startswith(ns_prefix)
                for p in sorted(rec.alive(now).values(), key=lambda p: p.token)
            ]

    # ---- fences ----------------------------------------------------------------

    def fence_advance(self, ns: str, resource: str, token: int) -> tuple[bool, int]:
        k = (ns, resource)
        with self._lock:
            _, (ok, highest) = T.apply_fence(self._fences.get(k), token)
            self._fences[k] = highest
            return ok, highest

    def fence_current(self, ns: str, resource: str) -> int | None:
        with self._lock:
            return self._fences.get((ns, resource))

    def purge(self, dry_run: bool = False) -> int:
        with self._lock:
            now = self._now()
            dead_claims = [k for k, rec in self._claims.items() if rec.expires_ms <= now]
            dead_permits = {
                k: [o for o, p in rec.holders.items() if p.expires_ms <= now]
                for k, rec in self._locks.items()
            }
            removed = len(dead_claims) + sum(len(o) for o in dead_permits.values())
            if dry_run:
                return removed
            for k in dead_claims:
                del self._claims[k]
            for k in [k for k, st in self._steps.items() if st.until_ms <= now]:
                del self._steps[k]
            for k, owners in dead_permits.items():
                for o in owners:
                    del self._locks[k].holders[o]
                if not self._locks[k].holders:
                    del self._locks[k]
            for k, q in list(self._queues.items()):
                if q.chosen is None and all(until <= now for until, _ in q.waiters.values()):
                    del self._queues[k]
            return removed

    # ---- waiting ---------------------------------------------------------------

    def subscribe(self, channel: Channel) -> LocalSubscription:
        return self._hub.subscribe(tuple(channel))

    def close(self) -> None:
        return None


def _parse(url: str, timeout: float | None) -> float:
    from urllib.parse import parse_qsl, urlsplit

    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    if parts.netloc or parts.path not in ("", "/") or any(k != "timeout" for k, _ in query):
        from .._urls import redact

        raise ConfigurationError(
            f"memory store URL takes no host, path or options but ?timeout=: use "
            f"'memory://', got {redact(url)!r} (accepted options: timeout, and max_keys= "
            "and clock= as keyword arguments to connect)"
        )
    given = [v for _, v in query]
    if len(given) + (timeout is not None) > 1:
        raise ConfigurationError("timeout is given twice (in the URL and as a keyword)")
    if given:
        return duration(given[0], _TIMEOUT, positive=True, text=True)
    return (
        DEFAULT_TIMEOUT
        if timeout is None
        else duration(timeout, _TIMEOUT, positive=True, text=True)
    )


def open_sync(
    url: str,
    *,
    clock: Clock = SYSTEM_CLOCK,
    max_keys: int | None = None,
    timeout: float | None = None,
) -> tuple[MemoryStore, Clock]:
    bound = _parse(url, timeout)
    return MemoryStore(clock=clock, max_keys=max_keys, timeout=bound), clock


class MemoryAsyncStore(ThreadedAsyncStore):
    """The async face. A call runs inline (one short critical section), unless another
    thread holds the store at that moment: then it runs in a worker thread, so a
    stalled store never blocks the event loop and the call is bounded by ``timeout``
    like any other (a cancelled claim or acquire there is given back)."""

    def __init__(self, sync: MemoryStore) -> None:
        super().__init__(sync)
        self.timeout = sync.timeout
        self._busy = sync._lock.locked

    async def _call(self, fn: Any, *args: Any) -> Any:
        if not self._busy():
            return fn(*args)
        import asyncio  # here: the blocking API must not load asyncio

        return await asyncio.to_thread(fn, *args)

    async def _undoable(self, fn: Any, undo: Any, *args: Any) -> Any:
        # The same rule for the transitions: inline there is no await, so no
        # cancellation can land mid-call and there is nothing to give back.
        if not self._busy():
            return fn(*args)
        return await super()._undoable(fn, undo, *args)

    async def claim(
        self, ns: str, key: str, fp: str | None, token: str, lease_ms: int
    ) -> ClaimReply:
        if not self._busy():
            return self.sync.claim(ns, key, fp, token, lease_ms)
        return await super().claim(ns, key, fp, token, lease_ms)

    async def acquire(
        self, ns: str, key: str, owner: str, ttl_ms: int, limit: int = 1, value: bytes | None = None
    ) -> Acquired | Held:
        if not self._busy():
            return self.sync.acquire(ns, key, owner, ttl_ms, limit, value)
        return await super().acquire(ns, key, owner, ttl_ms, limit, value)


def open_async(
    url: str,
    *,
    clock: Clock = SYSTEM_CLOCK,
    max_keys: int | None = None,
    timeout: float | None = None,
) -> tuple[MemoryAsyncStore, Clock]:
    bound = _parse(url, timeout)
    store = MemoryStore(clock=clock, max_keys=max_keys, timeout=bound)
    return MemoryAsyncStore(store), clock
