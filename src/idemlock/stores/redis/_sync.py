"""The blocking Redis store and its notification listener."""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

from redis.client import NEVER_DECODE
from redis.exceptions import NoScriptError

from ..._core.port import Acquired, Channel, ClaimReply, Held, LockRow, RecordRow
from ..._errors import ConfigurationError, StoreUnavailable
from . import _common as C

_ND = {NEVER_DECODE: True}
_ERRORS = C.redis_errors()

#: Seconds without any traffic on the listener connection before it sends a PING;
#: no reply within as long again means the connection is dead.
IDLE_S = 15.0


RenewCall = tuple[C.Script, tuple[bytes, ...], tuple[Any, ...]]


def renew_calls(items: Sequence[tuple[Any, ...]], keep: int) -> list[RenewCall]:
    """The EXTEND/RENEW script calls of a batched renewal."""
    calls: list[RenewCall] = []
    for item in items:
        if item[0] == "claim":
            _, ns, key, token, lease_ms = item
            args: tuple[Any, ...] = (C.pack_id(token), lease_ms, keep)
            calls.append((C.EXTEND, (C.names(ns, key).claim,), args))
        else:
            _, ns, key, owner, token, ttl_ms = item
            args = (owner, str(token), ttl_ms, keep)
            calls.append((C.RENEW, (C.names(ns, key).lock,), args))
    return calls


class RedisStore:
    """The port on a blocking ``redis.Redis`` or ``redis.cluster.RedisCluster``."""

    kind = "redis"
    issues_fence_tokens = True

    def __init__(self, client: Any, *, cluster: bool, options: C.Options, owned: bool) -> None:
        self.client = client
        self.cluster = cluster
        self._owned = owned
        self._keep = options.keep_ms
        self._handoff = options.handoff_ms
        self._exec = client.execute_command
        #: the bound (seconds) on one call: socket and connect timeouts (agreement A1)
        self.timeout = options.timeout
        self._listener = self._new_listener()
        _STORES.add(self)

    def _new_listener(self) -> SyncListener:
        # Other processes' waiters wake a little after the hand-off window if the
        # chosen process did not take the lock (it may have died).
        return SyncListener(
            self._listener_connection,
            self._unregister,
            self._handoff / 1000 + 0.005,
            self.timeout,
        )

    def _after_fork_in_child(self) -> None:
        """A forked child never touches the parent's listener: its thread did not
        survive the fork and its socket is the parent's. Drop it unclosed (closing
        our copy of the descriptor later sends nothing); the child subscribes on a
        connection of its own on first wait. redis-py's pools notice the new pid
        themselves and open fresh connections."""
        self._listener = self._new_listener()

    # ---- plumbing ----------------------------------------------------------------------

    def _eval(self, script: C.Script, keys: tuple[bytes, ...], args: tuple[Any, ...]) -> Any:
        try:
            try:
                return self._exec("EVALSHA", script.sha, len(keys), *keys, *args, **_ND)
            except NoScriptError:
                # Redis restarted or failed over, or SCRIPT FLUSH: load it (on every
                # primary of a cluster) and run it once more.
                self.client.script_load(script.text)
                return self._exec("EVALSHA", script.sha, len(keys), *keys, *args, **_ND)
        except _ERRORS as exc:
            raise C.store_error(exc, script.name) from exc

    def _unregister(self, channel: bytes, gid: bytes) -> None:
        # This process stopped waiting without the lock: a release need not hold the
        # lock back for it. Best effort; the registration expires anyway.
        with contextlib.suppress(StoreUnavailable):
            self._eval(C.UNREGISTER, (C.waiters_of(channel),), (gid,))

    def _listener_connection(self) -> Any:
        if self.cluster:
            nodes = self.client.get_primaries() or self.client.get_nodes()
            pool = random.choice(nodes).redis_connection.connection_pool
        else:
            pool = self.client.connection_pool
        conn = pool.connection_class(**C.listener_kwargs(pool.connection_kwargs))
        conn.connect()
        return conn

    # ---- idempotency records -------------------------------------------------------------

    def claim(self, ns: str, key: str, fp: str | None, token: str, lease_ms: int) -> ClaimReply:
        n = C.names(ns, key)
        reply = self._eval(
            C.CLAIM, (n.claim,), (C.pack_id(fp), C.pack_id(token), lease_ms, self._keep)
        )
        return C.claim_reply(reply, token)

    def complete(self, ns: str, key: str, token: str, result: bytes, ttl_ms: int) -> bool:
        return self.complete_with(ns, key, token, result, ttl_ms, ())

    def complete_with(
        self,
        ns: str,
        key: str,
        token: str,
        result: bytes,
        ttl_ms: int,
        writes: Sequence[tuple[str, bytes]],
    ) -> bool:
        """Complete the claim and SET the caller's keys in the same script: the effects
        and the record commit together. On Cluster the keys must share the claim's slot
        (the ConfigurationError names the tag to use)."""
        n = C.names(ns, key)
        users = check_claim_slot(self.cluster, n.claim, writes)
        args = (C.pack_id(token), bytes(result), ttl_ms, n.claim_channel, C.nonce())
        values = tuple(bytes(v) for _, v in writes)
        return bool(self._eval(C.COMPLETE, (n.claim, *users), args + values) == 1)

    def abandon(self, ns: str, key: str, token: str) -> bool:
        n = C.names(ns, key)
        args = (C.pack_id(token), self._keep, n.claim_channel, C.nonce())
        return bool(self._eval(C.ABANDON, (n.claim,), args) == 1)

    def extend(self, ns: str, key: str, token: str, lease_ms: int) -> int | None:
        args = (C.pack_id(token), lease_ms, self._keep)
        exp = self._eval(C.EXTEND, (C.names(ns, key).claim,), args)
        return None if exp == -1 else int(exp)

    def renew_many(self, items: Sequence[tuple[Any, ...]]) -> list[int | None]:
        """Renew many claims (``("claim", ns, key, token, lease_ms)``) and leases
        (``("lock", ns, key, owner, token, ttl_ms)``) in one round trip: a pipeline of
        the EXTEND/RENEW scripts (each atomic on its key), for a coordinator's renewer.
        On a Cluster, where keys live on many nodes, one script per item."""
        calls = renew_calls(items, self._keep)
        # A Cluster spreads the keys over nodes: one script per item there.
        replies = [self._eval(*call) for call in calls] if self.cluster else self._pipelined(calls)
        return [None if r == -1 else int(r) for r in replies]

    def _pipelined(self, calls: list[RenewCall]) -> list[Any]:
        for attempt in range(2):
            try:
                pipe = self.client.pipeline(transaction=False)
                for script, keys, args in calls:
                    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args, **_ND)
                replies = pipe.execute(raise_on_error=False)
            except _ERRORS as exc:
                raise C.store_error(exc, "renew_many") from exc
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies):
                # Scripts flushed (restart, failover): load them and renew again (a
                # renewal repeated is harmless).
                try:
                    for script in {c[0] for c in calls}:
                        self.client.script_load(script.text)
                except _ERRORS as exc:
                    raise C.store_error(exc, "renew_many") from exc
                continue
            # A script error is about its one key (say, a corrupt value): that renewal
            # is refused (the holder learns it lost it), the others stand.
            return [-1 if isinstance(r, Exception) else r for r in replies]
        raise AssertionError("unreachable")  # pragma: no cover

    def record(self, ns: str, key: str) -> RecordRow | None:
        reply = self._eval(C.PEEK_CLAIM, (C.names(ns, key).claim,), ())
        return C.record_row(ns, key, reply)

    def forget(self, ns: str, key: str) -> bool:
        n = C.names(ns, key)
        return bool(self._eval(C.FORGET, (n.claim,), (self._keep, n.claim_channel, C.nonce())) == 1)

    def records(self, ns_prefix: str) -> Sequence[RecordRow]:
        rows: list[RecordRow] = self._listing("c", ns_prefix)
        return rows

    # ---- locks -------------------------------------------------------------------------

    def acquire(self, ns: str, key: str, owner: str, ttl_ms: int) -> Acquired | Held:
        n = C.names(ns, key)
        g = self._listener.waiting(n.lock_channel)
        args = (owner, ttl_ms, self._keep, g.gid if g is not None else b"", C.REGISTER_MS)
        reply = C.lock_reply(self._eval(C.ACQUIRE, (n.lock, n.waiters), args))
        if g is not None:
            g.registered = isinstance(reply, Held)
        return reply

    def release(self, ns: str, key: str, owner: str, token: int) -> bool:
        n = C.names(ns, key)
        args = (owner, str(token), self._keep, self._handoff, n.lock_channel, C.nonce())
        return bool(self._eval(C.RELEASE, (n.lock, n.waiters), args) == 1)

    def break_lock(self, ns: str, key: str) -> bool:
        n = C.names(ns, key)
        return bool(self._eval(C.BREAK, (n.lock,), (self._keep, n.lock_channel)) == 1)

    def renew(self, ns: str, key: str, owner: str, token: int, ttl_ms: int) -> int | None:
        n = C.names(ns, key)
        exp = self._eval(C.RENEW, (n.lock,), (owner, str(token), ttl_ms, self._keep))
        return None if exp == -1 else int(exp)

    def lock(self, ns: str, key: str) -> LockRow | None:
        return C.lock_row(ns, key, self._eval(C.PEEK_LOCK, (C.names(ns, key).lock,), ()))

    def locks(self, ns_prefix: str) -> Sequence[LockRow]:
        rows: list[LockRow] = self._listing("l", ns_prefix)
        return rows

    # ---- fences ------------------------------------------------------------------------

    def fence_advance(self, ns: str, resource: str, token: int) -> tuple[bool, int]:
        reply = self._eval(C.FENCE_ADVANCE, (C.gate_name(ns, resource),), (str(token),))
        return C.fence_reply(reply)

    def fence_current(self, ns: str, resource: str) -> int | None:
        reply = self._eval(C.FENCE_CURRENT, (C.gate_name(ns, resource),), ())
        return None if reply is None else int(reply)

    def fence_set(
        self, ns: str, resource: str, token: int, key: str, value: bytes
    ) -> tuple[bool, int]:
        """Accept ``token`` on the gate of ``resource`` and, if accepted, SET ``key`` to
        ``value`` in one script. On Redis Cluster ``key`` must hash to the slot of
        ``resource`` (be the resource itself, or share its ``{hash tag}``)."""
        gate = C.gate_name(ns, resource)
        user = key.encode("utf-8", "surrogatepass")
        check_same_slot(self.cluster, resource, key, gate, user)
        return C.fence_reply(self._eval(C.FENCE_SET, (gate, user), (str(token), bytes(value))))

    def purge(self) -> int:
        return 0  # Redis expires every key by itself

    # ---- listings ------------------------------------------------------------------------

    def _listing(self, kind: C.Kind, ns_prefix: str) -> list[Any]:
        try:
            keys = [
                k if isinstance(k, bytes) else str(k).encode("utf-8", "surrogatepass")
                for k in self.client.scan_iter(match=C.match_pattern(kind, ns_prefix), count=1000)
            ]
            now = _now_ms(self.client.time())
            rows: list[Any] = []
            for i in range(0, len(keys), 500):
                batch = keys[i : i + 500]
                pipe = self.client.pipeline(transaction=False)
                for k in batch:
                    if kind == "c":
                        pipe.execute_command("GET", k, **_ND)
                    else:
                        pipe.hmget(k, *C.LOCK_FIELDS)
                values = pipe.execute(raise_on_error=False)
                rows += C.listing_rows(kind, batch, values, now, ns_prefix)
            return rows
        except _ERRORS as exc:
            raise C.store_error(exc, "listing") from exc

    # ---- waiting and life cycle ----------------------------------------------------------

    def subscribe(self, channel: Channel) -> SyncSubscription:
        return self._listener.subscribe(C.channel_name(channel.kind, channel.ns, channel.key))

    def close(self) -> None:
        self._listener.close()
        if self._owned:
            with contextlib.suppress(*_ERRORS):
                self.client.close()


def _now_ms(reply: Any) -> int:
    if isinstance(reply, dict):  # a cluster answers per node
        reply = next(iter(reply.values()))
    sec, usec = reply
    return int(sec) * 1000 + int(usec) // 1000


def check_claim_slot(
    cluster: bool, claim: bytes, writes: Sequence[tuple[str, bytes]]
) -> tuple[bytes, ...]:
    users = tuple(k.encode("utf-8", "surrogatepass") for k, _ in writes)
    if cluster and users:
        from redis.crc import key_slot

        slot = key_slot(claim)
        for name, raw in zip((k for k, _ in writes), users, strict=True):
            if key_slot(raw) != slot:
                tag = claim[claim.index(b"{") + 1 : claim.index(b"}")].decode()
                raise ConfigurationError(
                    f"on Redis Cluster, writes completed with a claim must hash to the "
                    f"claim's slot, and {name!r} does not: put the claim's hash tag in its "
                    f"name, e.g. '{{{tag}}}:{name}'"
                )
    return users


def check_same_slot(cluster: bool, resource: str, key: str, gate: bytes, user: bytes) -> None:
    if not cluster:
        return
    from redis.crc import key_slot

    if key_slot(gate) != key_slot(user):
        raise ConfigurationError(
            f"on Redis Cluster, set_if_fresh writes {key!r} in the same script as the "
            f"fence of {resource!r}, so both must hash to one slot: use the resource name "
            f"as the key, or give both the same hash tag (resource '{{{resource}}}' and "
            f"key '{{{resource}}}:...')"
        )


# ---- notifications ---------------------------------------------------------------------


class _Group:
    """This process's subscription to one channel (one SUBSCRIBE on the connection)."""

    __slots__ = ("channel", "confirmed", "gid", "registered", "subs")

    def __init__(self, channel: bytes) -> None:
        self.channel = channel
        self.subs: set[SyncSubscription] = set()
        self.confirmed = False
        #: this process's waiter id for the key, and whether Redis has it registered
        self.gid = C.waiter_id()
        self.registered = False


class SyncSubscription:
    """One waiter's mailbox: a notification that arrives before ``wait`` is kept."""

    __slots__ = ("_cond", "_flag", "_group", "_listener")

    def __init__(self, listener: SyncListener, group: _Group) -> None:
        self._listener = listener
        self._group = group
        self._flag = False
        self._cond = threading.Condition(listener._lock)

    def _fire(self) -> None:  # with the listener's lock held
        self._flag = True
        self._cond.notify()

    def wait(self, timeout: float) -> bool:
        with self._cond:
            if not self._flag and timeout > 0:
                self._cond.wait(timeout)
            fired, self._flag = self._flag, False
            return fired

    def close(self) -> None:
        self._listener._remove(self)


class SyncListener:
    """One pub/sub connection per store, read by a daemon thread that wakes the local
    waiters of each channel.

    A lock's release names the one process it hands the lock to (its waiter id); the
    other processes' waiters sleep on, and are woken ``defer_s`` later only if no
    newer notification came (the chosen one may have died). A channel stays
    subscribed ``LINGER_S`` after its last waiter left, so a process that waits on
    the same key again and again does not pay a SUBSCRIBE each time. The listener
    reconnects by itself; when it does, every waiter is woken once (a notification
    may have been missed) and re-checks the store.
    """

    LINGER_S = 2.0

    def __init__(self, connect: Any, on_idle: Any, defer_s: float, timeout: float) -> None:
        self._connect = connect
        self._on_idle = on_idle
        self._defer_s = defer_s
        self._confirm_timeout = timeout
        self._lock = threading.Lock()
        self._confirmed = threading.Condition(self._lock)
        self._groups: dict[bytes, _Group] = {}
        # Expected subscribe/unsubscribe confirmations per channel, in wire order.
        self._pending: dict[bytes, deque[_Group | None]] = {}
        self._deferred: dict[bytes, float] = {}  # channel -> when to wake its waiters
        self._idle: dict[bytes, float] = {}  # channel -> since when it has no waiter
        self._conn: Any = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def waiting(self, channel: bytes) -> _Group | None:
        """This process's waiters on ``channel``, if a caller waits on it."""
        g = self._groups.get(channel)
        return g if g is not None and g.subs else None

    def subscribe(self, channel: bytes) -> SyncSubscription:
        with self._lock:
            if self._closed:
                raise StoreUnavailable("the Redis store is closed")
            g = self._groups.get(channel)
            new = g is None
            if g is None:
                g = self._groups[channel] = _Group(channel)
            self._idle.pop(channel, None)
            sub = SyncSubscription(self, g)
            g.subs.add(sub)
            if new:
                try:
                    self._start()
                except _ERRORS as exc:
                    g.subs.discard(sub)
                    del self._groups[channel]
                    raise C.store_error(exc, "subscribe") from exc
                self._send_subscribe([g])
            if not g.confirmed:
                self._confirmed.wait_for(
                    lambda: g.confirmed or self._conn is None, self._confirm_timeout
                )
        return sub

    def _start(self) -> None:  # with the lock held
        if self._conn is None and self._thread is None:
            self._conn = self._connect()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name="idemlock-redis-listener", daemon=True
            )
            self._thread.start()

    def _send(self, *args: bytes) -> None:  # with the lock held
        try:
            self._conn.send_command(*args, check_health=False)
        except _ERRORS:
            self._drop()

    def _send_subscribe(self, groups: list[_Group]) -> None:  # with the lock held
        if self._conn is None:
            return  # the reader resubscribes every group when it reconnects
        for g in groups:
            self._pending.setdefault(g.channel, deque()).append(g)
        self._send(b"SUBSCRIBE", *[g.channel for g in groups])

    def _remove(self, sub: SyncSubscription) -> None:
        g = sub._group
        with self._lock:
            g.subs.discard(sub)
            if g.subs or self._groups.get(g.channel) is not g:
                return
            self._deferred.pop(g.channel, None)
            self._idle[g.channel] = time.monotonic()  # linger; the reader unsubscribes
            registered, g.registered = g.registered, False
        if registered:
            self._on_idle(g.channel, g.gid)

    def _unsubscribe_idle(self, now: float) -> float:  # with the lock held
        """Unsubscribe channels idle for LINGER_S; returns when the next one is due."""
        due = now + IDLE_S
        for channel, since in list(self._idle.items()):
            if since + self.LINGER_S > now:
                due = min(due, since + self.LINGER_S)
                continue
            del self._idle[channel]
            if self._groups.pop(channel, None) is not None and self._conn is not None:
                self._pending.setdefault(channel, deque()).append(None)
                self._send(b"UNSUBSCRIBE", channel)
        return due

    def _wake_deferred(self, now: float) -> float:  # with the lock held
        due = now + IDLE_S
        for channel, at in list(self._deferred.items()):
            if at > now:
                due = min(due, at)
                continue
            del self._deferred[channel]
            g = self._groups.get(channel)
            if g is not None:
                for s in g.subs:
                    s._fire()
        return due

    def _drop(self) -> None:  # with the lock held: forget the connection, wake everyone
        conn, self._conn = self._conn, None
        self._pending.clear()
        for channel in list(self._idle):
            self._groups.pop(channel, None)
        self._idle.clear()
        for g in self._groups.values():
            g.confirmed = False
            for s in g.subs:
                s._fire()
        self._confirmed.notify_all()
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.disconnect()

    def _dispatch(self, msg: Any) -> None:
        if not isinstance(msg, list) or len(msg) < 3:
            return
        kind, channel = msg[0], msg[1]
        with self._lock:
            if kind == b"message":
                g = self._groups.get(channel)
                if g is None or not g.subs:
                    return
                if msg[2] == b"*" or msg[2] == g.gid:
                    self._deferred.pop(channel, None)
                    for s in g.subs:
                        s._fire()
                else:  # handed to another process; wake ours only if it does not take it
                    self._deferred[channel] = time.monotonic() + self._defer_s
            elif kind in (b"subscribe", b"unsubscribe"):
                q = self._pending.get(channel)
                item = q.popleft() if q else None
                if q is not None and not q:
                    del self._pending[channel]
                if kind == b"subscribe" and item is not None:
                    item.confirmed = True
                    self._confirmed.notify_all()

    def _run(self) -> None:
        backoff = 0.05
        ping_sent = False
        while True:
            with self._lock:
                if self._closed:
                    return
                conn = self._conn
                now = time.monotonic()
                due = min(self._wake_deferred(now), self._unsubscribe_idle(now))
            if conn is None:
                try:
                    fresh = self._connect()
                except Exception:
                    time.sleep(backoff)
                    backoff = min(1.0, backoff * 2)
                    continue
                with self._lock:
                    if self._closed:
                        fresh.disconnect()
                        return
                    self._conn = fresh
                    groups = list(self._groups.values())
                    for g in groups:
                        for s in g.subs:
                            s._fire()  # something may have been missed meanwhile
                    if groups:
                        self._send_subscribe(groups)
                backoff, ping_sent = 0.05, False
                continue
            try:
                wait = max(0.0, due - now)
                if conn.can_read(timeout=wait):
                    self._dispatch(conn.read_response(disconnect_on_error=False))
                    ping_sent = False
                elif wait < IDLE_S:
                    continue  # a deferred wake or a linger is due
                elif ping_sent:
                    raise ConnectionError("the pub/sub connection did not answer a PING")
                else:
                    with self._lock:
                        conn.send_command("PING", check_health=False)
                    ping_sent = True
            except Exception:
                with self._lock:
                    if self._closed:
                        return
                    if self._conn is conn:
                        self._drop()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
            for g in self._groups.values():
                for s in g.subs:
                    s._fire()
            self._groups.clear()
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.disconnect()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)


# ---- fork ------------------------------------------------------------------------------

_STORES: weakref.WeakSet[RedisStore] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
