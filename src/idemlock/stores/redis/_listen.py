"""The Redis stores' notification listeners: one pub/sub connection per store (per
event loop for asyncio), read by a daemon thread (:class:`SyncListener`) or a task
(:class:`AsyncListener`).

What they remember (reference counts, ordered confirmations, the waiter-id filter,
deferred wakes, linger, wake-all on reconnect) is :class:`idemlock._core.wakeups.Wakeups`;
these are its drivers, doing only the I/O and the timers.

A lock's release names the one process it hands the lock to (its waiter id); the
other processes' waiters sleep on, and are woken ``defer_s`` later only if no newer
notification came (the chosen one may have died). A channel stays subscribed
``LINGER_S`` after its last waiter left, so a process that waits on the same key again
and again does not pay a SUBSCRIBE each time. The listener reconnects by itself; when
it does, every waiter is woken once (a notification may have been missed) and
re-checks the store.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Generic, Literal, TypeVar

from ..._core.wakeups import Command, Group, Wakeups
from ..._errors import StoreUnavailable
from .._local import LocalSubscription
from . import _common as C

_ERRORS = C.redis_errors()

#: Seconds without any traffic on the listener connection before it sends a PING;
#: no reply within as long again means the connection is dead.
IDLE_S = 15.0
#: Seconds a channel stays subscribed after its last local waiter left.
LINGER_S = 2.0

_VERBS = {"subscribe": b"SUBSCRIBE", "unsubscribe": b"UNSUBSCRIBE"}


def _confirmation(kind: Any) -> Literal["subscribe", "unsubscribe"] | None:
    if kind == b"subscribe":
        return "subscribe"
    if kind == b"unsubscribe":
        return "unsubscribe"
    return None


_TIMEOUT = getattr(asyncio, "timeout", None)  # Python 3.11+


async def bounded(coro: Any, timeout: float) -> Any:
    """``await coro`` within ``timeout`` seconds (asyncio.TimeoutError past it). On
    Python 3.11 asyncio.wait_for can swallow a cancellation that lands as the awaited
    thing completes (a waiter cancelled as its notification arrives would then wait
    on); asyncio.timeout cannot."""
    if _TIMEOUT is not None:
        async with _TIMEOUT(timeout):
            return await coro
    return await asyncio.wait_for(coro, timeout)


def cancelling(task: asyncio.Task[Any] | None) -> int:
    """Pending cancellation requests of ``task`` (Python 3.11+; 0 before)."""
    fn = getattr(task, "cancelling", None)
    return int(fn()) if fn is not None else 0


# ---- threads ---------------------------------------------------------------------------


class SyncListener:
    """The thread driver. Every state change and every send happens with ``_lock``
    held, so commands reach the wire in the order the state machine produced them."""

    def __init__(
        self,
        connect: Callable[[], Any],
        on_idle: Callable[[bytes, bytes], None],
        defer_s: float,
        timeout: float,
    ) -> None:
        self._connect = connect
        self._on_idle = on_idle
        self._confirm_timeout = timeout
        self._lock = threading.Lock()
        self._confirmed = threading.Condition(self._lock)
        self._core: Wakeups[bytes, LocalSubscription] = Wakeups(
            linger=LINGER_S, defer=defer_s, new_gid=C.waiter_id
        )
        self._conn: Any = None
        self._thread: threading.Thread | None = None
        self._closed = False

    def waiting(self, channel: bytes) -> Group[bytes, LocalSubscription] | None:
        """This process's waiters on ``channel``, if a caller waits on it."""
        return self._core.waiting(channel)

    def subscribe(self, channel: bytes, observer: bool = False) -> LocalSubscription:
        """A waiter on ``channel``, or an ``observer`` (also woken by a published
        value, payload ``OBSERVERS``, which waiters sleep through)."""
        with self._lock:
            if self._closed:
                raise StoreUnavailable("the Redis store is closed")
            sub = LocalSubscription(self._lock, partial(self._remove, channel))
            commands = self._core.subscribe(channel, sub, observer)
            if self._thread is None:  # the first waiter: connect, then start the reader
                try:
                    self._conn = self._connect()
                except _ERRORS as exc:
                    self._core.discard(channel, sub)
                    raise C.store_error(exc, "subscribe") from exc
                commands = self._core.on_connect().commands
                self._thread = threading.Thread(
                    target=self._run, name="idemlock-redis-listener", daemon=True
                )
                self._thread.start()
            self._send_all(commands)
            # Without a connection the reader subscribes again when it reconnects.
            self._confirmed.wait_for(
                lambda: self._core.confirmed(channel) or self._conn is None,
                self._confirm_timeout,
            )
        return sub

    def _send_all(self, commands: list[Command[bytes]]) -> None:  # with the lock held
        for cmd in commands:
            if self._conn is None:
                return
            try:
                self._conn.send_command(_VERBS[cmd.verb], *cmd.channels, check_health=False)
            except _ERRORS:
                self._drop()

    def _fire(self, wakes: list[LocalSubscription]) -> None:  # with the lock held
        for sub in wakes:
            sub._fire()

    def _remove(self, channel: bytes, sub: LocalSubscription) -> None:
        with self._lock:
            gid = self._core.unsubscribe(channel, sub, time.monotonic())
        if gid is not None:
            self._on_idle(channel, gid)

    def _drop(self) -> None:  # with the lock held: forget the connection, wake everyone
        conn, self._conn = self._conn, None
        self._fire(self._core.on_disconnect())
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
                self._fire(self._core.on_message(channel, msg[2], time.monotonic()))
                return
            confirmation = _confirmation(kind)
            if confirmation is not None and self._core.on_confirm(confirmation, channel):
                self._confirmed.notify_all()

    def _run(self) -> None:
        backoff = 0.05
        ping_sent = False
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                due = self._core.tick(now)
                self._fire(due.wakes)
                self._send_all(due.commands)
                conn = self._conn
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
                    up = self._core.on_connect()  # wakes everyone: something may be missed
                    self._fire(up.wakes)
                    self._send_all(up.commands)
                backoff, ping_sent = 0.05, False
                continue
            try:
                wait = IDLE_S if due.deadline is None else min(IDLE_S, due.deadline - now)
                wait = max(0.0, wait)
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
            self._fire(self._core.close())
            self._confirmed.notify_all()
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.disconnect()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)


_L = TypeVar("_L", SyncListener, "AsyncListener")


class _NodeListeners(Generic[_L]):
    """What both drivers' sets of Cluster listeners share: one listener per node, made
    on first use by ``make(node)``, a channel's node told by ``route(channel)``."""

    def __init__(self, route: Callable[[bytes], str], make: Callable[[str], _L]) -> None:
        self._route = route
        self._make: Callable[[str], _L] = make
        self._by_node: dict[str, _L] = {}
        self._closed = False

    def waiting(self, channel: bytes) -> Group[bytes, Any] | None:
        # Looked up in every node's listener: the slot may have moved since the
        # channel was subscribed (a handful of nodes, so a handful of dict look-ups).
        for listener in list(self._by_node.values()):
            g = listener.waiting(channel)
            if g is not None:
                return g
        return None

    def _listener_for(self, channel: bytes) -> _L:
        if self._closed:
            raise StoreUnavailable("the Redis store is closed")
        node = self._route(channel)
        listener = self._by_node.get(node)
        if listener is None:
            listener = self._by_node[node] = self._make(node)
        return listener


class SyncNodeListeners(_NodeListeners[SyncListener]):
    """On Redis Cluster: one :class:`SyncListener` per node, each channel subscribed on
    the node that holds its slot (where the scripts PUBLISH). A PUBLISH reaches its own
    node's subscribers at once; the other nodes get it over the cluster bus, which
    batches small messages: measured 12-38 ms on a loaded machine, past the hand-off
    window, so the chosen waiter missed its turn in one hand-off out of ten. A channel
    whose node cannot be told (slot not covered) goes to any node, as before."""

    def __init__(self, route: Callable[[bytes], str], make: Callable[[str], SyncListener]) -> None:
        super().__init__(route, make)
        self._lock = threading.Lock()

    def subscribe(self, channel: bytes, observer: bool = False) -> LocalSubscription:
        with self._lock:
            listener = self._listener_for(channel)
        return listener.subscribe(channel, observer)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            listeners = list(self._by_node.values())
        for listener in listeners:
            listener.close()


# ---- asyncio ---------------------------------------------------------------------------


class AsyncSubscription:
    """One waiter's mailbox: a notification that arrives before ``wait`` is kept."""

    __slots__ = ("_channel", "_event", "_listener")

    def __init__(self, listener: AsyncListener, channel: bytes) -> None:
        self._listener = listener
        self._channel = channel
        self._event = asyncio.Event()

    def _fire(self) -> None:
        self._event.set()

    async def wait(self, timeout: float) -> bool:
        if not self._event.is_set() and timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await bounded(self._event.wait(), timeout)
        fired = self._event.is_set()
        self._event.clear()
        return fired

    async def aclose(self) -> None:
        await self._listener.remove(self)


class AsyncListener:
    """The task driver, on one event loop: a task reads the connection, one timer
    handle runs the state machine's deadlines, and commands go out through one outbox
    in the order the state machine produced them."""

    def __init__(
        self,
        connect: Callable[[], Awaitable[Any]],
        on_idle: Callable[[bytes, bytes], Awaitable[None]],
        defer_s: float,
        timeout: float,
    ) -> None:
        self._connect = connect
        self._on_idle = on_idle
        self._confirm_timeout = timeout
        self._core: Wakeups[bytes, AsyncSubscription] = Wakeups(
            linger=LINGER_S, defer=defer_s, new_gid=C.waiter_id
        )
        self._conn: Any = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self._connecting: asyncio.Lock | None = None
        self._sending: asyncio.Lock | None = None
        self._outbox: deque[Command[bytes]] = deque()
        self._changed: asyncio.Event | None = None  # set when a confirmation or drop came
        self._timer: asyncio.TimerHandle | None = None
        self._background: set[asyncio.Task[None]] = set()

    def waiting(self, channel: bytes) -> Group[bytes, AsyncSubscription] | None:
        return self._core.waiting(channel)

    async def subscribe(self, channel: bytes, observer: bool = False) -> AsyncSubscription:
        if self._closed:
            raise StoreUnavailable("the Redis store is closed")
        sub = AsyncSubscription(self, channel)
        self._outbox.extend(self._core.subscribe(channel, sub, observer))
        if self._task is None or self._task.done():
            try:
                await self._start()
            except BaseException as exc:
                self._core.discard(channel, sub)
                if isinstance(exc, _ERRORS):
                    raise C.store_error(exc, "subscribe") from exc
                raise
        try:
            await self._flush()
            if not self._core.confirmed(channel) and self._conn is not None:
                with contextlib.suppress(asyncio.TimeoutError):
                    await bounded(self._until_confirmed(channel), self._confirm_timeout)
        except BaseException:  # cancelled: leave no waiter behind (it lingers, as usual)
            now = asyncio.get_running_loop().time()
            self._core.unsubscribe(channel, sub, now)
            self._arm(now + self._core.linger)
            raise
        return sub

    async def _start(self) -> None:
        if self._connecting is None:
            self._connecting = asyncio.Lock()
        async with self._connecting:
            if self._conn is None and self._task is None:
                self._conn = await self._connect()
                self._outbox.extend(self._core.on_connect().commands)
            if self._task is None or self._task.done():
                self._task = asyncio.get_running_loop().create_task(self._run())

    async def _until_confirmed(self, channel: bytes) -> None:
        while not self._core.confirmed(channel) and self._conn is not None:
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()

    def _signal(self) -> None:
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()

    async def _flush(self) -> None:
        """Send what the outbox holds, in order (one sender at a time)."""
        if self._sending is None:
            self._sending = asyncio.Lock()
        async with self._sending:
            while self._outbox:
                cmd = self._outbox.popleft()
                conn = self._conn
                if conn is None:
                    return  # the next connection subscribes every group
                try:
                    await conn.send_command(_VERBS[cmd.verb], *cmd.channels, check_health=False)
                except _ERRORS:
                    await self._drop(conn)

    def _flush_later(self) -> None:
        task = asyncio.get_running_loop().create_task(self._flush())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _fire(self, wakes: list[AsyncSubscription]) -> None:
        for sub in wakes:
            sub._fire()

    def _arm(self, at: float) -> None:
        """Tick the state machine at ``at`` (loop time) at the latest."""
        if self._closed or (self._timer is not None and self._timer.when() <= at):
            return
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._closed:
            return
        due = self._core.tick(asyncio.get_running_loop().time())
        self._fire(due.wakes)
        if due.commands:
            self._outbox.extend(due.commands)
            self._flush_later()
        if due.deadline is not None:
            self._arm(due.deadline)

    async def remove(self, sub: AsyncSubscription) -> None:
        now = asyncio.get_running_loop().time()
        gid = self._core.unsubscribe(sub._channel, sub, now)
        if self._core.waiting(sub._channel) is None:
            self._arm(now + self._core.linger)  # linger, then unsubscribe
        if gid is not None:
            await self._on_idle(sub._channel, gid)

    async def _drop(self, conn: Any) -> None:
        """Forget a failed connection and wake every waiter; the reader, parked on the
        closed connection, fails too and reconnects."""
        if self._conn is not conn:
            return
        self._conn = None
        self._outbox.clear()  # meant for the old connection; the next one resubscribes
        self._fire(self._core.on_disconnect())
        self._signal()
        with contextlib.suppress(Exception):
            await conn.disconnect(nowait=True)

    def _dispatch(self, msg: Any) -> None:
        if not isinstance(msg, list) or len(msg) < 3:
            return
        kind, channel = msg[0], msg[1]
        if kind == b"message":
            now = asyncio.get_running_loop().time()
            wakes = self._core.on_message(channel, msg[2], now)
            self._fire(wakes)
            at = self._core.deferred(channel)  # handed to another process
            if at is not None:
                self._arm(at)  # the waiters' deferred wake
            return
        confirmation = _confirmation(kind)
        if confirmation is not None and self._core.on_confirm(confirmation, channel):
            self._signal()

    async def _run(self) -> None:
        backoff = 0.05
        ping_sent = False
        while not self._closed:
            conn = self._conn
            if conn is None:
                before = cancelling(asyncio.current_task())
                try:
                    conn = await self._connect()
                except Exception:
                    await asyncio.sleep(backoff)
                    backoff = min(1.0, backoff * 2)
                    continue
                if self._closed or cancelling(asyncio.current_task()) > before:
                    # Closed meanwhile, or cancelled (asyncio.run() ending) while the
                    # connect swallowed the cancellation (wait_for, Python < 3.12):
                    # end, or the loop's shutdown would wait for this task forever.
                    with contextlib.suppress(Exception):
                        await conn.disconnect(nowait=True)
                    if self._closed:
                        return
                    raise asyncio.CancelledError()
                self._conn = conn
                up = self._core.on_connect()  # wakes everyone: something may be missed
                self._fire(up.wakes)
                self._outbox.extend(up.commands)
                await self._flush()
                backoff, ping_sent = 0.05, False
                continue
            try:
                msg = await conn.read_response(timeout=IDLE_S, disconnect_on_error=False)
                if msg is not None:
                    self._dispatch(msg)
                    ping_sent = False
                elif ping_sent:
                    raise ConnectionError("the pub/sub connection did not answer a PING")
                else:
                    await conn.send_command("PING", check_health=False)
                    ping_sent = True
            except asyncio.CancelledError:
                raise
            except Exception:
                if self._closed:
                    return
                await self._drop(conn)

    async def aclose(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._fire(self._core.close())
        self._signal()
        self._outbox.clear()
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                await conn.disconnect(nowait=True)


class AsyncNodeListeners(_NodeListeners[AsyncListener]):
    """:class:`SyncNodeListeners` for one event loop: an :class:`AsyncListener` per
    Cluster node, each channel subscribed on the node of its slot."""

    async def subscribe(self, channel: bytes, observer: bool = False) -> AsyncSubscription:
        return await self._listener_for(channel).subscribe(channel, observer)

    async def aclose(self) -> None:
        self._closed = True
        for listener in list(self._by_node.values()):
            await listener.aclose()
