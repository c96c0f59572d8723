"""The fenced helpers that run statements, on a ``psycopg.AsyncConnection`` (and a
SQLAlchemy ``AsyncConnection``). This module is the source of :mod:`._fenced_sync`,
which tools/async_to_sync.py generates; what both share is in :mod:`._fenced_sql`,
and the public face is :mod:`idemlock.stores.postgres.fenced`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.rows import tuple_row

from ..._attempts import stale, stepped_in_transaction
from ..._core.jsontypes import JSONValue
from ..._core.types import ClaimToken
from ..._errors import FencedOut
from ._fenced_sql import (
    FENCE_COLUMN,
    TableName,
    _columns,
    _completion,
    _conflict,
    _fenced_out,
    _needs_transaction,
    _sa_current,
    _sa_key_where,
    _step_in,
    _table,
    _token,
    _update_sql,
    _upsert_sql,
    fenced_update_stmt,
    fenced_upsert_stmt,
)

if TYPE_CHECKING:
    from ..._sync import IdempotencyPort
    from ..._tasks import AsyncAttempt
    from ..._threads import Attempt
    from ...aio import AsyncIdempotencyPort

# ---- psycopg -----------------------------------------------------------------------


async def afenced_update(
    conn: psycopg.AsyncConnection[Any],
    table: TableName,
    set_values: Mapping[str, Any],
    where: Mapping[str, Any],
    token: int,
    *,
    fence_column: str = FENCE_COLUMN,
) -> int:
    """``UPDATE table SET <set_values>, fence_column = token WHERE <where: col = value,
    ...> AND (fence_column IS NULL OR fence_column <= token)``, one statement, on a
    ``psycopg.AsyncConnection``.

    Returns the number of rows updated (0 if no row matches ``where``). Raises
    :class:`~idemlock.FencedOut` if a matching row carries a higher token, i.e. a
    newer holder already wrote it; then nothing was changed."""
    tok = _token(token)
    t, name = _table(table)
    _columns(set_values, "set_values", fence_column)
    _columns(where, "where")
    update, current = _update_sql(t, set_values, where, fence_column)
    cur = conn.cursor(row_factory=tuple_row)  # whatever row factory the connection has
    await cur.execute(update, [*set_values.values(), tok, *where.values(), tok])
    if cur.rowcount > 0:
        return cur.rowcount
    await cur.execute(current, list(where.values()))
    row = await cur.fetchone()
    out = _fenced_out(name, tok, row[0] if row else None)
    if out is not None:
        raise out
    return 0


async def afenced_upsert(
    conn: psycopg.AsyncConnection[Any],
    table: TableName,
    values: Mapping[str, Any],
    conflict: Sequence[str],
    token: int,
    *,
    fence_column: str = FENCE_COLUMN,
) -> None:
    """``INSERT ... ON CONFLICT (conflict) DO UPDATE ... WHERE fence_column <= token`` on
    a ``psycopg.AsyncConnection``: insert the row, or update it unless a newer holder
    wrote it (then :class:`~idemlock.FencedOut`, nothing changed). ``conflict`` names a
    unique key."""
    tok = _token(token)
    t, name = _table(table)
    _columns(values, "values", fence_column)
    keys = _conflict(values, conflict)
    upsert, current = _upsert_sql(t, values, keys, fence_column)
    cur = conn.cursor(row_factory=tuple_row)
    await cur.execute(upsert, [*values.values(), tok])
    if await cur.fetchone() is not None:
        return
    await cur.execute(current, [values[c] for c in keys])
    row = await cur.fetchone()
    raise _fenced_out(name, tok, row[0] if row else None) or FencedOut(name, tok, None)


# ---- SQLAlchemy Core (imported only when these are called) --------------------------


async def sa_afenced_update(
    conn: Any,
    table: Any,
    values: Mapping[str, Any],
    where: Any,
    token: int,
    *,
    fence_column: str = FENCE_COLUMN,
) -> int:
    """Run :func:`fenced_update_stmt` on a ``sqlalchemy.ext.asyncio.AsyncConnection``;
    returns the rows updated, raises :class:`~idemlock.FencedOut` if a matching row has
    a higher token."""
    stmt = fenced_update_stmt(table, values, where, token, fence_column=fence_column)
    result = await conn.execute(stmt)
    if result.rowcount > 0:
        return int(result.rowcount)
    current = (await conn.execute(_sa_current(table, where, fence_column))).scalar()
    out = _fenced_out(table.name, token, current)
    if out is not None:
        raise out
    return 0


async def sa_afenced_upsert(
    conn: Any,
    table: Any,
    values: Mapping[str, Any],
    conflict: Sequence[str],
    token: int,
    *,
    fence_column: str = FENCE_COLUMN,
) -> None:
    """Run :func:`fenced_upsert_stmt` on a ``sqlalchemy.ext.asyncio.AsyncConnection``;
    raises :class:`~idemlock.FencedOut` (nothing written) if a newer holder wrote the
    row."""
    stmt = fenced_upsert_stmt(table, values, conflict, token, fence_column=fence_column)
    if (await conn.execute(stmt)).first() is not None:
        return
    keys = _conflict(values, conflict)
    where = _sa_key_where(table, values, keys)
    current = (await conn.execute(_sa_current(table, where, fence_column))).scalar()
    raise _fenced_out(table.name, token, current) or FencedOut(table.name, token, None)


# ---- completing a claim in the caller's transaction ------------------------------------


async def acomplete_in_transaction(
    conn: psycopg.AsyncConnection[Any],
    port: IdempotencyPort | AsyncIdempotencyPort,
    token: ClaimToken,
    result: JSONValue,
) -> None:
    """Record ``result`` for the claim ``token`` of ``port`` on ``conn`` (a
    ``psycopg.AsyncConnection``), in the transaction open on it, so it commits or rolls
    back with your own writes there; waiters are notified when it commits.

    ``conn`` must reach the same database as the store. Raises
    :class:`~idemlock.StaleClaim` (roll back!) if the claim no longer holds its key."""
    _needs_transaction(conn.autocommit, conn.info.transaction_status)
    store, args = _completion(port, token, result)
    # The claim came first, so the schema exists.
    stmt = store.statements.complete
    done = bool(await _arun(conn, store, stmt, store._complete_params(*args), "complete"))
    if not done:
        raise stale(port, token, "complete")


async def _arun(
    conn: psycopg.AsyncConnection[Any], store: Any, stmt: Any, params: Any, what: str
) -> list[tuple[Any, ...]]:
    """One of the store's statements on the caller's connection: its rows."""
    cur = psycopg.AsyncRawCursor(conn, row_factory=tuple_row)
    try:
        # Behind a transaction pooler never prepared (else as the connection says).
        prepare = False if store._pooled else None
        await cur.execute(stmt.sql, stmt.args(params), prepare=prepare, binary=True)
        return await cur.fetchall()
    except psycopg.Error as exc:
        raise store._unavailable(exc, what) from exc


# ---- recording a step in the caller's transaction --------------------------------------


async def arecord_step_in_transaction(
    conn: psycopg.AsyncConnection[Any],
    attempt: Attempt | AsyncAttempt,
    name: str,
    value: JSONValue,
) -> None:
    """Record ``value`` as step ``name`` of ``attempt`` on ``conn`` (a
    ``psycopg.AsyncConnection``), in the transaction open on it, so the step's record
    commits or rolls back with your own writes there: the statement and the fencing of
    ``attempt.step``, the value encoded as it encodes it. Once that transaction
    committed, ``attempt.step(name, fn)`` replays ``value`` without calling ``fn``, in
    this attempt and in every retry.

    ``conn`` must reach the same database as the store. Raises (roll back!)
    :class:`~idemlock.ClaimLost` if the attempt lost its claim,
    :class:`~idemlock.ResultTooLarge` naming the step, and
    :class:`~idemlock.DuplicateStep` if this attempt recorded ``name`` already or an
    earlier attempt did (call it inside ``attempt.step(name, fn)``'s ``fn``, which a
    retry then replays instead of running)."""
    _needs_transaction(conn.autocommit, conn.info.transaction_status, "record_step_in_transaction")
    store, params, data = _step_in(attempt, name, value)
    rows = await _arun(conn, store, store.statements.step, params, "step")
    stepped_in_transaction(attempt, name, int(rows[0][0]) if rows else None, data)
