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
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast

import psycopg
import psycopg_pool
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from psycopg.types.numeric import Int8

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
from . import _schema
from ._listen import AsyncListenSubscription, Listener, ListenSubscription
from ._sql import Statements, Stmt

Row = tuple[Any, ...]

log = logging.getLogger("idemlock")

DEFAULT_SCHEMA = "idemlock"
#: rows deleted per purge statement
PURGE_BATCH = 5000
#: seconds a store keeps its lane connection before handing it back to its pool
LANE_SECONDS = 60.0
#: seconds the notification connection may take to connect (unless the URL says)
LISTEN_CONNECT_TIMEOUT = 10
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


# ---- the shared half ------------------------------------------------------------------


class _Base:
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
    ) -> None:
        self.schema = check_schema(schema)
        self.statements = Statements.for_schema(self.schema)
        self._prepare = prepare
        self._auto_migrate = auto_migrate
        self._owns_pool = owns_pool
        self._ready = False

        def listen_connect() -> psycopg.Connection[Any]:
            # The pool's own connection settings (which may be computed per connection).
            info = _resolve(conninfo)
            kwargs = {
                k: v
                for k, v in (_resolve(conn_kwargs) or {}).items()
                if k not in ("autocommit", "row_factory")
            }
            if "connect_timeout" not in kwargs and "connect_timeout" not in conninfo_to_dict(info):
                # libpq waits forever by default; a waiter must not hang on a dead host.
                kwargs["connect_timeout"] = LISTEN_CONNECT_TIMEOUT
            return psycopg.connect(info, autocommit=True, **kwargs)

        self.listener = Listener(listen_connect)

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
            raise unavailable(exc, "complete") from exc

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
            raise unavailable(exc, "complete") from exc


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
    ) -> None:
        super().__init__(
            schema=schema,
            prepare=prepare,
            auto_migrate=auto_migrate,
            owns_pool=owns_pool,
            conninfo=pool.conninfo,
            conn_kwargs=pool.kwargs,
        )
        self.pool = pool
        self._setup_lock = threading.Lock()
        self._lane_lock = threading.Lock()
        self._lane: psycopg.Connection[Any] | None = None
        self._lane_since = 0.0

    # ---- running statements ------------------------------------------------------------

    def _setup(self) -> None:
        with self._setup_lock:
            if self._ready:
                return
            if self._owns_pool:
                try:
                    self.pool.open(wait=False)
                except psycopg.Error as exc:
                    raise unavailable(exc, "opening the pool") from exc
            try:
                with self.pool.connection() as conn:
                    _schema.ensure(conn, self.schema, migrate=self._auto_migrate)
            except psycopg.Error as exc:
                raise unavailable(exc, "checking the schema") from exc
            self._ready = True

    # The lane: a store on a pool of its own keeps one connection out of it, for the
    # first caller that finds it free (others use the pool as usual). Borrowing from
    # psycopg_pool costs about as much as the rest of our Python per call; a
    # non-blocking lock costs nothing. The lane goes back to the pool when it breaks,
    # when a statement left it busy, and every LANE_SECONDS, so the pool still checks
    # and recycles it. A user's pool is never held on to.

    def _take(self) -> tuple[psycopg.Connection[Any], bool]:
        if self._owns_pool and self._lane_lock.acquire(blocking=False):
            try:
                if self._lane is None:
                    self._lane = self.pool.getconn()
                    self._lane_since = time.monotonic()
                return self._lane, True
            except BaseException:
                self._lane_lock.release()
                raise
        return self.pool.getconn(), False

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

    def _rows(self, stmt: Stmt, params: dict[str, Any], what: str, safe: bool) -> list[Row]:
        """Run one statement. ``safe`` ones (repeatable without harm: the same claim token
        or lock owner gets the same answer) are run once more on a fresh connection when
        the pooled one turns out dead. Others are not: a statement that failed with its
        connection may have committed, and running it again could report a false
        failure (complete, abandon, release...)."""
        if not self._ready:
            self._setup()
        for attempt in (0, 1):
            conn: Any = None
            try:
                conn, lane = self._take()
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
                    self._give(conn, lane)
            except psycopg.Error as exc:
                if _is_disconnect(exc, conn):
                    # The server restarted or ended our sessions: every idle pooled
                    # connection is likely dead too. Replace them now, so that only this
                    # call fails (or none: a call safe to repeat is run again).
                    with contextlib.suppress(psycopg.Error):
                        self.pool.check()
                    if attempt == 0 and safe:
                        continue
                raise unavailable(exc, what) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _until(
        self, stmt: Stmt, params: dict[str, Any], what: str, parse: Callable[[list[Row]], Any]
    ) -> Any:
        for _ in range(MAX_RACE_RETRIES):
            reply = parse(self._rows(stmt, params, what, True))
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
    ) -> None:
        super().__init__(
            schema=schema,
            prepare=prepare,
            auto_migrate=auto_migrate,
            owns_pool=owns_pool,
            conninfo=pool.conninfo,
            conn_kwargs=pool.kwargs,
        )
        self.pool = pool
        self._setup_lock: asyncio.Lock | None = None
        self._lane_busy = False
        self._lane: psycopg.AsyncConnection[Any] | None = None
        self._lane_since = 0.0

    async def _setup(self) -> None:
        if self._setup_lock is None:
            self._setup_lock = asyncio.Lock()
        async with self._setup_lock:
            if self._ready:
                return
            if self._owns_pool:
                try:
                    await self.pool.open(wait=False)
                except psycopg.Error as exc:
                    raise unavailable(exc, "opening the pool") from exc
            try:
                async with self.pool.connection() as conn:
                    await _schema.aensure(conn, self.schema, migrate=self._auto_migrate)
            except psycopg.Error as exc:
                raise unavailable(exc, "checking the schema") from exc
            self._ready = True

    # The lane, as in the sync store; a flag is enough within one event loop.

    async def _take(self) -> tuple[psycopg.AsyncConnection[Any], bool]:
        if self._owns_pool and not self._lane_busy:
            self._lane_busy = True
            try:
                if self._lane is None:
                    self._lane = await self.pool.getconn()
                    self._lane_since = time.monotonic()
                return self._lane, True
            except BaseException:
                self._lane_busy = False
                raise
        return await self.pool.getconn(), False

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

    async def _rows(self, stmt: Stmt, params: dict[str, Any], what: str, safe: bool) -> list[Row]:
        if not self._ready:
            await self._setup()
        for attempt in (0, 1):
            conn: Any = None
            try:
                conn, lane = await self._take()
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
                    await self._give(conn, lane)
            except psycopg.Error as exc:
                if _is_disconnect(exc, conn):
                    # The server restarted or ended our sessions: every idle pooled
                    # connection is likely dead too. Replace them now, so that only this
                    # call fails (or none: a call safe to repeat is run again).
                    with contextlib.suppress(psycopg.Error):
                        await self.pool.check()
                    if attempt == 0 and safe:
                        continue
                raise unavailable(exc, what) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _until(
        self, stmt: Stmt, params: dict[str, Any], what: str, parse: Callable[[list[Row]], Any]
    ) -> Any:
        for _ in range(MAX_RACE_RETRIES):
            reply = parse(await self._rows(stmt, params, what, True))
            if reply is not _RETRY:
                return reply
        raise StoreUnavailable(f"{what} kept racing concurrent writers; try again")

    async def claim(
        self, ns: str, key: str, fp: str | None, token: str, lease_ms: int
    ) -> ClaimReply:
        params = {"ns": ns, "key": key, "token": token, "fp": fp, "lease": _i8(lease_ms)}
        reply: ClaimReply = await self._until(
            self.statements.claim, params, "claim", lambda rows: _claim_reply(rows, ns, key, token)
        )
        return reply

    async def complete(self, ns: str, key: str, token: str, result: bytes, ttl_ms: int) -> bool:
        params = self._complete_params(ns, key, token, result, ttl_ms)
        return bool(await self._rows(self.statements.complete, params, "complete", False))

    async def abandon(self, ns: str, key: str, token: str) -> bool:
        params = {"ns": ns, "key": key, "token": token, "chan": self._chan("claim", ns, key)}
        return bool(await self._rows(self.statements.abandon, params, "abandon", False))

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
        reply: Acquired | Held = await self._until(
            self.statements.acquire, params, "acquire", lambda rows: _acquire_reply(rows, owner)
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
        return bool(await self._rows(self.statements.release, params, "release", False))

    async def renew(self, ns: str, key: str, owner: str, token: int, ttl_ms: int) -> int | None:
        params = {"ns": ns, "key": key, "owner": owner, "token": _i8(token), "ttl": _i8(ttl_ms)}
        rows = await self._rows(self.statements.renew, params, "renew", True)
        return int(rows[0][0]) if rows else None

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
        await asyncio.to_thread(self.listener.close)
        if self._owns_pool:
            if self._lane is not None and not self._lane_busy:
                lane, self._lane = self._lane, None
                await self.pool.putconn(lane)
            await self.pool.close()
