"""What the fenced helpers of both sides share, with no I/O: checking names and
tokens, building the guarded statements (psycopg and SQLAlchemy Core), reading a
refusal, and finding the store a claim's completion goes to. The helpers that run
statements are in :mod:`._fenced_async`, the source of :mod:`._fenced_sync`; the
public face is :mod:`idemlock.stores.postgres.fenced`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from psycopg import sql
from psycopg.pq import TransactionStatus

from ..._attempts import completion, step_in_transaction, step_store
from ..._core.types import ClaimToken
from ..._errors import ConfigurationError, FencedOut

if TYPE_CHECKING:
    from ..._base.idempotency import AttemptBase
    from ..._sync import IdempotencyPort
    from ...aio import AsyncIdempotencyPort
    from ._shared import _Base

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


# ---- completing a claim in the caller's transaction ------------------------------------


def _completion(
    port: IdempotencyPort | AsyncIdempotencyPort, token: ClaimToken, result: Any
) -> tuple[_Base[Any], tuple[str, str, str, bytes, int]]:
    """(the store, its ``complete`` arguments); the result is encoded by the port's codec
    exactly as ``port.complete`` would."""
    store, args = completion(port, token, result)
    return _postgres(store, "complete_in_transaction", "a port"), args


def _step_in(attempt: AttemptBase, name: str, value: Any) -> tuple[_Base[Any], Any, bytes]:
    """(the store, the parameters of its step statement, the encoded value): the value
    encoded through the spec's format and sealing exactly as ``attempt.step`` would."""
    store = _postgres(step_store(attempt), "record_step_in_transaction", "an attempt")
    args, data = step_in_transaction(attempt, name, value)
    return store, store._step_params(*args), data


def _postgres(store: Any, what: str, of: str) -> _Base[Any]:
    from ._shared import _Base

    if not isinstance(store, _Base):
        raise ConfigurationError(
            f"{what} needs {of} on a PostgreSQL store, not on the "
            f"{getattr(store, 'kind', type(store).__name__)} store"
        )
    return store


def _needs_transaction(
    autocommit: bool, status: TransactionStatus, what: str = "complete_in_transaction"
) -> None:
    if autocommit and status == TransactionStatus.IDLE:
        raise ConfigurationError(
            f"{what} must run inside your transaction (with "
            "conn.transaction(): ...); on an autocommit connection outside one it would "
            "commit on its own"
        )
