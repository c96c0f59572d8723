"""Fenced writes to your own tables, and completing a claim (or recording a step) in
your own transaction.

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

Recording a step in the same transaction
----------------------------------------
:func:`record_step_in_transaction` does the same for one step of ``port.run``'s
attempt (``attempt.step``'s statement, fenced by the claim): the step's own writes and
its record commit together. Call it in the step's function, so that a retry replays
the step instead of running it::

    def reserve() -> int:
        with pool.connection() as conn, conn.transaction():
            rid = conn.execute("INSERT INTO holds ... RETURNING id").fetchone()[0]
            record_step_in_transaction(conn, attempt, "reserve", rid)
        return rid

    rid = attempt.step("reserve", reserve)
"""

from __future__ import annotations

from ._fenced_async import (
    acomplete_in_transaction,
    afenced_update,
    afenced_upsert,
    arecord_step_in_transaction,
    sa_afenced_update,
    sa_afenced_upsert,
)
from ._fenced_sql import FENCE_COLUMN as FENCE_COLUMN
from ._fenced_sql import TableName as TableName
from ._fenced_sql import fenced_update_stmt, fenced_upsert_stmt
from ._fenced_sync import (
    complete_in_transaction,
    fenced_update,
    fenced_upsert,
    record_step_in_transaction,
    sa_fenced_update,
    sa_fenced_upsert,
)

__all__ = [
    "acomplete_in_transaction",
    "afenced_update",
    "afenced_upsert",
    "arecord_step_in_transaction",
    "complete_in_transaction",
    "fenced_update",
    "fenced_update_stmt",
    "fenced_upsert",
    "fenced_upsert_stmt",
    "record_step_in_transaction",
    "sa_afenced_update",
    "sa_afenced_upsert",
    "sa_fenced_update",
    "sa_fenced_upsert",
]
