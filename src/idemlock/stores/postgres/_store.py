"""The PostgreSQL store adapter, sync (:class:`PostgresStore`) and async
(:class:`AsyncPostgresStore`), on a psycopg_pool connection pool.

Both classes build the same statements and read the replies with the same functions;
they differ only in how a statement is run. Every port method is one statement run in
autocommit on a pooled connection (see :mod:`._sql`).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import psycopg
import psycopg_pool
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from psycopg.types.numeric import Int8

from ... import _urls
from ..._core.port import (
    Acquired,
    Busy,
    Channel,
    ClaimReply,
    Done,
    Granted,
    Held,
    LockRow,
    Mismatch,
    RecordRow,
)
from ..._errors import ConfigurationError, StoreCorrupt, StoreUnavailable
from . import _schema, _watchdog
from ._listen import AsyncListenSubscription, Listener, ListenSubscription
from ._pool import CancellableAsyncPool
from ._sql import RENEW_MANY, Statements, Stmt

Row = tuple[Any, ...]

log = logging.getLogger("idemlock")

DEFAULT_SCHEMA = "idemlock"
#: rows deleted per purge statement
PURGE_BATCH = 5000
#: seconds a store keeps its lane connection before handing it back to its pool
LANE_SECONDS = 60.0
#: re-runs of a claim/acquire/fence statement that raced a concurrent commit (see _RETRY)
MAX_RACE_RETRIES = 100

_SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_STATES = ("in_flight", "completed")


class _Retry:
    """Marker: the statement's snapshot and the row version its upsert conflicted with
    disagree (a concurrent commit in between); it changed nothing, and running it
    again gives a consistent answer."""


_RETRY = _Retry()


_I8_MAX = 2**63 - 1


def _renew_many(
    store: Any, items: Sequence[tuple[Any, ...]]
) -> tuple[Stmt, dict[str, Any], dict[tuple[str, int], int]]:
    """The batched renewal statement (rendered once per store), its array parameters,
    and where each reply row (kind, position) goes in the answer."""
    stmt = getattr(store, "_renew_many_stmt", None)
    if stmt is None:
        stmt = store._renew_many_stmt = Stmt.render(RENEW_MANY, store.statements.schema)
    names = ("cns", "ckey", "ctoken", "clease", "lns", "lkey", "lowner", "ltoken", "lttl")
    cols: dict[str, list[Any]] = {k: [] for k in names}
    where: dict[tuple[str, int], int] = {}
    for i, item in enumerate(items):
        if item[0] == "claim":
            _, ns, key, token, lease_ms = item
            for name, value in zip(("cns", "ckey", "ctoken"), (ns, key, token), strict=True):
                cols[name].append(value)
            cols["clease"].append(int(_i8(lease_ms)))
            where[("c", len(cols["cns"]))] = i
        else:
            _, ns, key, owner, token, ttl_ms = item
            for name, value in zip(("lns", "lkey", "lowner"), (ns, key, owner), strict=True):
                cols[name].append(value)
            cols["ltoken"].append(int(_i8(token)))
            cols["lttl"].append(int(_i8(ttl_ms)))
            where[("l", len(cols["lns"]))] = i
    return stmt, cols, where


def _renewed_many(
    rows: Sequence[Any], where: dict[tuple[str, int], int], count: int
) -> list[int | None]:
    out: list[int | None] = [None] * count
    for kind, pos, expires in rows:
        out[where[(str(kind), int(pos))]] = int(expires)
    return out


def _i8(value: int) -> Int8:
    """An int sent as bigint; out of range is the caller's error, not a bare
    OverflowError from inside psycopg."""
    if not -_I8_MAX - 1 <= value <= _I8_MAX:
        raise ConfigurationError(
            f"a value passed to the PostgreSQL store does not fit a 64-bit integer "
            f"({value!r}); fencing tokens, and leases and ttls in milliseconds, must be "
            "below 2**63"
        )
    return Int8(value)


def _secrets_of(conninfo: Any) -> list[str]:
    """The secret values a conninfo string holds (userinfo password, ``?password=``),
    to mask them in messages; the shared helper lives in idemlock._urls."""
    find = getattr(_urls, "secrets_in", None)
    if not isinstance(conninfo, str) or find is None:
        return []
    found: list[str] = find(conninfo)
    return found


#: seconds one call may take, connection wait included (A1)
DEFAULT_TIMEOUT = 5.0


def _wait(deadline: float) -> float:
    """Seconds left to wait for a pooled connection (psycopg_pool needs > 0)."""
    return max(0.001, deadline - time.monotonic())


def clone_pool(pool: Any, health: Health) -> Any:
    """A new, unopened pool with the settings of ``pool`` (a forked child cannot use
    the parent's: its connections are shared with the parent and its threads are
    gone). Its connection attempts are recorded in ``health``."""
    cls = (
        CancellableAsyncPool
        if isinstance(pool, psycopg_pool.AsyncConnectionPool)
        else psycopg_pool.ConnectionPool
    )
    options: dict[str, Any] = {}
    for name in ("configure", "reset"):
        value = getattr(pool, "_" + name, None)
        if value is not None:
            options[name] = value
    return cls(
        pool.conninfo,
        kwargs=pool.kwargs,
        min_size=pool.min_size,
        max_size=pool.max_size,
        timeout=pool.timeout,
        max_idle=pool.max_idle,
        max_lifetime=pool.max_lifetime,
        reconnect_timeout=pool.reconnect_timeout,
        connection_class=recording_class(pool.connection_class, health),
        name=pool.name,
        open=False,
        **options,
    )


def check_schema(schema: object) -> str:
    if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
        raise ConfigurationError(
            f"schema must be a plain PostgreSQL identifier (letters, digits, underscores, "
            f"at most 63 characters, not starting with a digit), got {schema!r}"
        )
    return schema


def unavailable(exc: BaseException, what: str) -> StoreUnavailable:
    """A driver error as StoreUnavailable (the caller chains the cause)."""
    if isinstance(exc, psycopg_pool.PoolTimeout):
        msg = f"no PostgreSQL connection became free in time for {what}: {exc}"
    elif isinstance(exc, psycopg.errors.UndefinedTable):
        msg = (
            f"the idemlock tables are missing ({exc}); run `idemlock migrate --url ...` "
            "or let the store create them (auto_migrate=True)"
        )
    else:
        msg = f"PostgreSQL failed during {what}: {type(exc).__name__}: {exc}"
    return StoreUnavailable(msg.strip())


def _resolve(value: Any) -> Any:
    """A pool setting that may be a value, a function or an async function (psycopg_pool
    allows all three for conninfo and kwargs). Runs in the listener's thread, which has
    no event loop of its own."""
    if callable(value):
        value = value()
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
    return value


async def _awaited(aw: Any) -> Any:
    return await aw


def _lane_spent(conn: Any, since: float) -> bool:
    """Whether the lane connection must go back to the pool now."""
    return bool(
        conn.closed
        or getattr(conn, "broken", False)
        or conn.info.transaction_status != TransactionStatus.IDLE
        or time.monotonic() - since > LANE_SECONDS
    )


def _is_disconnect(exc: BaseException, conn: Any) -> bool:
    """Whether a statement failed because its pooled connection was dead (None: no
    connection was borrowed, e.g. a pool timeout, which a retry would not help)."""
    return (
        isinstance(exc, psycopg.OperationalError)
        and conn is not None
        and (conn.closed or bool(getattr(conn, "broken", False)))
    )


# ---- replies ------------------------------------------------------------------------


def _state(value: object, ns: str, key: str) -> Literal["in_flight", "completed"]:
    if value not in _STATES:
        raise StoreCorrupt(
            f"the claim record {key!r} in {ns!r} has state {value!r}, which idemlock never "
            "writes; the row was changed by something else: forget the key"
        )
    return cast('Literal["in_flight", "completed"]', value)


def _claim_reply(rows: list[Row], ns: str, key: str, token: str) -> ClaimReply | _Retry:
    if not rows:
        return _RETRY
    granted, fence, exp, now, state, result, same_token, same_fp = rows[0]
    if granted:
        return Granted(token, fence, exp, exp - now)
    if exp <= now:
        return _RETRY
    st = _state(state, ns, key)
    if st == "in_flight" and same_token:
        return Granted(token, fence, exp, exp - now)
    if not same_fp:
        return Mismatch(st)
    if st == "completed":
        if result is None:
            raise StoreCorrupt(f"the completed record {key!r} in {ns!r} has no result")
        return Done(bytes(result), exp)
    return Busy(exp, exp - now)


def _acquire_reply(rows: list[Row], owner: str) -> Acquired | Held | _Retry:
    if not rows:
        return _RETRY
    acquired, token, exp, now, holder = rows[0]
    if acquired:
        return Acquired(token, exp, exp - now)
    if exp <= now or holder == owner:
        return _RETRY
    return Held(exp, exp - now)


def _fence_reply(rows: list[Row], token: int) -> tuple[bool, int] | _Retry:
    if not rows:
        return _RETRY
    accepted, highest = rows[0]
    if accepted:
        return True, int(highest)
    if highest <= token:
        return _RETRY
    return False, int(highest)


def _record_rows(rows: list[Row], schema: str) -> list[RecordRow]:
    out: list[RecordRow] = []
    bad: list[Row] = []
    for row in rows:
        ns, key, st, fence, exp = row
        if st in _STATES:
            out.append(RecordRow(ns, key, st, fence, exp))
        else:
            # A listing shows a row it cannot read instead of failing for all (A3).
            bad.append(row)
            out.append(RecordRow(ns, key, "corrupt", fence, exp))
    if bad:
        shown = repr(bad[0])[:300]
        log.warning(
            "idemlock: PostgreSQL table %s.claims holds %d row(s) with a state idemlock "
            "never writes, listed as corrupt (first: %s); forget those keys to recover",
            schema,
            len(bad),
            shown,
        )
    return out


def _lock_rows(rows: list[Row]) -> list[LockRow]:
    # Every column is typed and NOT NULL: a lock row is always readable.
    return [LockRow(ns, key, owner, token, exp) for ns, key, owner, token, exp in rows]


def _nothing(reply: Any) -> None:
    """No undo: a settling call (complete, abandon, release) may take effect."""
    return None


# ---- the shared half ------------------------------------------------------------------


class Health:
    """What the pool's own connection attempts found: the last failure (None once one
    succeeds). Calls read it to name the cause of an outage at once instead of
    waiting for a connection that is not coming (issue 10 item 19)."""

    __slots__ = ("down",)

    def __init__(self) -> None:
        self.down: BaseException | None = None


def recording_class(base: type[Any], health: Health) -> type[Any]:
    """A connection class for psycopg_pool that records each connection attempt's
    outcome in ``health`` (the pool only logs its failures)."""
    if issubclass(base, psycopg.AsyncConnection):

        class _AsyncRecording(base):  # type: ignore[misc]
            @classmethod
            async def connect(cls, *args: Any, **kwargs: Any) -> Any:
                try:
                    conn = await super().connect(*args, **kwargs)
                except BaseException as exc:
                    health.down = exc
                    raise
                health.down = None
                return conn

        return _AsyncRecording

    class _Recording(base):  # type: ignore[misc]
        @classmethod
        def connect(cls, *args: Any, **kwargs: Any) -> Any:
            try:
                conn = super().connect(*args, **kwargs)
            except BaseException as exc:
                health.down = exc
                raise
            health.down = None
            return conn

    return _Recording


def connect_kwargs(conninfo: Any, kwargs: Any, timeout: float) -> dict[str, Any]:
    """Connection settings for a connection the store opens itself (schema check,
    notifications, probes): the pool's, with a connect timeout unless one is set."""
    kw = {k: v for k, v in (kwargs or {}).items() if k not in ("autocommit", "row_factory")}
    if "connect_timeout" not in kw and "connect_timeout" not in conninfo_to_dict(conninfo):
        # libpq waits forever by default; psycopg's floor is 2 s.
        kw["connect_timeout"] = max(2, math.ceil(timeout))
    return kw


async def _aresolve(value: Any) -> Any:
    if callable(value):
        value = value()
        if inspect.isawaitable(value):
            value = await value
    return value


class _Base:
    pool: Any
    kind = "postgres"
    issues_fence_tokens = True
    #: notifications cross processes, so waiters need no polling cap
    poll_cap: float | None = None

    def __init__(
        self,
        *,
        schema: str,
        prepare: bool,
        auto_migrate: bool,
        owns_pool: bool,
        conninfo: Any,
        conn_kwargs: Any,
        timeout: float,
        pool_factory: Callable[[], Any],
        health: Health,
    ) -> None:
        self.schema = check_schema(schema)
        self.statements = Statements.for_schema(self.schema)
        #: the bound on one call, in seconds (A1)
        self.timeout = float(timeout)
        self._prepare = prepare
        self._auto_migrate = auto_migrate
        self._owns_pool = owns_pool
        self._ready = False
        self._conninfo = conninfo
        self._secrets = _secrets_of(conninfo)
        self._conn_kwargs = conn_kwargs
        # Builds a fresh pool of the same settings: a forked child uses it (A6).
        self._pool_factory = pool_factory
        self._health = health
        self.listener = Listener(self._direct_connect, self.timeout)
        _STORES.add(self)

    def _direct_connect(self, connect_timeout: int | None = None) -> psycopg.Connection[Any]:
        """A connection of its own, on the pool's settings (which may be computed per
        connection). Runs in threads without an event loop."""
        info = _resolve(self._conninfo)
        kwargs = connect_kwargs(info, _resolve(self._conn_kwargs), self.timeout)
        if connect_timeout is not None:
            kwargs["connect_timeout"] = connect_timeout
        return psycopg.connect(info, autocommit=True, **kwargs)

    async def _adirect_connect(self) -> psycopg.AsyncConnection[Any]:
        info = await _aresolve(self._conninfo)
        kwargs = connect_kwargs(info, await _aresolve(self._conn_kwargs), self.timeout)
        return await psycopg.AsyncConnection.connect(info, autocommit=True, **kwargs)

    def _scrub(self, err: StoreUnavailable) -> StoreUnavailable:
        """No secret of the URL (a ``?password=``...) leaves in a message (item 17)."""
        msg = str(err)
        for secret in self._secrets:
            msg = msg.replace(secret, "***")
        return err if msg == str(err) else StoreUnavailable(msg)

    def _unavailable(self, exc: BaseException, what: str) -> StoreUnavailable:
        return self._scrub(unavailable(exc, what))

    def _timed_out(self, what: str) -> StoreUnavailable:
        return StoreUnavailable(
            f"PostgreSQL did not answer {what} within timeout={self.timeout:g}s (the server "
            "or the network is stuck or silent); the connection was dropped. The call may or "
            "may not have been applied; retrying it is safe"
        )

    def _pool_timeout(self, exc: BaseException, what: str) -> StoreUnavailable:
        down = self._health.down
        if down is not None:
            return self._scrub(
                StoreUnavailable(
                    f"cannot connect to PostgreSQL for {what}: {type(down).__name__}: "
                    f"{str(down).strip()}"
                )
            )
        return StoreUnavailable(
            f"no PostgreSQL connection became free within timeout={self.timeout:g}s for "
            f"{what} (every pooled connection was busy: raise max_size or timeout): {exc}"
        )

    def _fork_reset(self) -> None:
        """In a forked child: keep what was inherited from being used, closed or
        collected (closing would end the parent's sessions), and start afresh."""
        _INHERITED.append((self.pool, self.listener, getattr(self, "_lane", None)))
        self.pool = self._pool_factory()
        self._owns_pool = True
        self._ready = False
        self._health.down = None
        self.listener = Listener(self._direct_connect, self.timeout)

    def _chan(self, kind: str, ns: str, key: str) -> str:
        return self.statements.channel(kind, ns, key)

    def _complete_params(
        self, ns: str, key: str, token: str, result: bytes, ttl_ms: int
    ) -> dict[str, Any]:
        return {
            "ns": ns,
            "key": key,
            "token": token,
            "result": bytes(result),
            "ttl": _i8(ttl_ms),
            "chan": self._chan("claim", ns, key),
        }

    # Completing on the caller's connection, inside the caller's transaction, so it
    # commits or rolls back with the caller's writes (waiters are notified at commit).
    # The claim came first, so the schema exists. See fenced.complete_in_transaction.

    def complete_in(
        self,
        conn: psycopg.Connection[Any],
        ns: str,
        key: str,
        token: str,
        result: bytes,
        ttl_ms: int,
    ) -> bool:
        stmt = self.statements.complete
        args = stmt.args(self._complete_params(ns, key, token, result, ttl_ms))
        try:
            return bool(
                psycopg.RawCursor(conn, row_factory=tuple_row)
                .execute(stmt.sql, args, binary=True)
                .fetchall()
            )
        except psycopg.Error as exc:
            raise self._unavailable(exc, "complete") from exc

    async def acomplete_in(
        self,
        conn: psycopg.AsyncConnection[Any],
        ns: str,
        key: str,
        token: str,
        result: bytes,
        ttl_ms: int,
    ) -> bool:
        stmt = self.statements.complete
        args = stmt.args(self._complete_params(ns, key, token, result, ttl_ms))
        try:
            cur = psycopg.AsyncRawCursor(conn, row_factory=tuple_row)
            await cur.execute(stmt.sql, args, binary=True)
            return bool(await cur.fetchall())
        except psycopg.Error as exc:
            raise self._unavailable(exc, "complete") from exc


# ---- sync -------------------------------------------------------------------------------


class PostgresStore(_Base):
    """The sync store. Thread-safe: every call borrows a connection from the pool."""

    def __init__(
        self,
        pool: psycopg_pool.ConnectionPool[Any],
        *,
        schema: str = DEFAULT_SCHEMA,
        prepare: bool = True,
        auto_migrate: bool = True,
        owns_pool: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        pool_factory: Callable[[], psycopg_pool.ConnectionPool[Any]] | None = None,
        health: Health | None = None,
    ) -> None:
        health = health or Health()
        self.pool = pool
        super().__init__(
            schema=schema,
            prepare=prepare,
            auto_migrate=auto_migrate,
            owns_pool=owns_pool,
            conninfo=pool.conninfo,
            conn_kwargs=pool.kwargs,
            timeout=timeout,
            pool_factory=pool_factory or (lambda: clone_pool(pool, health)),
            health=health,
        )
        self._setup_lock = threading.Lock()
        self._probe_lock = threading.Lock()
        self._probing = False
        self._lane_lock = threading.Lock()
        self._lane: psycopg.Connection[Any] | None = None
        self._lane_since = 0.0

    def _fork_reset(self) -> None:
        super()._fork_reset()
        self._setup_lock = threading.Lock()
        self._probe_lock = threading.Lock()
        self._probing = False
        self._lane_lock = threading.Lock()
        self._lane = None

    # ---- running statements ------------------------------------------------------------

    def _setup(self) -> None:
        deadline = time.monotonic() + self.timeout
        if not self._setup_lock.acquire(timeout=self.timeout):
            raise StoreUnavailable(
                f"the PostgreSQL store was still being set up by another thread after "
                f"timeout={self.timeout:g}s; try again"
            )
        try:
            if self._ready:
                return
            if self._owns_pool:
                try:
                    self.pool.open(wait=False)
                except psycopg.Error as exc:
                    raise self._unavailable(exc, "opening the pool") from exc
            # On a connection of its own, not the pool's: a refused connection, a bad
            # password or a missing database is reported now, with its cause.
            conn: Any = None
            armed: Any = None
            try:
                conn = self._direct_connect()
                armed = _watchdog.WATCHDOG.arm(conn, deadline)
                _schema.ensure(conn, self.schema, migrate=self._auto_migrate)
            except psycopg.Error as exc:
                if armed is not None and armed.fired:
                    raise self._timed_out("checking the schema") from exc
                raise self._unavailable(exc, "checking the schema") from exc
            finally:
                if armed is not None:
                    _watchdog.WATCHDOG.disarm(armed)
                if conn is not None:
                    conn.close()
            self._ready = True
        finally:
            self._setup_lock.release()

    def _probe(self, deadline: float, what: str) -> None:
        """The pool's last connection attempt failed: connect once ourselves, so the
        call fails now with the cause (refused, bad password, missing database...)
        instead of waiting for a connection that is not coming."""
        if not self._probe_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise self._pool_timeout(psycopg_pool.PoolTimeout("no connection"), what) from (
                self._health.down
            )
        try:
            if self._health.down is None:
                return
            # psycopg's connect timeout is whole seconds, at least 2: with less time
            # left, report the cause last met now and probe in the background.
            left = int(deadline - time.monotonic())
            if left < 2:
                self._probe_later()
                raise self._pool_timeout(psycopg_pool.PoolTimeout("no connection"), what) from (
                    self._health.down
                )
            try:
                self._direct_connect(left).close()
            except psycopg.Error as exc:
                self._health.down = exc
                raise self._pool_timeout(exc, what) from exc
            self._health.down = None  # reachable again: the pool reconnects soon
        finally:
            self._probe_lock.release()

    def _probe_later(self) -> None:
        if self._probing:
            return
        self._probing = True

        def probe() -> None:
            try:
                self._direct_connect().close()
                self._health.down = None
            except psycopg.Error as exc:
                self._health.down = exc
            finally:
                self._probing = False

        threading.Thread(target=probe, name="idemlock-pg-probe", daemon=True).start()

    # The lane: a store on a pool of its own keeps one connection out of it, for the
    # first caller that finds it free (others use the pool as usual). Borrowing from
    # psycopg_pool costs about as much as the rest of our Python per call; a
    # non-blocking lock costs nothing. The lane goes back to the pool when it breaks,
    # when a statement left it busy, and every LANE_SECONDS, so the pool still checks
    # and recycles it. A user's pool is never held on to.

    def _take(self, deadline: float, what: str) -> tuple[psycopg.Connection[Any], bool]:
        if self._health.down is not None:
            self._probe(deadline, what)
        try:
            if self._owns_pool and self._lane_lock.acquire(blocking=False):
                try:
                    if self._lane is None:
                        self._lane = self.pool.getconn(_wait(deadline))
                        self._lane_since = time.monotonic()
                    return self._lane, True
                except BaseException:
                    self._lane_lock.release()
                    raise
            return self.pool.getconn(_wait(deadline)), False
        except psycopg_pool.PoolTimeout as exc:
            raise self._pool_timeout(exc, what) from exc

    def _give(self, conn: psycopg.Connection[Any], lane: bool) -> None:
        if not lane:
            self.pool.putconn(conn)
            return
        try:
            if self.pool.closed or _lane_spent(conn, self._lane_since):
                self._lane = None
                self.pool.putconn(conn)
        finally:
            self._lane_lock.release()

    def _fetch(
        self, conn: psycopg.Connection[Any], stmt: Stmt, params: dict[str, Any]
    ) -> list[Row]:
        # tuple_row: a user's pool may have another row factory (dict_row...).
        cur = psycopg.RawCursor(conn, row_factory=tuple_row)
        cur.execute(stmt.sql, stmt.args(params), prepare=self._prepare, binary=True)
        rows: list[Row] = cur.fetchall()
        return rows

    def _rows(
        self,
        stmt: Stmt,
        params: dict[str, Any],
        what: str,
        safe: bool,
        deadline: float | None = None,
    ) -> list[Row]:
        """Run one statement. ``safe`` ones (repeatable without harm: the same claim token
        or lock owner gets the same answer) are run once more on a fresh connection when
        the pooled one turns out dead. Others are not: a statement that failed with its
        connection may have committed, and running it again could report a false
        failure (complete, abandon, release...). The whole call, retry included, ends
        by ``deadline`` (default: ``timeout`` from now), even on a silent network."""
        if not self._ready:
            self._setup()
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        wd = _watchdog.WATCHDOG
        for attempt in (0, 1):
            conn: Any = None
            armed: Any = None
            try:
                conn, lane = self._take(deadline, what)
                armed = wd.arm(conn, deadline)
                try:
                    if conn.autocommit:
                        return self._fetch(conn, stmt, params)
                    # A user's pool without autocommit: one statement needs no BEGIN/COMMIT
                    # round trips, and the pool gets the connection back as it lent it.
                    conn.autocommit = True
                    try:
                        return self._fetch(conn, stmt, params)
                    finally:
                        if not conn.closed:
                            conn.autocommit = False
                finally:
                    wd.disarm(armed)
                    self._give(conn, lane)
            except psycopg.Error as exc:
                if armed is not None and armed.fired:
                    # Not pool.check(): the other pooled connections may be as silent.
                    raise self._timed_out(what) from exc
                if _is_disconnect(exc, conn):
                    # The server restarted or ended our sessions: every idle pooled
                    # connection is likely dead too. Replace them now, so that only this
                    # call fails (or none: a call safe to repeat is run again).
                    self._check_pool(deadline)
                    if attempt == 0 and safe and time.monotonic() < deadline:
                        continue
                raise self._unavailable(exc, what) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _check_pool(self, deadline: float) -> None:
        """pool.check() runs a round trip per idle connection in the calling thread,
        with no bound of its own: run it aside and wait for it until the deadline."""

        def check() -> None:
            with contextlib.suppress(psycopg.Error):
                self.pool.check()

        th = threading.Thread(target=check, name="idemlock-pg-check", daemon=True)
        th.start()
        th.join(max(0.0, deadline - time.monotonic()))

    def _until(
        self, stmt: Stmt, params: dict[str, Any], what: str, parse: Callable[[list[Row]], Any]
    ) -> Any:
        deadline = time.monotonic() + self.timeout
        for _ in range(MAX_RACE_RETRIES):
            reply = parse(self._rows(stmt, params, what, True, deadline))
            if reply is not _RETRY:
                return reply
        raise StoreUnavailable(f"{what} kept racing concurrent writers; try again")

    # ---- idempotency records -----------------------------------------------------------

    def claim(self, ns: str, key: str, fp: str | None, token: str, lease_ms: int) -> ClaimReply:
        params = {"ns": ns, "key": key, "token": token, "fp": fp, "lease": _i8(lease_ms)}
        reply: ClaimReply = self._until(
            self.statements.claim, params, "claim", lambda rows: _claim_reply(rows, ns, key, token)
        )
        return reply

    def complete(self, ns: str, key: str, token: str, result: bytes, ttl_ms: int) -> bool:
        params = self._complete_params(ns, key, token, result, ttl_ms)
        return bool(self._rows(self.statements.complete, params, "complete", False))

    def abandon(self, ns: str, key: str, token: str) -> bool:
        params = {"ns": ns, "key": key, "token": token, "chan": self._chan("claim", ns, key)}
        return bool(self._rows(self.statements.abandon, params, "abandon", False))

    def extend(self, ns: str, key: str, token: str, lease_ms: int) -> int | None:
        params = {"ns": ns, "key": key, "token": token, "lease": _i8(lease_ms)}
        rows = self._rows(self.statements.extend, params, "extend", True)
        return int(rows[0][0]) if rows else None

    def record(self, ns: str, key: str) -> RecordRow | None:
        rows = self._rows(self.statements.record, {"ns": ns, "key": key}, "record", True)
        if not rows:
            return None
        state, fence, exp = rows[0]
        return RecordRow(ns, key, _state(state, ns, key), fence, exp)

    def forget(self, ns: str, key: str) -> bool:
        params = {"ns": ns, "key": key, "chan": self._chan("claim", ns, key)}
        return bool(self._rows(self.statements.forget, params, "forget", False))

    def records(self, ns_prefix: str) -> list[RecordRow]:
        rows = self._rows(self.statements.records, {"prefix": ns_prefix}, "records", True)
        return _record_rows(rows, self.schema)

    # ---- locks -----------------------------------------------------------------------

    def acquire(self, ns: str, key: str, owner: str, ttl_ms: int) -> Acquired | Held:
        params = {"ns": ns, "key": key, "owner": owner, "ttl": _i8(ttl_ms)}
        reply: Acquired | Held = self._until(
            self.statements.acquire, params, "acquire", lambda rows: _acquire_reply(rows, owner)
        )
        return reply

    def release(self, ns: str, key: str, owner: str, token: int) -> bool:
        params = {
            "ns": ns,
            "key": key,
            "owner": owner,
            "token": _i8(token),
            "chan": self._chan("lock", ns, key),
        }
        return bool(self._rows(self.statements.release, params, "release", False))

    def renew(self, ns: str, key: str, owner: str, token: int, ttl_ms: int) -> int | None:
        params = {"ns": ns, "key": key, "owner": owner, "token": _i8(token), "ttl": _i8(ttl_ms)}
        rows = self._rows(self.statements.renew, params, "renew", True)
        return int(rows[0][0]) if rows else None

    def renew_many(self, items: Sequence[tuple[Any, ...]]) -> list[int | None]:
        """Renew many claims (``("claim", ns, key, token, lease_ms)``) and leases
        (``("lock", ns, key, owner, token, ttl_ms)``) in one statement, for a
        coordinator's renewer; None where the store no longer holds the item."""
        stmt, params, where = _renew_many(self, items)
        rows = self._rows(stmt, params, "renew_many", True)
        return _renewed_many(rows, where, len(items))

    def lock(self, ns: str, key: str) -> LockRow | None:
        rows = self._rows(self.statements.lock, {"ns": ns, "key": key}, "lock", True)
        if not rows:
            return None
        owner, token, exp = rows[0]
        return LockRow(ns, key, owner, token, exp)

    def locks(self, ns_prefix: str) -> list[LockRow]:
        return _lock_rows(self._rows(self.statements.locks, {"prefix": ns_prefix}, "locks", True))

    # ---- fences ------------------------------------------------------------------------

    def fence_advance(self, ns: str, resource: str, token: int) -> tuple[bool, int]:
        params = {"ns": ns, "resource": resource, "token": _i8(token)}
        reply: tuple[bool, int] = self._until(
            self.statements.fence_advance,
            params,
            "fence_advance",
            lambda rows: _fence_reply(rows, token),
        )
        return reply

    def fence_current(self, ns: str, resource: str) -> int | None:
        params = {"ns": ns, "resource": resource}
        rows = self._rows(self.statements.fence_current, params, "fence_current", True)
        return int(rows[0][0]) if rows else None

    def purge(self) -> int:
        removed = 0
        for stmt in (self.statements.purge_claims, self.statements.purge_locks):
            while True:
                rows = self._rows(stmt, {"batch": _i8(PURGE_BATCH)}, "purge", True)
                n = int(rows[0][0])
                removed += n
                if n < PURGE_BATCH:
                    break
        return removed

    # ---- waiting and life cycle ----------------------------------------------------------

    def subscribe(self, channel: Channel) -> ListenSubscription:
        if not self._ready:
            self._setup()
        return self.listener.subscribe(self._chan(*channel))

    def close(self) -> None:
        _STORES.discard(self)
        self.listener.close()
        if self._owns_pool:
            with self._lane_lock:
                if self._lane is not None:
                    self.pool.putconn(self._lane)
                    self._lane = None
            self.pool.close()


# ---- async ------------------------------------------------------------------------------


class AsyncPostgresStore(_Base):
    """The asyncio store, on an AsyncConnectionPool. Waiting uses the same listener
    thread as the sync store (notifications reach the event loop thread-safely)."""

    def __init__(
        self,
        pool: psycopg_pool.AsyncConnectionPool[Any],
        *,
        schema: str = DEFAULT_SCHEMA,
        prepare: bool = True,
        auto_migrate: bool = True,
        owns_pool: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        pool_factory: Callable[[], psycopg_pool.AsyncConnectionPool[Any]] | None = None,
        health: Health | None = None,
    ) -> None:
        health = health or Health()
        self.pool = pool
        super().__init__(
            schema=schema,
            prepare=prepare,
            auto_migrate=auto_migrate,
            owns_pool=owns_pool,
            conninfo=pool.conninfo,
            conn_kwargs=pool.kwargs,
            timeout=timeout,
            pool_factory=pool_factory or (lambda: clone_pool(pool, health)),
            health=health,
        )
        self._setup_lock: asyncio.Lock | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lane_busy = False
        self._lane: psycopg.AsyncConnection[Any] | None = None
        self._lane_since = 0.0
        # undo calls for cancelled claims/acquires, kept from being collected
        self._undoing: set[asyncio.Task[Any]] = set()

    def _fork_reset(self) -> None:
        super()._fork_reset()
        self._reset_loop_state()

    def _reset_loop_state(self) -> None:
        self._setup_lock = None
        self._loop = None
        self._lane_busy = False
        self._lane = None
        self._undoing = set()

    def _check_loop(self) -> None:
        """A pool of our own is bound to the event loop it was opened on: on another
        loop (a second ``asyncio.run``), start a fresh pool (A7)."""
        loop = asyncio.get_running_loop()
        if self._loop is None or self._loop is loop:
            return
        if not self._owns_pool:
            return  # the caller's pool, on the caller's loops
        # The old loop is gone or elsewhere: its pool cannot be closed from here; its
        # connections are closed when it is collected.
        self.pool = self._pool_factory()
        self._ready = False
        self._reset_loop_state()

    async def _setup(self) -> None:
        self._check_loop()
        if self._ready:  # the caller's pool, on another loop
            self._loop = asyncio.get_running_loop()
            return
        if self._setup_lock is None:
            self._setup_lock = asyncio.Lock()
        try:
            await asyncio.wait_for(self._setup_lock.acquire(), self.timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise StoreUnavailable(
                f"the PostgreSQL store was still being set up after timeout={self.timeout:g}s; "
                "try again"
            ) from None
        try:
            if self._ready:
                return
            if self._owns_pool:
                try:
                    await self.pool.open(wait=False)
                except psycopg.Error as exc:
                    raise self._unavailable(exc, "opening the pool") from exc
            # A connection of its own: a failure to connect is reported now, with its cause.
            deadline = time.monotonic() + self.timeout
            conn: Any = None
            armed: Any = None
            try:
                conn = await self._adirect_connect()
                armed = _watchdog.WATCHDOG.arm(conn, deadline)
                await _schema.aensure(conn, self.schema, migrate=self._auto_migrate)
            except psycopg.Error as exc:
                if armed is not None and armed.fired:
                    raise self._timed_out("checking the schema") from exc
                raise self._unavailable(exc, "checking the schema") from exc
            finally:
                if armed is not None:
                    _watchdog.WATCHDOG.disarm(armed)
                if conn is not None:
                    await conn.close()
            self._loop = asyncio.get_running_loop()
            self._ready = True
        finally:
            self._setup_lock.release()

    async def _probe(self, deadline: float, what: str) -> None:
        # As the sync store's; concurrent callers each probe (a refused connection
        # costs nothing, and each call stays bounded by its own deadline).
        try:
            conn = await asyncio.wait_for(
                self._adirect_connect(), max(0.0, deadline - time.monotonic())
            )
        except (psycopg.Error, TimeoutError, asyncio.TimeoutError) as exc:
            if isinstance(exc, psycopg.Error):
                self._health.down = exc
            raise self._pool_timeout(exc, what) from exc
        await conn.close()
        self._health.down = None

    # The lane, as in the sync store; a flag is enough within one event loop.

    async def _take(self, deadline: float, what: str) -> tuple[psycopg.AsyncConnection[Any], bool]:
        if self._health.down is not None:
            await self._probe(deadline, what)
        try:
            if self._owns_pool and not self._lane_busy:
                self._lane_busy = True
                try:
                    if self._lane is None:
                        self._lane = await self.pool.getconn(_wait(deadline))
                        self._lane_since = time.monotonic()
                    return self._lane, True
                except BaseException:
                    self._lane_busy = False
                    raise
            return await self.pool.getconn(_wait(deadline)), False
        except psycopg_pool.PoolTimeout as exc:
            raise self._pool_timeout(exc, what) from exc

    async def _give(self, conn: psycopg.AsyncConnection[Any], lane: bool) -> None:
        if not lane:
            await self.pool.putconn(conn)
            return
        try:
            if self.pool.closed or _lane_spent(conn, self._lane_since):
                self._lane = None
                await self.pool.putconn(conn)
        finally:
            self._lane_busy = False

    async def _fetch(
        self, conn: psycopg.AsyncConnection[Any], stmt: Stmt, params: dict[str, Any]
    ) -> list[Row]:
        cur = psycopg.AsyncRawCursor(conn, row_factory=tuple_row)
        await cur.execute(stmt.sql, stmt.args(params), prepare=self._prepare, binary=True)
        rows: list[Row] = await cur.fetchall()
        return rows

    async def _rows(
        self,
        stmt: Stmt,
        params: dict[str, Any],
        what: str,
        safe: bool,
        deadline: float | None = None,
    ) -> list[Row]:
        if not self._ready or self._loop is not asyncio.get_running_loop():
            await self._setup()
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        wd = _watchdog.WATCHDOG
        for attempt in (0, 1):
            conn: Any = None
            armed: Any = None
            try:
                conn, lane = await self._take(deadline, what)
                # The same watchdog thread as the sync store: shutting the socket down
                # makes it readable, and the awaiting call fails at once.
                armed = wd.arm(conn, deadline)
                try:
                    if conn.autocommit:
                        return await self._fetch(conn, stmt, params)
                    await conn.set_autocommit(True)
                    try:
                        return await self._fetch(conn, stmt, params)
                    finally:
                        if not conn.closed:
                            await conn.set_autocommit(False)
                finally:
                    wd.disarm(armed)
                    await self._give(conn, lane)
            except psycopg.Error as exc:
                if armed is not None and armed.fired:
                    raise self._timed_out(what) from exc
                if _is_disconnect(exc, conn):
                    # The server restarted or ended our sessions: every idle pooled
                    # connection is likely dead too. Replace them now, so that only this
                    # call fails (or none: a call safe to repeat is run again).
                    await self._check_pool(deadline)
                    if attempt == 0 and safe and time.monotonic() < deadline:
                        continue
                raise self._unavailable(exc, what) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _check_pool(self, deadline: float) -> None:
        # As the sync store's: the check goes on in its own task past the deadline.
        async def check() -> None:
            with contextlib.suppress(psycopg.Error):
                await self.pool.check()

        task = asyncio.ensure_future(check())
        with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - time.monotonic()))

    async def _until(
        self, stmt: Stmt, params: dict[str, Any], what: str, parse: Callable[[list[Row]], Any]
    ) -> Any:
        deadline = time.monotonic() + self.timeout
        for _ in range(MAX_RACE_RETRIES):
            reply = parse(await self._rows(stmt, params, what, True, deadline))
            if reply is not _RETRY:
                return reply
        raise StoreUnavailable(f"{what} kept racing concurrent writers; try again")

    async def _undoable(self, call: Any, undo: Callable[[Any], Any], what: str) -> Any:
        """Run a call so that a cancellation cannot leave its outcome unknown: the
        statement runs on in a task of its own (bounded by ``timeout``); what a claim or
        an acquire took is given back as soon as it ends (issue 10 item 7), and a
        complete, abandon or release simply takes effect. The caller still sees the
        CancelledError."""
        task = asyncio.ensure_future(call)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: self._undo_after(t, undo, what))
            raise

    def _undo_after(self, task: asyncio.Task[Any], undo: Callable[[Any], Any], what: str) -> None:
        if task.cancelled():
            log.warning(
                "idemlock: a cancelled PostgreSQL %s was itself cancelled (event loop "
                "shutting down?); if it was applied, it frees itself when its lease ends",
                what,
            )
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, StoreUnavailable):
            return  # refused before anything was sent
        # A StoreUnavailable (e.g. a timeout after the statement was sent) leaves the
        # outcome unknown: undo what can be undone without the reply (None).
        aw = undo(None if exc is not None else task.result())
        if aw is None:
            return
        undo_task = asyncio.ensure_future(aw)
        self._undoing.add(undo_task)
        undo_task.add_done_callback(self._undone)

    def _undone(self, task: asyncio.Task[Any]) -> None:
        self._undoing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning(
                "idemlock: could not undo a cancelled PostgreSQL call; what it took frees "
                "itself when its lease ends",
                exc_info=task.exception(),
            )

    async def claim(
        self, ns: str, key: str, fp: str | None, token: str, lease_ms: int
    ) -> ClaimReply:
        params = {"ns": ns, "key": key, "token": token, "fp": fp, "lease": _i8(lease_ms)}

        def undo(reply: ClaimReply | None) -> Any:
            # Our own token only: abandoning a claim that never happened changes nothing.
            return (
                self.abandon(ns, key, token)
                if reply is None or isinstance(reply, Granted)
                else None
            )

        reply: ClaimReply = await self._undoable(
            self._until(
                self.statements.claim,
                params,
                "claim",
                lambda rows: _claim_reply(rows, ns, key, token),
            ),
            undo,
            "claim",
        )
        return reply

    async def complete(self, ns: str, key: str, token: str, result: bytes, ttl_ms: int) -> bool:
        params = self._complete_params(ns, key, token, result, ttl_ms)
        rows = await self._undoable(
            self._rows(self.statements.complete, params, "complete", False), _nothing, "complete"
        )
        return bool(rows)

    async def abandon(self, ns: str, key: str, token: str) -> bool:
        params = {"ns": ns, "key": key, "token": token, "chan": self._chan("claim", ns, key)}
        rows = await self._undoable(
            self._rows(self.statements.abandon, params, "abandon", False), _nothing, "abandon"
        )
        return bool(rows)

    async def extend(self, ns: str, key: str, token: str, lease_ms: int) -> int | None:
        params = {"ns": ns, "key": key, "token": token, "lease": _i8(lease_ms)}
        rows = await self._rows(self.statements.extend, params, "extend", True)
        return int(rows[0][0]) if rows else None

    async def record(self, ns: str, key: str) -> RecordRow | None:
        rows = await self._rows(self.statements.record, {"ns": ns, "key": key}, "record", True)
        if not rows:
            return None
        state, fence, exp = rows[0]
        return RecordRow(ns, key, _state(state, ns, key), fence, exp)

    async def forget(self, ns: str, key: str) -> bool:
        params = {"ns": ns, "key": key, "chan": self._chan("claim", ns, key)}
        return bool(await self._rows(self.statements.forget, params, "forget", False))

    async def records(self, ns_prefix: str) -> Sequence[RecordRow]:
        rows = await self._rows(self.statements.records, {"prefix": ns_prefix}, "records", True)
        return _record_rows(rows, self.schema)

    async def acquire(self, ns: str, key: str, owner: str, ttl_ms: int) -> Acquired | Held:
        params = {"ns": ns, "key": key, "owner": owner, "ttl": _i8(ttl_ms)}

        def undo(reply: Acquired | Held | None) -> Any:
            # Without the reply the token is unknown: that lease ends with its ttl.
            if isinstance(reply, Acquired):
                return self.release(ns, key, owner, reply.token)
            return None

        reply: Acquired | Held = await self._undoable(
            self._until(
                self.statements.acquire,
                params,
                "acquire",
                lambda rows: _acquire_reply(rows, owner),
            ),
            undo,
            "acquire",
        )
        return reply

    async def release(self, ns: str, key: str, owner: str, token: int) -> bool:
        params = {
            "ns": ns,
            "key": key,
            "owner": owner,
            "token": _i8(token),
            "chan": self._chan("lock", ns, key),
        }
        rows = await self._undoable(
            self._rows(self.statements.release, params, "release", False), _nothing, "release"
        )
        return bool(rows)

    async def renew(self, ns: str, key: str, owner: str, token: int, ttl_ms: int) -> int | None:
        params = {"ns": ns, "key": key, "owner": owner, "token": _i8(token), "ttl": _i8(ttl_ms)}
        rows = await self._rows(self.statements.renew, params, "renew", True)
        return int(rows[0][0]) if rows else None

    async def renew_many(self, items: Sequence[tuple[Any, ...]]) -> list[int | None]:
        """Renew many claims and leases in one statement (see ``PostgresStore.renew_many``)."""
        stmt, params, where = _renew_many(self, items)
        rows = await self._rows(stmt, params, "renew_many", True)
        return _renewed_many(rows, where, len(items))

    async def lock(self, ns: str, key: str) -> LockRow | None:
        rows = await self._rows(self.statements.lock, {"ns": ns, "key": key}, "lock", True)
        if not rows:
            return None
        owner, token, exp = rows[0]
        return LockRow(ns, key, owner, token, exp)

    async def locks(self, ns_prefix: str) -> Sequence[LockRow]:
        rows = await self._rows(self.statements.locks, {"prefix": ns_prefix}, "locks", True)
        return _lock_rows(rows)

    async def fence_advance(self, ns: str, resource: str, token: int) -> tuple[bool, int]:
        params = {"ns": ns, "resource": resource, "token": _i8(token)}
        reply: tuple[bool, int] = await self._until(
            self.statements.fence_advance,
            params,
            "fence_advance",
            lambda rows: _fence_reply(rows, token),
        )
        return reply

    async def fence_current(self, ns: str, resource: str) -> int | None:
        params = {"ns": ns, "resource": resource}
        rows = await self._rows(self.statements.fence_current, params, "fence_current", True)
        return int(rows[0][0]) if rows else None

    async def purge(self) -> int:
        removed = 0
        for stmt in (self.statements.purge_claims, self.statements.purge_locks):
            while True:
                rows = await self._rows(stmt, {"batch": _i8(PURGE_BATCH)}, "purge", True)
                n = int(rows[0][0])
                removed += n
                if n < PURGE_BATCH:
                    break
        return removed

    async def subscribe(self, channel: Channel) -> AsyncListenSubscription:
        if not self._ready:
            await self._setup()
        name = self._chan(*channel)
        # Already listening: no I/O, no thread hop. Otherwise the LISTEN round trip
        # runs in a worker thread so the event loop never blocks on it.
        sub = self.listener.try_subscribe(name)
        if sub is None:
            sub = await asyncio.to_thread(self.listener.subscribe, name)
        return AsyncListenSubscription(sub)

    async def aclose(self) -> None:
        _STORES.discard(self)
        self._check_loop()  # a pool opened on a loop that is gone cannot be awaited here
        await asyncio.to_thread(self.listener.close)
        if self._owns_pool:
            if self._lane is not None and not self._lane_busy:
                lane, self._lane = self._lane, None
                await self.pool.putconn(lane)
            await self.pool.close()


# ---- fork safety (A6) -------------------------------------------------------------------

_STORES: weakref.WeakSet[_Base] = weakref.WeakSet()
#: pools, listeners and connections inherited through fork(): never used nor closed in
#: the child (closing would end the parent's sessions), only kept from being collected
_INHERITED: list[Any] = []


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._fork_reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
