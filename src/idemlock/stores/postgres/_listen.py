"""LISTEN/NOTIFY hand-off: one dedicated connection per store, shared by all its waiters.

Each waited-on key has its own channel (a hash, see ``Statements.channel``); the
listener LISTENs on a channel while at least one subscription to it is open, so the
server only sends this process the notifications it waits for. Freeing statements
call ``pg_notify`` in the same statement, so the notification is sent exactly when
the change commits.

An election's observer (a ``"leader"`` channel) listens on its key's lock channel as an
*observer*: it wakes for whatever wakes the key's waiters, and alone for payload ``!``,
which a grant or renew that publishes a value sends (a term began, or its value
changed), so the key's waiters sleep through a term's renewals.

The state (reference counts, linger, reconnects) is :class:`idemlock._core.wakeups.Wakeups`;
this module is its driver: a background thread reads the socket and fires the
waiters' :class:`~idemlock.stores._local.LocalSubscription` mailboxes, which serve
threads and asyncio alike (the async store uses the same listener). ``subscribe``
registers the waiter first and returns only once the server has confirmed the
LISTEN, so a notification sent after ``subscribe`` returned is never missed. If the
connection drops, every waiter is woken to re-check the store and the thread
reconnects and LISTENs again.

Fair hand-off: each waited-on lock channel has a random waiter id (``gid``) per
process, which the store registers in its queue of waiters (see ``_sql.ACQUIRE``). A
release names the chosen process's id in the payload: only that process's waiters
wake at once; the others are woken ``defer`` seconds later (after the hand-off window)
unless a newer notification came. When the last waiter of a registered channel
leaves, the reader thread drops the registration on its connection.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import psycopg
from psycopg import sql

from ..._core.wakeups import Command, Group, Wakeups
from ..._errors import StoreUnavailable
from ..._logfields import fields as log_fields
from .._local import AsyncLocalSubscription, LocalSubscription
from . import _watchdog

log = logging.getLogger("idemlock")
_LISTEN_FAILED = log_fields(store="postgres", operation="listen", outcome="error")

#: longest pause between reconnection attempts while the server is away (seconds)
RECONNECT_MAX = 1.0
#: seconds a channel stays LISTENed after its last waiter left
LINGER = 2.0
#: channels kept LISTENed without waiters, at most
MAX_LINGERING = 1000
#: seconds the listener waits for its own probe notification before it concludes that
#: notifications do not reach it (a transaction pooler in between)
PROBE_WAIT = 1.0
#: seconds between re-checks of every waiter while notifications are not known to
#: reach the listener (they are woken to poll the store: hand-offs stay bounded)
PULSE = 0.1


#: A waiter on one channel: ``wait`` from threads, ``wait_async`` from asyncio; a
#: notification before the wait is remembered.
ListenSubscription = LocalSubscription
#: The asyncio face of a :class:`ListenSubscription`.
AsyncListenSubscription = AsyncLocalSubscription


def _new_gid() -> bytes:
    # Text: it travels as a NOTIFY payload and a column value.
    return os.urandom(8).hex().encode()


class Listener:
    def __init__(
        self,
        connect: Callable[[], psycopg.Connection[Any]],
        timeout: float,
        unregister: Any = None,
        handoff: float = 0.0,
        probe: Callable[[str], None] | None = None,
        secrets: list[str] | None = None,
    ) -> None:
        self._connect = connect
        #: sends a NOTIFY on a channel the way the store's statements do
        self._probe = probe
        self._secrets = secrets or []
        #: whether notifications reach this listener: None until its probe came back
        #: (or did not, within PROBE_WAIT: then False and waiters are pulsed)
        self.notifies: bool | None = None if probe is not None else True
        self._probe_channel = "idemlock_probe_" + os.urandom(6).hex()
        self._probe_due: float | None = None
        self._next_pulse = 0.0
        self._warned = False
        #: the statement (a ``_sql.Stmt``) that drops a process's registration
        self._unregister = unregister
        #: (channel, gid) registrations to drop, by the reader thread
        self._leaving: list[tuple[str, bytes]] = []
        #: the bound on one LISTEN/UNLISTEN round trip (seconds), even on a silent network
        self._timeout = timeout
        # _io serializes every use of the connection (LISTEN, UNLISTEN, reading) and
        # every decision that leads to a command, so commands reach the server in the
        # order the state machine produced them. _state guards the state machine and
        # the mailboxes, and is never held across I/O.
        self._io = threading.Lock()
        self._state = threading.Lock()
        self._core: Wakeups[str, LocalSubscription] = Wakeups(
            linger=LINGER,
            max_lingering=MAX_LINGERING,
            # a hand-off to another process: ours re-check once its window is over
            defer=handoff + 0.005,
            new_gid=_new_gid,
        )
        self._conn: psycopg.Connection[Any] | None = None
        self._deadline: float | None = None  # when the reader must tick next
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)  # a full pipe already means "wake up"
        self._closed = False
        #: notifications received (for tests and metrics)
        self.received = 0

    # ---- subscriptions ------------------------------------------------------------

    def subscribe(self, channel: str, observer: bool = False) -> LocalSubscription:
        """Listen on ``channel`` (one server round trip unless already listening); an
        ``observer`` is also woken by a published value (payload ``!``)."""
        sub = LocalSubscription(self._state, partial(self._release, channel))
        try:
            with self._io:
                if self._closed:
                    raise StoreUnavailable("the PostgreSQL store is closed")
                # Registered before LISTEN: nothing received after it is lost.
                with self._state:
                    commands = self._core.subscribe(channel, sub, observer)
                if self._conn is None or self._conn.closed:
                    self._ensure_conn()
                else:
                    self._perform(self._conn, commands)
        except BaseException:
            with self._state:
                self._core.discard(channel, sub)
            raise
        self._start_thread()
        if self.notifies is not True:
            self._nudge()  # the reader pulses waiters while notifications fail
        return sub

    def try_subscribe(self, channel: str, observer: bool = False) -> LocalSubscription | None:
        """Subscribe without I/O and without blocking, if the channel is already listened
        on; else None (the caller then calls ``subscribe`` from a worker thread)."""
        if not self._io.acquire(blocking=False):
            return None
        try:
            if self._closed or self._conn is None or self._conn.closed:
                return None
            with self._state:
                if not self._core.confirmed(channel):
                    return None
                sub = LocalSubscription(self._state, partial(self._release, channel))
                self._core.subscribe(channel, sub, observer)  # no command: already listening
            if self.notifies is not True:
                self._nudge()  # the reader pulses waiters while notifications fail
            return sub
        finally:
            self._io.release()

    def is_listening(self, channel: str) -> bool:
        """Whether ``channel`` is LISTENed on a live connection (for tests and health
        checks; False while reconnecting)."""
        conn = self._conn
        return conn is not None and not conn.closed and self._core.confirmed(channel)

    def waiting(self, channel: str) -> Group[str, LocalSubscription] | None:
        """The group of ``channel`` while a local waiter waits on it (its ``gid`` is the
        process's waiter id; set ``registered`` once the store queued it)."""
        with self._state:
            return self._core.waiting(channel)

    def waiter_id(self, channel: str) -> tuple[bytes, bool] | None:
        """This process's waiter id for ``channel`` while it has one (also while the
        channel lingers after its last waiter left: a hand-off window may still name
        it), and whether a local waiter waits on it now; None without one.

        A waiting process's attempt (about to run) registers it: the group is marked
        registered before the attempt is sent, so that a caller cancelled meanwhile
        still has the registration dropped when the last waiter leaves.

        An election's observers do not wait for a permit: a channel only they listen on
        does not queue the process (a hand-off window kept for it would go untaken)."""
        with self._state:
            g = self._core.waiting(channel)
            if g is not None:
                g.registered = True
                return g.gid, True
            # lingering (the group is kept, without subscribers), or observed only
            idle = self._core.group(channel)
            return (idle.gid, False) if idle is not None else None

    def _release(self, channel: str, sub: LocalSubscription) -> None:
        with self._state:
            gid = self._core.unsubscribe(channel, sub, time.monotonic(), LINGER)
            if gid is not None and self._unregister is not None:
                self._leaving.append((channel, gid))
        # The reader thread UNLISTENs (LINGER) and unregisters later, so closing never
        # waits on I/O.
        self._nudge()

    def _nudge(self) -> None:
        with self._state:
            if self._wake_w < 0:
                return  # closed: the descriptor number may belong to another file now
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")

    # ---- connection -----------------------------------------------------------------

    def _ensure_conn(self) -> psycopg.Connection[Any]:
        # Called with _io held.
        if self._conn is not None:
            if not self._conn.closed:
                return self._conn
            self._drop()  # broken behind our back: waiters re-check, lingering is forgotten
        try:
            conn = self._connect()
        except psycopg.Error as exc:
            detail = str(exc)
            for secret in self._secrets:
                detail = detail.replace(secret, "***")
            raise StoreUnavailable(
                f"cannot open the PostgreSQL connection that waits for notifications: {detail}"
            ) from exc
        conn.add_notify_handler(self._on_notify)
        self._conn = conn
        with self._state:
            up = self._core.on_connect()  # LISTEN every channel waited on
            self._fire(up.wakes)
        self._perform(conn, up.commands)
        if self.notifies is None and self._probe_due is None:
            self._send_probe(conn)
        return conn

    def _send_probe(self, conn: psycopg.Connection[Any]) -> None:
        """LISTEN on a channel of our own and NOTIFY it the store's way: if it does not
        come back within PROBE_WAIT, notifications do not reach us (the reader thread
        then says so once, and pulses the waiters). Called with _io held."""
        assert self._probe is not None
        self._run(conn, "LISTEN", self._probe_channel)
        try:
            self._probe(self._probe_channel)
        except psycopg.Error as exc:  # tried again on the next connection
            log.warning(
                "idemlock: could not check that PostgreSQL notifications arrive: %s",
                exc,
                extra=_LISTEN_FAILED,
            )
            return
        now = time.monotonic()
        self._probe_due = now + PROBE_WAIT
        self._next_pulse = now + PULSE  # no pulse before the probe had its chance
        self._nudge()

    def _check_probe(self, now: float) -> None:
        """With _io held, in the reader thread: conclude the probe once it is overdue."""
        due = self._probe_due
        if self.notifies is not None or due is None or now < due:
            return
        self.notifies = False
        if not self._warned:
            self._warned = True
            log.warning(
                "idemlock: PostgreSQL notifications do not reach this store's listener: its "
                "URL likely goes through a transaction-pooling connection pooler (PgBouncer, "
                "RDS Proxy, Supavisor...), where LISTEN does not work. Waiters now re-check "
                "the store every %gs instead of being woken. Pass listen_url= (or "
                "?listen_url= in the URL, percent-encoded) with a postgresql:// URL straight "
                "to the server to have hand-offs pushed again",
                PULSE,
                extra=_LISTEN_FAILED,
            )

    def _perform(self, conn: psycopg.Connection[Any], commands: list[Command[str]]) -> None:
        # Called with _io held. LISTEN answers before the next statement: confirmed.
        for cmd in commands:
            verb = "LISTEN" if cmd.verb == "subscribe" else "UNLISTEN"
            for channel in cmd.channels:
                self._run(conn, verb, channel)
                with self._state:
                    self._core.on_confirm(cmd.verb, channel)

    def _run(self, conn: psycopg.Connection[Any], verb: str, channel: str) -> None:
        query = sql.SQL(verb + " {}").format(sql.Identifier(channel))
        wd = _watchdog.WATCHDOG
        armed = wd.arm(conn, time.monotonic() + self._timeout)
        try:
            conn.execute(query)
            # libpq may already hold notifications read along with the reply.
            self._drain(conn)
            self._nudge()  # a deferred wake set meanwhile: the reader re-plans its wait
        except psycopg.Error as exc:
            self._drop()
            if armed.fired:
                raise StoreUnavailable(
                    f"PostgreSQL did not answer {verb} within timeout={self._timeout:g}s on the "
                    "notification connection (the server or the network is stuck or silent)"
                ) from exc
            raise StoreUnavailable(f"{verb} failed on the notification connection: {exc}") from exc
        finally:
            wd.disarm(armed)

    def _drain(self, conn: psycopg.Connection[Any]) -> None:
        while (n := conn.pgconn.notifies()) is not None:
            self._dispatch(n.relname.decode(), n.extra)

    def _on_notify(self, n: psycopg.Notify) -> None:
        # Notifications psycopg read while a LISTEN/UNLISTEN ran.
        self._dispatch(n.channel, n.payload.encode())

    def _dispatch(self, channel: str, payload: bytes) -> None:
        if channel == self._probe_channel:
            self.notifies = True
            return
        self.received += 1
        with self._state:
            # The payloads the statements send: '' (claims, breaks: no filter, as None),
            # '*' (a release with nobody queued: everyone), a waiter id (a release's
            # hand-off: that process now, the others later) and '!' (a grant or renew
            # published a value: observers alone); observers wake for each.
            wakes = self._core.on_message(channel, payload or None, time.monotonic())
            self._fire(wakes)

    def _drop_registrations(self, conn: psycopg.Connection[Any]) -> None:
        """Drop the registrations of processes that stopped waiting (with _io held); a
        failure leaves them to lapse."""
        with self._state:
            leaving, self._leaving = self._leaving, []
        stmt = self._unregister
        for channel, gid in leaving:
            args = stmt.args({"chan": channel, "gid": gid.decode()})
            wd = _watchdog.WATCHDOG
            armed = wd.arm(conn, time.monotonic() + self._timeout)
            try:
                psycopg.RawCursor(conn).execute(stmt.sql, args, prepare=False)
                self._drain(conn)
            finally:
                wd.disarm(armed)

    def _fire(self, wakes: list[LocalSubscription]) -> None:  # with _state held
        for sub in wakes:
            sub._fire()

    def _drop(self) -> None:
        """Forget a broken connection and wake every waiter to re-check the store."""
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()
        with self._state:
            self._leaving.clear()  # they lapse on their own
            self._fire(self._core.on_disconnect())

    # ---- the reader thread --------------------------------------------------------

    def _start_thread(self) -> None:
        with self._state:
            if self._thread is not None or self._closed:
                return
            self._thread = threading.Thread(
                target=self._loop, name="idemlock-pg-listener", daemon=True
            )
        self._thread.start()

    def _loop(self) -> None:
        delay = 0.05
        while not self._closed:
            try:
                delay = self._step(delay)
            except Exception:  # a bug here must not end hand-offs for good
                log.exception(
                    "idemlock: PostgreSQL notification reader failed; restarting it",
                    extra=_LISTEN_FAILED,
                )
                with self._io:
                    self._drop()
                time.sleep(delay)

    def _step(self, delay: float) -> float:
        """Wait for the socket, a nudge or the next deadline, then read notifications,
        reconnect or UNLISTEN idle channels. Returns the next reconnection delay."""
        conn = self._conn
        fd = -1
        if conn is not None:
            with contextlib.suppress(Exception):
                fd = conn.fileno()
        with self._state:
            want = self._core.has_waiters()
            wake = self._wake_r
            deadline = self._deadline
        if wake < 0:
            return delay  # closed
        poller = select.poll()  # not select(): it fails on descriptors above 1023
        poller.register(wake, select.POLLIN)
        if fd >= 0:
            poller.register(fd, select.POLLIN)
        # While away (no connection) and someone waits, retry the connection soon; else
        # wake up when the state machine is due (a lingering channel to UNLISTEN).
        timeout: float | None = delay if fd < 0 and want else None
        if deadline is not None and fd >= 0:
            due = max(0.0, deadline - time.monotonic())
            timeout = due if timeout is None else min(timeout, due)
        if fd >= 0 and (
            (want and self.notifies is not True)
            or (self.notifies is None and self._probe_due is not None)
        ):
            # Not (yet) known to hear notifications: pulse waiters, conclude the probe.
            timeout = PULSE if timeout is None else min(timeout, PULSE)
        ready = {f for f, _ in poller.poll(None if timeout is None else timeout * 1000)}
        if wake in ready:
            with contextlib.suppress(OSError):
                os.read(wake, 4096)
        with self._io:
            if self._closed:
                return delay
            if self._conn is None or self._conn.closed:
                if not want:
                    return delay
                try:
                    self._ensure_conn()  # wakes every waiter: notifications may be lost
                except StoreUnavailable:
                    return min(delay * 2, RECONNECT_MAX)
                return 0.05
            conn = self._conn
            try:
                if fd in ready:
                    conn.pgconn.consume_input()
                    self._drain(conn)
                now = time.monotonic()
                self._check_probe(now)
                with self._state:
                    due_now = self._core.tick(now)
                    self._fire(due_now.wakes)
                    self._deadline = due_now.deadline
                    if self.notifies is not True and now >= self._next_pulse:
                        self._next_pulse = now + PULSE
                        self._fire(self._core.subscribers())
                self._perform(conn, due_now.commands)
                if self._leaving:
                    self._drop_registrations(conn)
            except (psycopg.Error, OSError) as exc:
                log.warning(
                    "idemlock: PostgreSQL notification connection lost: %s",
                    exc,
                    extra=_LISTEN_FAILED,
                )
                self._drop()
            except StoreUnavailable as exc:  # an UNLISTEN failed (already dropped)
                log.warning(
                    "idemlock: PostgreSQL notification connection lost: %s",
                    exc,
                    extra=_LISTEN_FAILED,
                )
        return delay

    def close(self) -> None:
        with self._state:
            self._closed = True
            thread = self._thread
        self._nudge()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        with self._io:
            conn, self._conn = self._conn, None
            if conn is not None:
                with contextlib.suppress(Exception):
                    conn.close()
        with self._state:
            self._fire(self._core.close())
            fds, (self._wake_r, self._wake_w) = (self._wake_r, self._wake_w), (-1, -1)
        for fd in fds:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
