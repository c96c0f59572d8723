"""The asyncio PostgreSQL store, :class:`AsyncPostgresStore`: the statements it runs
and how it reads their replies. It is the source of :mod:`._sync`
(:class:`PostgresStore`), which tools/async_to_sync.py generates from it; what differs
between the two (connections, set-up, cancellation, waiting, closing) is hand-written
in :mod:`._runner_async` and :mod:`._runner_sync`.

Every port method is one statement run in autocommit on a pooled connection (see
:mod:`._sql`). A cancelled call that took something (a claim, a lease) gives it back
once it ends; a settling call (complete, abandon, release) still takes effect.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import psycopg_pool
from psycopg.rows import tuple_row

from ..._core.port import Acquired, ClaimReply, Granted, Held, LockRow, RecordRow, StepRow
from ..._errors import StoreUnavailable
from . import _schema_async, _watchdog
from ._replies import (
    _RETRY,
    Row,
    _acquire_reply,
    _claim_reply,
    _fence_reply,
    _holder_rows,
    _i8,
    _lock_rows,
    _nothing,
    _record_rows,
    _renew_many,
    _renewed_many,
    _state,
    _step_rows,
)
from ._runner_async import _AsyncRunner
from ._shared import (
    _HANDOFF_MS8,
    MAX_RACE_RETRIES,
    PURGE_BATCH,
    SERVER_PID,
    _is_disconnect,
    _lane_spent,
    _wait,
)
from ._sql import Stmt


class AsyncPostgresStore(_AsyncRunner):
    """A PostgreSQL store on a psycopg_pool AsyncConnectionPool. Every call borrows a
    connection from the pool; waiters share the store's one listener thread."""

    async def _fetch(
        self, conn: psycopg.AsyncConnection[Any], stmt: Stmt, params: dict[str, Any]
    ) -> list[Row]:
        # tuple_row: a user's pool may have another row factory (dict_row...).
        cur = psycopg.AsyncRawCursor(conn, row_factory=tuple_row)
        rows: list[Row]
        cancels = self._cancels()
        if self._pooled:
            # Behind a transaction pooler: no prepared statement (the next call may get
            # another server connection), and statement_timeout for this statement
            # only, in the same round trip (one Sync: one implicit transaction).
            async with conn.pipeline():
                await conn.execute(self._local_timeout, prepare=False)
                await cur.execute(stmt.sql, stmt.args(params), prepare=False, binary=True)
                rows = await cur.fetchall()
            self._keep_cancel(cancels)
            return rows
        await cur.execute(stmt.sql, stmt.args(params), prepare=self._prepare_now, binary=True)
        rows = await cur.fetchall()
        self._keep_cancel(cancels)
        return rows

    async def _open_and_check(self, deadline: float) -> None:
        """The set-up, under the set-up lock: open a pool of our own, then check the
        schema on a connection of its own, not the pool's, so that a refused connection,
        a bad password or a missing database is reported now, with its cause."""
        if self._owns_pool:
            try:
                await self.pool.open(wait=False)
            except psycopg.Error as exc:
                raise self._unavailable(exc, "opening the pool") from exc
        conn: Any = None
        armed: Any = None
        try:
            conn = await self._adirect_connect()
            armed = _watchdog.WATCHDOG.arm(conn, deadline)
            row = await (await conn.execute(SERVER_PID)).fetchone()
            self._set_pooled(conn, row[0] if row else 0)
            await _schema_async.aensure(conn, self.schema, migrate=self._auto_migrate)
        except psycopg.Error as exc:
            if armed is not None and armed.fired:
                raise self._timed_out("checking the schema") from exc
            raise self._unavailable(exc, "checking the schema") from exc
        finally:
            if armed is not None:
                _watchdog.WATCHDOG.disarm(armed)
            if conn is not None:
                await conn.close()

    async def _take(self, deadline: float, what: str) -> tuple[psycopg.AsyncConnection[Any], bool]:
        """A connection for one call, and whether it is the lane: a connection of the
        store's own pool kept for one call at a time, so that sequential calls skip the
        pool's checkout."""
        if self._health.down is not None:
            await self._probe(deadline, what)
        try:
            if self._owns_pool and self._lane_lock.acquire(blocking=False):
                try:
                    if self._lane is None:
                        self._lane = await self.pool.getconn(_wait(deadline))
                        self._lane_since = time.monotonic()
                    return self._lane, True
                except BaseException:
                    self._lane_lock.release()
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
            self._lane_lock.release()

    async def _rows(
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
        await self._ensure_ready()
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        wd = _watchdog.WATCHDOG
        for attempt in (0, 1):
            conn: Any = None
            armed: Any = None
            try:
                conn, lane = await self._take(deadline, what)
                # Shutting the socket down makes it readable: the waiting call fails at once.
                armed = wd.arm(conn, deadline)
                try:
                    if conn.autocommit:
                        return await self._fetch(conn, stmt, params)
                    # A user's pool without autocommit: one statement needs no BEGIN/COMMIT
                    # round trips, and the pool gets the connection back as it lent it.
                    await self._autocommit(conn, True)
                    try:
                        return await self._fetch(conn, stmt, params)
                    finally:
                        if not conn.closed:
                            await self._autocommit(conn, False)
                finally:
                    wd.disarm(armed)
                    await self._give(conn, lane)
            except psycopg.Error as exc:
                if armed is not None and armed.fired:
                    # Not pool.check(): the other pooled connections may be as silent.
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

    async def _until(
        self,
        stmt: Stmt,
        params: dict[str, Any],
        what: str,
        parse: Callable[[list[Row]], Any],
        then: Stmt | None = None,
    ) -> Any:
        """Run ``stmt`` until its reply is usable (``then``, if given, from the second
        run on: the statement for what the first one leaves to it)."""
        deadline = time.monotonic() + self.timeout
        for _ in range(MAX_RACE_RETRIES):
            reply = parse(await self._rows(stmt, params, what, True, deadline))
            if reply is not _RETRY:
                return reply
            stmt = then or stmt
        raise StoreUnavailable(f"{what} kept racing concurrent writers; try again")

    # ---- idempotency records -----------------------------------------------------------

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
                self.statements.claim_fast,
                params,
                "claim",
                lambda rows: _claim_reply(rows, ns, key, token),
                then=self.statements.claim,
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

    # ---- steps inside a claim ----------------------------------------------------------

    async def step(
        self,
        ns: str,
        key: str,
        token: str,
        name: str,
        result: bytes | None,
        lease_ms: int,
        ttl_ms: int,
    ) -> int | None:
        params = self._step_params(ns, key, token, name, result, lease_ms, ttl_ms)
        # Safe to run again: the same token writes the same step (or finds its claim
        # gone, and then changes nothing).
        rows = await self._rows(self.statements.step, params, "step", True)
        return int(rows[0][0]) if rows else None

    async def drop_step(
        self, ns: str, key: str, token: str, name: str, lease_ms: int
    ) -> int | None:
        params = {"ns": ns, "key": key, "token": token, "name": name, "lease": _i8(lease_ms)}
        rows = await self._rows(self.statements.drop_step, params, "drop_step", True)
        return int(rows[0][0]) if rows else None

    async def steps(self, ns: str, key: str) -> list[StepRow]:
        rows = await self._rows(self.statements.steps, {"ns": ns, "key": key}, "steps", True)
        return list(_step_rows(rows, ns, key))

    async def records(self, ns_prefix: str) -> list[RecordRow]:
        rows = await self._rows(self.statements.records, {"prefix": ns_prefix}, "records", True)
        return _record_rows(rows, self.schema)

    # ---- locks -----------------------------------------------------------------------

    async def acquire(
        self, ns: str, key: str, owner: str, ttl_ms: int, limit: int = 1, value: bytes | None = None
    ) -> Acquired | Held:
        params = self._acquire_params(ns, key, owner, ttl_ms, limit, value)

        def undo(reply: Acquired | Held | None) -> Any:
            # Without the reply the token is unknown: that lease ends with its ttl.
            if isinstance(reply, Acquired):
                return self.release(ns, key, owner, reply.token)
            return None

        # Only a caller of a waiting process has a registration to make or end; one that
        # publishes a value also notifies the key's observers when it is granted.
        st = self.statements
        if value is None:
            stmt = st.acquire if params["wait"] else st.acquire_fast
        else:
            stmt = st.acquire_publish if params["wait"] else st.acquire_fast_publish
        reply: Acquired | Held = await self._undoable(
            self._until(
                stmt,
                params,
                "acquire",
                _acquire_reply,
            ),
            undo,
            "acquire",
        )
        self._registered(params, reply)
        return reply

    async def release(self, ns: str, key: str, owner: str, token: int) -> bool:
        params = {
            "ns": ns,
            "key": key,
            "owner": owner,
            "token": _i8(token),
            "chan": self._chan("lock", ns, key),
            "handoff": _HANDOFF_MS8,
        }
        rows = await self._undoable(
            self._rows(self.statements.release, params, "release", False), _nothing, "release"
        )
        return bool(rows)

    async def break_lock(self, ns: str, key: str, token: int | None = None) -> bool:
        params: dict[str, Any] = {"ns": ns, "key": key, "chan": self._chan("lock", ns, key)}
        stmt = self.statements.break_lock
        if token is not None:
            params["token"] = _i8(token)
            stmt = self.statements.break_one
        rows = await self._undoable(
            self._rows(stmt, params, "break_lock", False),
            _nothing,
            "break_lock",
        )
        return bool(rows)

    async def renew(
        self, ns: str, key: str, owner: str, token: int, ttl_ms: int, value: bytes | None = None
    ) -> int | None:
        params = {
            "ns": ns,
            "key": key,
            "owner": owner,
            "token": _i8(token),
            "ttl": _i8(ttl_ms),
            "value": None if value is None else bytes(value),
        }
        stmt = self.statements.renew
        if value is not None:
            # a value published: the key's observers are notified (not its waiters)
            params["chan"] = self._chan("lock", ns, key)
            stmt = self.statements.renew_publish
        rows = await self._rows(stmt, params, "renew", True)
        return int(rows[0][0]) if rows else None

    async def renew_many(self, items: Sequence[tuple[Any, ...]]) -> list[int | None]:
        """Renew many claims (``("claim", ns, key, token, lease_ms)``) and leases
        (``("lock", ns, key, owner, token, ttl_ms)``) in one statement, for a
        coordinator's renewer; None where the store no longer holds the item."""
        stmt, params, where = _renew_many(self, items)
        rows = await self._rows(stmt, params, "renew_many", True)
        return _renewed_many(rows, where, len(items))

    async def lock(self, ns: str, key: str) -> LockRow | None:
        rows = await self._rows(self.statements.lock, {"ns": ns, "key": key}, "lock", True)
        found = _holder_rows(rows, ns, key)
        return found[0] if found else None

    async def holders(self, ns: str, key: str) -> list[LockRow]:
        rows = await self._rows(self.statements.holders, {"ns": ns, "key": key}, "holders", True)
        return _holder_rows(rows, ns, key)

    async def locks(self, ns_prefix: str) -> list[LockRow]:
        rows = await self._rows(self.statements.locks, {"prefix": ns_prefix}, "locks", True)
        return _lock_rows(rows)

    # ---- fences ------------------------------------------------------------------------

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

    async def purge(self, dry_run: bool = False) -> int:
        if dry_run:
            return await self._purge_count()
        removed = 0
        st = self.statements
        for stmt in (st.purge_claims, st.purge_locks, st.prune_locks):
            while True:
                rows = await self._rows(stmt, {"batch": _i8(PURGE_BATCH)}, "purge", True)
                removed += int(rows[0][1])
                if int(rows[0][0]) < PURGE_BATCH:
                    break
        # Lapsed registrations of the waiters' queue and steps whose end passed: not
        # records, not counted.
        for stmt in (st.purge_waiters, st.purge_steps):
            while True:
                rows = await self._rows(stmt, {"batch": _i8(PURGE_BATCH)}, "purge", True)
                if int(rows[0][0]) < PURGE_BATCH:
                    break
        return removed

    async def _purge_count(self) -> int:
        """How many rows purge would delete now, counted in batches of PURGE_BATCH
        (read-only, each batch one short statement)."""
        total = 0
        for stmt in (self.statements.count_claims, self.statements.count_locks):
            after: tuple[Any, Any] = (None, None)
            while True:
                params = {"ns": after[0], "key": after[1], "batch": _i8(PURGE_BATCH)}
                rows = await self._rows(stmt, params, "purge", True)
                total += int(rows[0][1])
                if int(rows[0][0]) < PURGE_BATCH:
                    break
                after = (rows[0][2], rows[0][3])
        return total
