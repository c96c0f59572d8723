"""Fenced writes to your own tables, and completing a claim in your own transaction.

The reason to keep idempotency records in the database that holds your data: the
fence check can sit *inside* your write, and the result can commit *with* it.

Fenced writes
-------------
Give each guarded table a fence column (``fence_token bigint``, NULL until the first
fenced write). Every guarded write stores the writer's token in it, and only succeeds
while the row's token is not higher::

    UPDATE accounts SET balance = %s, fence_token = %s
    WHERE id = %s AND (fence_token IS NULL OR fence_token <= %s)

A writer whose lease or claim expired while another holder took over (and wrote with a
higher token) changes no row, and the helper raises :class:`~idemlock.FencedOut`. The
check and the write are one statement, so no other write can slip in between. The
guard applies row by row: use ``where`` to pick rows by key.

* psycopg: :func:`fenced_update`, :func:`fenced_upsert` (and ``afenced_*`` for
  ``psycopg.AsyncConnection``);
* SQLAlchemy Core: :func:`fenced_update_stmt` / :func:`fenced_upsert_stmt` build the
  guarded statement; :func:`sa_fenced_update` / :func:`sa_fenced_upsert` (and
  ``sa_afenced_*``) run it and raise ``FencedOut``.

Completing in the same transaction
----------------------------------
:func:`complete_in_transaction` records a claim's result on *your* connection, inside
*your* transaction: your write and the idempotency record commit together or not at
all. Waiters are woken when it commits::

    claim = port.claim(key, payload=req)
    if isinstance(claim, idemlock.Claimed):
        with pool.connection() as conn, conn.transaction():
            fenced_update(conn, "accounts", {"balance": new}, {"id": acct}, claim.fence)
            complete_in_transaction(conn, port, claim.token, {"balance": new})

If the claim lost its key, :class:`~idemlock.StaleClaim` is raised inside the block and
the transaction (with your write) rolls back. Until you commit, the claim's row stays
locked: another attempt on the same key waits for your commit, so keep the transaction
short.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from ..._attempts import completion, stale
from ..._core.types import ClaimToken
from ..._errors import ConfigurationError, FencedOut

if TYPE_CHECKING:
    from ..._sync import IdempotencyPort
    from ...aio import AsyncIdempotencyPort

__all__ = [
    "acomplete_in_transaction",
    "afenced_update",
    "afenced_upsert",
    "complete_in_transaction",
    "fenced_update",
    "fenced_update_stmt",
    "fenced_upsert",
    "fenced_upsert_stmt",
    "sa_afenced_update",
    "sa_afenced_upsert",
    "sa_fenced_update",
    "sa_fenced_upsert",
]

FENCE_COLUMN = "fence_token"
TableName = str | Sequence[str] | sql.Composable


def _token(token: object) -> int:
    # The one token check (A4): bigint range, so psycopg never sees a larger int.
    from ..._tokens import check_token

    return check_token(token)


def _table(table: TableName) -> tuple[sql.Composable, str]:
    """(SQL for the table, name for messages). ``"schema.table"`` is split on the dot;
    pass a tuple or a psycopg.sql object for names that contain dots."""
    if isinstance(table, sql.Composable):
        return table, table.as_string(None)
    parts = table.split(".") if isinstance(table, str) else list(table)
    if not parts or not all(isinstance(p, str) and p for p in parts):
        raise ConfigurationError(f"invalid table name {table!r}")
    return sql.Identifier(*parts), ".".join(parts)


def _columns(values: Mapping[str, Any], what: str, fence: str | None = None) -> list[str]:
    if not values:
        raise ConfigurationError(f"{what} must name at least one column")
    if fence is not None and fence in values:
        raise ConfigurationError(
            f"{what} must not set the fence column {fence!r}: the helper writes the token there"
        )
    return list(values)


def _update_sql(
    table: sql.Composable, values: Mapping[str, Any], where: Mapping[str, Any], fence: str
) -> tuple[sql.Composed, sql.Composed]:
    sets = sql.SQL(", ").join(
        sql.SQL("{} = %s").format(sql.Identifier(c)) for c in [*values, fence]
    )
    conds = sql.SQL(" AND ").join(sql.SQL("{} = %s").format(sql.Identifier(c)) for c in where)
    f = sql.Identifier(fence)
    update = sql.SQL("UPDATE {t} SET {sets} WHERE {conds} AND ({f} IS NULL OR {f} <= %s)").format(
        t=table, sets=sets, conds=conds, f=f
    )
    current = sql.SQL("SELECT max({f}) FROM {t} WHERE {conds}").format(t=table, f=f, conds=conds)
    return update, current


def _upsert_sql(
    table: sql.Composable, values: Mapping[str, Any], conflict: Sequence[str], fence: str
) -> tuple[sql.Composed, sql.Composed]:
    cols = [*values, fence]
    f = sql.Identifier(fence)
    updates = sql.SQL(", ").join(
        sql.SQL("{c} = excluded.{c}").format(c=sql.Identifier(c)) for c in cols if c not in conflict
    )
    upsert = sql.SQL(
        "INSERT INTO {t} AS t ({cols}) VALUES ({vals}) "
        "ON CONFLICT ({conflict}) DO UPDATE SET {updates} "
        "WHERE t.{f} IS NULL OR t.{f} <= excluded.{f} RETURNING 1"
    ).format(
        t=table,
        cols=sql.SQL(", ").join(map(sql.Identifier, cols)),
        vals=sql.SQL(", ").join(sql.Placeholder() * len(cols)),
        conflict=sql.SQL(", ").join(map(sql.Identifier, conflict)),
        updates=updates,
        f=f,
    )
    conds = sql.SQL(" AND ").join(sql.SQL("{} = %s").format(sql.Identifier(c)) for c in conflict)
    current = sql.SQL("SELECT max({f}) FROM {t} WHERE {conds}").format(t=table, f=f, conds=conds)
    return upsert, current


def _conflict(values: Mapping[str, Any], conflict: Sequence[str]) -> list[str]:
    if isinstance(conflict, str):
        conflict = [conflict]
    conflict = list(conflict)
    missing = [c for c in conflict if c not in values]
    if not conflict or missing:
        raise ConfigurationError(
            f"conflict columns {conflict!r} must be non-empty and all be in values "
            f"(missing: {missing})"
        )
    return conflict


def _fenced_out(name: str, token: int, current: Any) -> FencedOut | None:
    if current is not None and int(current) > token:
        return FencedOut(name, token, int(current))
    return None


# ---- psycopg -----------------------------------------------------------------------


def fenced_update(
    conn: psycopg.Connection[Any],
    table: TableName,
    set_values: Mapping[str, Any],
    where: Mapping[str, Any],
    token: int,
    *,
    fence_column: str = FENCE_COLUMN,
) -> int:
    """``UPDATE table SET <set_values>, fence_column = token WHERE <where: col = value,
    ...> AND (fence_column IS NULL OR fence_column <= token)``, one statement.

    Returns the number of rows updated (0 if no row matches ``where``). Raises
    :class:`~idemlock.FencedOut` if a matching row carries a higher token, i.e. a
    newer holder already wrote it; then nothing was changed."""
    tok = _token(token)
    t, name = _table(table)
    _columns(set_values, "set_values", fence_column)
    _columns(where, "where")
    update, current = _update_sql(t, set_values, where, fence_column)
    cur = conn.cursor(row_factory=tuple_row)  # whatever row factory the connection has
    cur.execute(update, [*set_values.values(), tok, *where.values(), tok])
    if cur.rowcount > 0:
        return cur.rowcount
    row = cur.execute(current, list(where.values())).fetchone()
    out = _fenced_out(name, tok, row[0] if row else None)
    if out is not None:
        raise out
    return 0


def fenced_upsert(
    conn: psycopg.Connection[Any],
    table: TableName,
    values: Mapping[str, Any],
    conflict: Sequence[str],
    token: int,
    *,
    fence_column: str = FENCE_COLUMN,
) -> None:
    """``INSERT ... ON CONFLICT (conflict) DO UPDATE ... WHERE fence_column <= token``:
    insert the row, or update it unless a newer holder wrote it (then
    :class:`~idemlock.FencedOut`, nothing changed). ``conflict`` names a unique key."""
    tok = _token(token)
    t, name = _table(table)
    _columns(values, "values", fence_column)
    keys = _conflict(values, conflict)
    upsert, current = _upsert_sql(t, values, keys, fence_column)
    cur = conn.cursor(row_factory=tuple_row)
    if cur.execute(upsert, [*values.values(), tok]).fetchone() is not None:
        return
    row = cur.execute(current, [values[c] for c in keys]).fetchone()
    raise _fenced_out(name, tok, row[0] if row else None) or FencedOut(name, tok, None)


async def afenced_update(
    conn: psycopg.AsyncConnection[Any],
    table: TableName,
    set_values: Mapping[str, Any],
    where: Mapping[str, Any],
    token: int,
    *,
    fence_column: str = FENCE_COLUMN,
) -> int:
    """:func:`fenced_update` on an ``AsyncConnection``."""
    tok = _token(token)
    t, name = _table(table)
    _columns(set_values, "set_values", fence_column)
    _columns(where, "where")
    update, current = _update_sql(t, set_values, where, fence_column)
    cur = conn.cursor(row_factory=tuple_row)
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
    """:func:`fenced_upsert` on an ``AsyncConnection``."""
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


def fenced_update_stmt(
    table: Any,
    values: Mapping[str, Any],
    where: Any,
    token: int,
    *,
    fence_column: str = FENCE_COLUMN,
) -> Any:
    """A guarded ``sqlalchemy.Update`` of ``table`` (a ``sqlalchemy.Table``): sets
    ``values`` and the fence column to ``token`` where ``where`` (a SQL expression)
    holds and the row's fence is NULL or not above ``token``. Run it yourself (sync or
    async) and treat ``rowcount == 0`` as "absent or fenced out", or use
    :func:`sa_fenced_update`."""
    import sqlalchemy as sa

    tok = _token(token)
    _columns(values, "values", fence_column)
    col = table.c[fence_column]
    stmt = (
        table.update()
        .where(sa.or_(col.is_(None), col <= tok))
        .values({**values, fence_column: tok})
    )
    return stmt if where is None else stmt.where(where)


def fenced_upsert_stmt(
    table: Any,
    values: Mapping[str, Any],
    conflict: Sequence[str],
    token: int,
    *,
    fence_column: str = FENCE_COLUMN,
) -> Any:
    """A guarded PostgreSQL ``INSERT ... ON CONFLICT DO UPDATE`` of ``table``; it
    returns one row when it wrote and none when a newer holder's row is in the way."""
    from sqlalchemy.dialects.postgresql import insert

    tok = _token(token)
    _columns(values, "values", fence_column)
    keys = _conflict(values, conflict)
    row = {**values, fence_column: tok}
    stmt = insert(table).values(row)
    col = table.c[fence_column]
    return stmt.on_conflict_do_update(
        index_elements=keys,
        set_={c: stmt.excluded[c] for c in row if c not in keys},
        where=col.is_(None) | (col <= stmt.excluded[fence_column]),
    ).returning(table.c[keys[0]])


def _sa_current(table: Any, where: Any, fence_column: str) -> Any:
    import sqlalchemy as sa

    query = sa.select(sa.func.max(table.c[fence_column]))
    return query if where is None else query.where(where)


def _sa_key_where(table: Any, values: Mapping[str, Any], keys: Sequence[str]) -> Any:
    import sqlalchemy as sa

    return sa.and_(*(table.c[k] == values[k] for k in keys))


def sa_fenced_update(
    conn: Any,
    table: Any,
    values: Mapping[str, Any],
    where: Any,
    token: int,
    *,
    fence_column: str = FENCE_COLUMN,
) -> int:
    """Run :func:`fenced_update_stmt` on a ``sqlalchemy.Connection``; returns the rows
    updated, raises :class:`~idemlock.FencedOut` if a matching row has a higher token."""
    stmt = fenced_update_stmt(table, values, where, token, fence_column=fence_column)
    result = conn.execute(stmt)
    if result.rowcount > 0:
        return int(result.rowcount)
    out = _fenced_out(
        table.name, token, conn.execute(_sa_current(table, where, fence_column)).scalar()
    )
    if out is not None:
        raise out
    return 0


def sa_fenced_upsert(
    conn: Any,
    table: Any,
    values: Mapping[str, Any],
    conflict: Sequence[str],
    token: int,
    *,
    fence_column: str = FENCE_COLUMN,
) -> None:
    """Run :func:`fenced_upsert_stmt` on a ``sqlalchemy.Connection``; raises
    :class:`~idemlock.FencedOut` (nothing written) if a newer holder wrote the row."""
    stmt = fenced_upsert_stmt(table, values, conflict, token, fence_column=fence_column)
    if conn.execute(stmt).first() is not None:
        return
    keys = _conflict(values, conflict)
    current = conn.execute(
        _sa_current(table, _sa_key_where(table, values, keys), fence_column)
    ).scalar()
    raise _fenced_out(table.name, token, current) or FencedOut(table.name, token, None)


async def sa_afenced_update(
    conn: Any,
    table: Any,
    values: Mapping[str, Any],
    where: Any,
    token: int,
    *,
    fence_column: str = FENCE_COLUMN,
) -> int:
    """:func:`sa_fenced_update` on a ``sqlalchemy.ext.asyncio.AsyncConnection``."""
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
    """:func:`sa_fenced_upsert` on a ``sqlalchemy.ext.asyncio.AsyncConnection``."""
    stmt = fenced_upsert_stmt(table, values, conflict, token, fence_column=fence_column)
    if (await conn.execute(stmt)).first() is not None:
        return
    keys = _conflict(values, conflict)
    where = _sa_key_where(table, values, keys)
    current = (await conn.execute(_sa_current(table, where, fence_column))).scalar()
    raise _fenced_out(table.name, token, current) or FencedOut(table.name, token, None)


# ---- completing a claim in the caller's transaction ------------------------------------


def _completion(
    port: IdempotencyPort | AsyncIdempotencyPort, token: ClaimToken, result: Any
) -> tuple[Any, tuple[str, str, str, bytes, int]]:
    """(the store, its ``complete`` arguments); the result is encoded by the port's codec
    exactly as ``port.complete`` would."""
    from ._store import _Base

    store, args = completion(port, token, result)
    if not isinstance(store, _Base):
        raise ConfigurationError(
            f"complete_in_transaction needs a port on a PostgreSQL store, not on the "
            f"{getattr(store, 'kind', type(store).__name__)} store"
        )
    return store, args


def _needs_transaction(autocommit: bool, status: TransactionStatus) -> None:
    if autocommit and status == TransactionStatus.IDLE:
        raise ConfigurationError(
            "complete_in_transaction must run inside your transaction (with "
            "conn.transaction(): ...); on an autocommit connection outside one it would "
            "commit on its own"
        )


def complete_in_transaction(
    conn: psycopg.Connection[Any],
    port: IdempotencyPort | AsyncIdempotencyPort,
    token: ClaimToken,
    result: Any,
) -> None:
    """Record ``result`` for the claim ``token`` of ``port`` on ``conn``, in the
    transaction open on it, so it commits or rolls back with your own writes there.

    ``conn`` must reach the same database as the store. Raises
    :class:`~idemlock.StaleClaim` (roll back!) if the claim no longer holds its key."""
    _needs_transaction(conn.autocommit, conn.info.transaction_status)
    store, args = _completion(port, token, result)
    if not store.complete_in(conn, *args):
        raise stale(port, token, "complete")


async def acomplete_in_transaction(
    conn: psycopg.AsyncConnection[Any],
    port: IdempotencyPort | AsyncIdempotencyPort,
    token: ClaimToken,
    result: Any,
) -> None:
    """:func:`complete_in_transaction` on an ``AsyncConnection``."""
    _needs_transaction(conn.autocommit, conn.info.transaction_status)
    store, args = _completion(port, token, result)
    if not await store.acomplete_in(conn, *args):
        raise stale(port, token, "complete")
