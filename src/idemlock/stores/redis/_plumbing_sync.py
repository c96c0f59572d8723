"""How the blocking Redis store reaches Redis: its client, its listener thread, and
closing. The port methods are :class:`~idemlock.stores.redis._sync.RedisStore`'s,
generated from the asyncio store's.
"""

from __future__ import annotations

import contextlib
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from redis.connection import ConnectionPool
from redis.exceptions import (
    AskError,
    BusyLoadingError,
    ClusterDownError,
    MasterDownError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import SentinelConnectionPool

from ... import _forks
from ..._core.port import Channel
from ..._core.wakeups import Group
from ..._errors import StoreUnavailable
from .._local import LocalSubscription
from . import _common as C
from ._calls import (
    ND,
    eval_head,
    eval_text_args,
    pack_eval,
    pack_eval_text,
    pack_script_load,
)
from ._compat import StartupNodes, should_reconnect, unguarded_single_connection
from ._listen import SyncListener, SyncNodeListeners
from ._loops import node_of

_ERRORS = C.redis_errors()
_getpid = os.getpid


class SyncPlumbing:
    """The store on a blocking ``redis.Redis`` or ``redis.cluster.RedisCluster``."""

    def __init__(self, client: Any, *, cluster: bool, options: C.Options, owned: bool) -> None:
        self.client = client
        self.cluster = cluster
        self._owned = owned
        self._keep = options.keep_ms
        self._handoff = options.handoff_ms
        self._exec = client.execute_command
        # A single-connection client of redis-py 5.0.x lets threads interleave on its
        # connection (the store's renewer, listener and callers share it): one at a time.
        self._serial: threading.RLock | None = None
        if unguarded_single_connection(client):
            self._serial = threading.RLock()
            self._exec = partial(_serialised, self._serial, client.execute_command)
        #: the bound (seconds) on one call: socket and connect timeouts (agreement A1)
        self.timeout = options.timeout
        #: durability=: what a write waits for, and the commands that wait (WAIT...)
        self._durability = options.durability
        self._waits = C.wait_commands(options.durability, options.timeout)
        #: scripts loaded by a durable write's SCRIPT LOAD (forgotten on NOSCRIPT)
        self._loaded: set[str] = set()
        # Scripts on a standalone client with a plain pool skip redis-py's command layer
        # (pool checkout, retry wrapper, callbacks: as long again as the round trip on
        # a fast network): they go pre-encoded over connections of the store's own, made
        # with the pool's settings and kept in a free list (at most one per thread
        # calling at once). A Cluster client, a pool that limits or manages its
        # connections (BlockingConnectionPool, ...) or a single-connection client keeps
        # execute_command.
        pool = getattr(client, "connection_pool", None)
        # With durability=, a write and its WAIT share a redis-py pipeline (one round
        # trip, one connection: WAIT counts that connection's writes).
        # A Sentinel pool's connections ask the Sentinels for the primary when they
        # connect, and drop themselves on READONLY (redis-py's SentinelManagedConnection):
        # made with its settings, the store's own connections follow a failover too.
        self._direct = (
            not cluster
            and type(pool) in (ConnectionPool, SentinelConnectionPool)
            and getattr(client, "connection", None) is None
            and not self._waits
        )
        self._sentinel = type(pool) is SentinelConnectionPool
        self._free: list[Any] = []
        # On a Cluster, the same per node: a script goes straight to the primary of its
        # keys' slot (from the client's slot map); a redirection, a node going down or
        # a slot not in the map hands the call to execute_command, which follows
        # redirections and re-reads the slot map.
        self._cluster_direct = cluster and hasattr(client, "nodes_manager") and not self._waits
        self._node_free: dict[str, list[Any]] = {}
        #: a Cluster client's startup nodes as given, put back if redis-py drops them all
        #: (see ``_recover_nodes``); one slot map read of the store's own at a time
        self._startup = StartupNodes(client) if cluster else None
        self._refreshing = threading.Lock()
        #: the process the listener and the free lists are of (see ``_forked``)
        self._pid = os.getpid()
        self._listener = self._new_listener()

    def _new_listener(self) -> SyncListener | SyncNodeListeners:
        if self.cluster:
            return SyncNodeListeners(partial(node_of, self.client), self._node_listener)
        return self._node_listener("")

    def _node_listener(self, node: str) -> SyncListener:
        # Other processes' waiters wake a little after the hand-off window if the
        # chosen process did not take the lock (it may have died).
        return SyncListener(
            partial(self._listener_connection, node),
            self._unregister,
            self._handoff / 1000 + 0.005,
            self.timeout,
        )

    def _forked(self) -> None:
        """In a forked child (the pid check of every call): never touch the parent's
        listener (its thread did not survive the fork and its socket is the parent's)
        nor its connections (the parent may be mid-call on them). Both are dropped
        unclosed (redis-py shuts a socket down only in the process that opened it, so
        collecting them sends nothing); the child subscribes and connects on its own.
        redis-py's pools notice the new pid themselves."""
        with _forks.LOCK:
            if self._pid == os.getpid():
                return
            _forks.INHERITED.append(self._listener)
            self._listener = self._new_listener()
            self._free = []
            self._node_free = {}
            self._refreshing = threading.Lock()  # a parent's refresh did not survive
            if self._serial is not None:  # a thread of the parent may have held it
                self._serial = threading.RLock()
                self._exec = partial(_serialised, self._serial, self.client.execute_command)
            self._pid = os.getpid()

    # ---- plumbing ----------------------------------------------------------------------

    def _eval(
        self,
        script: C.Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        *,
        finish: bool = False,
        undo: Callable[[Any], Any] | None = None,
        undo_late: bool = False,
    ) -> Any:
        """Run one script, within the socket timeouts. A blocking call cannot be
        abandoned halfway, so the asyncio store's policies for a caller that stops
        waiting (``finish``, ``undo``) have nothing to act on here."""
        if self._pid != _getpid():
            self._forked()
        if self._waits and script.sha in C.DURABLE:
            return self._eval_acked(script, keys, args)
        if self._direct:
            return self._eval_direct(script, keys, args)
        if self._cluster_direct:
            reply = self._eval_on_node(script, keys, args)
            if reply is not _REDIRECTED:
                return reply
        if self._startup is not None:
            self._recover_nodes()
        try:
            try:
                return self._exec("EVALSHA", script.sha, len(keys), *keys, *args, **ND)
            except NoScriptError:
                # Not in the cache: the call did not run; as EVAL (see _calls).
                return self._exec(*eval_text_args(script, keys, args), **ND)
        except _ERRORS as exc:
            raise C.store_error(exc, script.name) from exc

    def _recover_nodes(self) -> None:
        """Put a Cluster client's startup nodes back if redis-py dropped them all (see
        ``_compat.StartupNodes``), and read the slot map again, on a thread of the
        store's own, if it has forgotten every node: on redis-py up to 6.4 the blocking
        client's startup nodes are then its known nodes too, so it has, and would
        never read the slot map again (its calls still reach the nodes of the slots
        it knew; its listeners, which pick a known node, could not connect).

        Called where a call leaves the store's direct path for redis-py's (a node
        failed, a slot moved or is not in the map), before a batch, and before a
        listener connects: wherever the client's nodes are needed (the direct path
        needs only the slots the client knew, and costs nothing more)."""
        startup = self._startup
        if startup is None:
            return
        if not startup.restore() and self.client.get_nodes():
            return
        if not self._refreshing.acquire(blocking=False):
            return  # a read is under way
        try:
            threading.Thread(
                target=self._refresh_slots, name="idemlock-redis-nodes", daemon=True
            ).start()
        except BaseException:
            self._refreshing.release()
            raise

    def _refresh_slots(self) -> None:
        try:
            # redis-py's own slot map read (the store's bounded client defers it to a
            # thread of its own in turn); a failure (the cluster still down) leaves the
            # next call through redis-py's path to ask again.
            self.client.nodes_manager.initialize()
        except Exception:
            pass
        finally:
            self._refreshing.release()

    def _eval_acked(self, script: C.Script, keys: tuple[bytes, ...], args: tuple[Any, ...]) -> Any:
        """``_eval`` of a write with ``durability=``: the script and its WAIT/WAITAOF in
        one redis-py pipeline (one round trip, one connection; WAIT counts the writes
        of its connection), behind a SCRIPT LOAD the first time (so a NOSCRIPT never
        costs a second WAIT)."""
        t0 = time.monotonic()
        with self._client() as client:
            return self._acked_on(client, script, keys, args, t0)

    def _acked_on(
        self,
        client: Any,
        script: C.Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        t0: float,
    ) -> Any:
        try:
            replies = self._with_waits(client, script, keys, args, self.timeout)
            if isinstance(replies[0], NoScriptError):
                # Flushed (a failover, a restart): the call did not run; again behind a
                # SCRIPT LOAD, waiting only for what is left of the bound.
                self._loaded.discard(script.sha)
                left = self.timeout - (time.monotonic() - t0)
                replies = self._with_waits(client, script, keys, args, left)
        except _ERRORS as exc:
            raise C.store_error(exc, script.name) from exc
        first = replies[0]
        if isinstance(first, Exception):
            raise C.store_error(first, script.name) from first
        C.check_acks(self._durability, replies[1:], script.name)
        return first

    def _with_waits(
        self,
        client: Any,
        script: C.Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        left: float,
    ) -> list[Any]:
        pipe = client.pipeline(transaction=False)
        load = script.sha not in self._loaded
        if load:
            pipe.execute_command("SCRIPT", "LOAD", script.text)
        pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args, **ND)
        for wait in C.wait_commands(self._durability, left):
            pipe.execute_command(*wait)
        replies: list[Any] = pipe.execute(raise_on_error=False)
        if load:
            if not isinstance(replies[0], Exception):
                self._loaded.add(script.sha)
            replies = replies[1:]
        return replies

    def _eval_direct(self, script: C.Script, keys: tuple[bytes, ...], args: tuple[Any, ...]) -> Any:
        """``_eval`` on a connection of the store's own: what ``execute_command`` does
        for EVALSHA (the connection's retry policy, a failed connection dropped before a
        retry, health checks, reconnection), without the rest of its layer."""
        try:
            conn = self._free.pop()
        except IndexError:
            pool = self.client.connection_pool
            conn = pool.connection_class(**pool.connection_kwargs)
        clean = False
        try:
            reply = self._on(conn, script, keys, args, self._sentinel)
            clean = True
            return reply
        except ResponseError as exc:
            clean = True  # a refusal in a complete reply: the connection is in step
            raise C.store_error(exc, script.name) from exc
        except _ERRORS as exc:
            raise C.store_error(exc, script.name) from exc
        finally:
            if not clean:
                # A timeout, a reset, an interrupt between writing and reading: a reply
                # may still be on its way, so the next call must not read it. redis-py
                # has disconnected already where it saw the failure; this covers the rest.
                conn.disconnect()
            elif should_reconnect(conn):  # a maintenance notification asked for it
                conn.disconnect()
            self._free.append(conn)

    def _eval_on_node(
        self, script: C.Script, keys: tuple[bytes, ...], args: tuple[Any, ...]
    ) -> Any:
        """``_eval`` on a Cluster, sent to the primary of the keys' slot on a connection
        of the store's own; ``_REDIRECTED`` when execute_command must take the call over
        (it was refused before running, or the connection failed: every script is safe
        to run again, as after redis-py's own retry of a failed connection)."""
        try:
            # Public API (redis-py 5.0+): the primary of the key's slot in the map.
            node = self.client.get_node_from_key(keys[0])
            free = self._node_free.get(node.name)
            if free is None:
                free = self._node_free.setdefault(node.name, [])
            try:
                conn = free.pop()
            except IndexError:
                pool = node.redis_connection.connection_pool
                conn = pool.connection_class(**pool.connection_kwargs)
        except (SlotNotCoveredError, KeyError, IndexError, AttributeError):
            return _REDIRECTED  # slot not in the map (yet): the client finds it
        clean = False
        try:
            conn.send_packed_command([pack_eval(eval_head(script.sha), keys, args)])
            try:
                reply = conn.read_response(disable_decoding=True)
            except NoScriptError:
                reply = _as_eval(conn, script, keys, args)
            clean = True
            return reply
        except _MOVED:
            clean = True
            return _REDIRECTED
        except ResponseError as exc:
            clean = True  # a refusal in a complete reply: the connection is in step
            raise C.store_error(exc, script.name) from exc
        except RedisTimeoutError as exc:
            raise C.store_error(exc, script.name) from exc  # never retried (may have run)
        except _ERRORS:
            return _REDIRECTED
        finally:
            if not clean or should_reconnect(conn):
                conn.disconnect()
            free.append(conn)

    @staticmethod
    def _on(
        conn: Any,
        script: C.Script,
        keys: tuple[bytes, ...],
        args: tuple[Any, ...],
        connect: bool = False,
    ) -> Any:
        """``connect``: call ``conn.connect()`` first (a no-op once connected). A
        Sentinel connection finds the primary only there: ``send_packed_command``
        connects by itself, but (redis-py 8) to the default address, past the
        Sentinel's override."""
        packed = [pack_eval(eval_head(script.sha), keys, args)]

        def once() -> Any:
            if connect:
                conn.connect()
            conn.send_packed_command(packed)
            return conn.read_response(disable_decoding=True)

        def failed(_: Exception) -> None:
            conn.disconnect()

        def as_eval() -> Any:
            if connect:
                conn.connect()
            return _as_eval(conn, script, keys, args)

        try:
            return conn.retry.call_with_retry(once, failed)
        except NoScriptError:
            return conn.retry.call_with_retry(as_eval, failed)

    def _unregister(self, channel: bytes, gid: bytes) -> None:
        # This process stopped waiting without the lock: a release need not hold the
        # lock back for it. Best effort; the registration expires anyway.
        with contextlib.suppress(StoreUnavailable):
            self._eval(C.UNREGISTER, (C.waiters_of(channel),), (gid,))

    @contextlib.contextmanager
    def _client(self) -> Iterator[Any]:
        """The client (listings, pipelines); redis-py's pool hands out connections."""
        if self._pid != _getpid():
            self._forked()
        self._recover_nodes()
        if self._serial is None:
            yield self.client
        else:
            with self._serial:
                yield self.client

    def _bounded(self, value: Any, what: str) -> Any:
        """The twin of the asyncio store's bound on a batch: socket timeouts bound
        each of its round trips here, so ``value`` has already arrived."""
        return value

    def _waiting(self, channel: bytes) -> Group[bytes, Any] | None:
        """This process's waiters on ``channel``, if a caller waits on it."""
        if self._pid != _getpid():
            self._forked()
        return self._listener.waiting(channel)

    def _listener_connection(self, node: str) -> Any:
        if self.cluster:
            self._recover_nodes()
            found = self.client.get_node(node_name=node) if node else None
            if found is None or found.redis_connection is None:
                # The node left the cluster: any node still gets every PUBLISH (over
                # the cluster bus), later; waiters re-check within their wait chunk.
                found = random.choice(C.known_nodes(self.client))
            pool = found.redis_connection.connection_pool
        else:
            pool = self.client.connection_pool
        conn = pool.connection_class(**C.listener_kwargs(pool.connection_kwargs))
        conn.connect()
        return conn

    # ---- waiting and life cycle ----------------------------------------------------------

    def subscribe(self, channel: Channel) -> LocalSubscription:
        if self._pid != _getpid():
            self._forked()
        name = C.channel_name(channel.kind, channel.ns, channel.key)
        return self._listener.subscribe(name, channel.kind == "leader")

    def close(self) -> None:
        if self._pid != _getpid():
            self._forked()  # the parent's listener and connections: never closed here
        self._listener.close()
        free, self._free = self._free, []
        for conns in self._node_free.values():
            free += conns
        self._node_free = {}
        for conn in free:
            with contextlib.suppress(*_ERRORS):
                conn.disconnect()
        if self._owned:
            with contextlib.suppress(*_ERRORS):
                self.client.close()


def _as_eval(conn: Any, script: C.Script, keys: tuple[bytes, ...], args: tuple[Any, ...]) -> Any:
    """The call again on ``conn`` after NOSCRIPT (it did not run): as EVAL, behind a
    SCRIPT LOAD for the calls that follow, in one round trip (see _calls)."""
    conn.send_packed_command([pack_script_load(script), pack_eval_text(script, keys, args)])
    with contextlib.suppress(ResponseError):  # a refused load changes nothing here
        conn.read_response()
    return conn.read_response(disable_decoding=True)


def _serialised(lock: threading.RLock, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    with lock:
        return call(*args, **kwargs)


#: ``_eval_on_node``'s answer when the call goes to execute_command instead
_REDIRECTED: Any = object()
#: refusals of a node that does not serve the slot now (or not yet): the client's path
#: follows them and re-reads the slot map
_MOVED = (
    AskError,
    TryAgainError,
    ClusterDownError,
    MasterDownError,
    ReadOnlyError,
    BusyLoadingError,
)
