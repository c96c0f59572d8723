"""The effects database: the job queue, the effects and their log, the lock writes."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from typing import Any

from idemlock.cli._faults.queue import Queue, sqlite_connect

Row = dict[str, Any]  # column: value

#: both workloads' tables; SQLite takes PostgreSQL's type names (by affinity) but for
#: the auto-numbered ids, which give the order of acceptance
SCHEMA = """
CREATE TABLE IF NOT EXISTS effects (job_id integer PRIMARY KEY, fence bigint NOT NULL,
    value text NOT NULL, worker text NOT NULL);
CREATE TABLE IF NOT EXISTS effect_log (id {serial}, job_id integer NOT NULL,
    fence bigint NOT NULL, worker text NOT NULL, accepted boolean NOT NULL);
-- the lock workload: the fenced record (the highest token accepted), the write attempts
-- (t_done: after the reply of a store's gate; accepted NULL: outcome unknown; lost and
-- remaining: the lease's when sent), the holds (t_after: when the body started)
CREATE TABLE IF NOT EXISTS lock_fence (resource text PRIMARY KEY, token bigint NOT NULL,
    holder text NOT NULL, seq integer NOT NULL);
CREATE TABLE IF NOT EXISTS lock_log (id {serial}, resource text NOT NULL,
    holder text NOT NULL, token bigint NOT NULL, seq integer NOT NULL,
    t_sent double precision NOT NULL, t_done double precision, accepted boolean,
    lost boolean NOT NULL, remaining double precision NOT NULL);
-- the permits workload's counted fence (Fx.write_counted): per resource the tokens
-- inside (inside = 1) and the floor (inside = 0); its writes and holds go to lock_log
-- and lock_holds
CREATE TABLE IF NOT EXISTS permit_fence (resource text NOT NULL, token bigint NOT NULL,
    holder text NOT NULL, seq integer NOT NULL, inside integer NOT NULL,
    PRIMARY KEY (resource, token));
-- the steps workload: each step's fenced effect (job_step "job/step"), and every
-- execution of one ("run", accepted by the fence or not), every step an attempt saw
-- return after running it ("done"), every interrupted once=True step ("interrupted")
CREATE TABLE IF NOT EXISTS step_effects (job_step text PRIMARY KEY, fence bigint NOT NULL,
    value text NOT NULL, worker text NOT NULL);
CREATE TABLE IF NOT EXISTS step_log (id {serial}, job_id integer NOT NULL, step text NOT NULL,
    kind text NOT NULL, fence bigint NOT NULL, worker text NOT NULL, accepted boolean NOT NULL,
    t double precision NOT NULL);
CREATE TABLE IF NOT EXISTS lock_holds (id {serial}, resource text NOT NULL,
    holder text NOT NULL, token bigint NOT NULL, t_before double precision NOT NULL,
    t_after double precision NOT NULL);
"""
SNAPSHOTS = {
    "jobs": "SELECT id, state, deliveries FROM jobs ORDER BY id",
    "effects": "SELECT job_id, fence, value FROM effects",
    "log": "SELECT id, job_id, fence, worker, accepted FROM effect_log ORDER BY id",
}
#: the fenced writes' tables: their fence column and their log
WRITES = {
    "effects": ("fence", "effect_log"),
    "lock_fence": ("token", "lock_log"),
    "step_effects": ("fence", "step_log"),
}
STEP_SNAPSHOTS = {
    "jobs": SNAPSHOTS["jobs"],
    "effects": "SELECT job_step, fence, value FROM step_effects",
    "log": "SELECT id, job_id, step, kind, fence, worker, accepted, t FROM step_log ORDER BY id",
}
LOCK_SNAPSHOTS = {
    "holds": "SELECT resource, holder, token, t_before, t_after FROM lock_holds ORDER BY id",
    "log": "SELECT id, resource, holder, token, seq, t_sent, t_done, accepted, lost, remaining "
    "FROM lock_log ORDER BY id",
}


class FxError(Exception):
    """The effects database failed (connection lost, locked too long, ...)."""


class Fx(Queue):
    """The effects database of one run (SQLite or PostgreSQL), seen from one process;
    its driver's errors become FxError and drop the connection. The supervisor never
    waits long for a lock a paused worker holds."""

    def __init__(self, kind: str, dsn: str, supervisor: bool = False) -> None:
        super().__init__(lambda: self._connect(dsn, supervisor), postgres=kind == "postgres")
        self.errors: tuple[type[Exception], ...] = (sqlite3.Error,)
        if self.postgres:
            import psycopg

            self.errors = (psycopg.Error,)

    def _connect(self, dsn: str, supervisor: bool) -> Any:
        if not self.postgres:
            return sqlite_connect(dsn, timeout=0.25 if supervisor else 30)
        import psycopg

        options = "-c lock_timeout=250" if supervisor else ""
        return psycopg.connect(dsn, autocommit=True, connect_timeout=3, options=options)

    @contextlib.contextmanager
    def tx(self, write: bool = True) -> Iterator[Any]:
        try:
            with super().tx(write) as c:
                yield c
        except self.errors as exc:
            self.reset()
            raise FxError(f"{type(exc).__name__}: {exc}") from exc

    def create(self, visible: list[float], schema: str = "") -> None:
        serial = "bigserial PRIMARY KEY" if self.postgres else "INTEGER PRIMARY KEY AUTOINCREMENT"
        super().create(visible, SCHEMA.format(serial=serial))

    def release_all(self) -> None:
        """Make every job not yet released visible now (a window that ended early)."""
        now = time.time()
        with self.tx() as c:
            c.execute(
                f"UPDATE jobs SET visible_at = {self.p} "
                f"WHERE state = 'ready' AND deliveries = 0 AND visible_at > {self.p}",
                (now, now),
            )

    def insert(self, table: str, row: Row, c: Any = None) -> None:
        """``row`` into ``table``: in the transaction of ``c``, or in one of its own."""
        if c is None:
            with self.tx() as c:
                return self.insert(table, row, c)
        marks = ", ".join([self.p] * len(row))
        c.execute(f"INSERT INTO {table} ({', '.join(row)}) VALUES ({marks})", list(row.values()))

    def write(self, table: str, row: Row, logged: Row, fenced: bool, finish: Any = None) -> bool:
        """Write ``row`` (its first column is the key) over the key's in ``table``, and
        ``logged`` with the outcome as ``accepted`` in its log, in one transaction (the
        log's ids give the order of acceptance); True if it was written. ``fenced``: only
        over a row whose fence column is not above ours (PostgreSQL: through idemlock's
        own ``fenced_upsert``). ``finish(conn)`` (the completion, same-transaction mode)
        commits with an accepted write; a refused one commits only its log row."""
        fence, log = WRITES[table]
        key, *rest = row
        with self.tx() as c:
            if fenced and self.postgres:
                from idemlock import FencedOut
                from idemlock.stores.postgres import fenced_upsert

                values = {k: row[k] for k in rest if k != fence} | {key: row[key]}
                try:
                    fenced_upsert(c, table, values, [key], row[fence], fence_column=fence)
                    accepted = True
                except FencedOut:
                    accepted = False
            else:
                sets = ", ".join(f"{k} = excluded.{k}" for k in rest)
                where = f" WHERE t.{fence} <= excluded.{fence}" if fenced else ""
                marks = ", ".join([self.p] * len(row))
                sql = (
                    f"INSERT INTO {table} AS t ({', '.join(row)}) VALUES ({marks}) "
                    f"ON CONFLICT ({key}) DO UPDATE SET {sets}{where} RETURNING 1"
                )
                accepted = c.execute(sql, list(row.values())).fetchone() is not None
            self.insert(log, logged | {"accepted": accepted}, c)
            if accepted and finish is not None:
                finish(c)
        return accepted

    def value(self, job_step: str) -> str | None:
        """The steps workload: the value of a step's effect row, if it has one (what a
        worker that found the step interrupted sees of the outside world)."""
        with self.tx(write=False) as c:
            sql = f"SELECT value FROM step_effects WHERE job_step = {self.p}"
            row = c.execute(sql, [job_step]).fetchone()
        return None if row is None else str(row[0])

    def write_counted(self, row: Row, logged: Row, limit: int, fenced: bool) -> bool:
        """The permits workload's write: ``row`` (resource, token, holder, seq) under a
        counted fence, and ``logged`` with the outcome in ``lock_log``, in one transaction
        (the log's ids give the order of acceptance); True if it was written.

        ``fenced``: the fence keeps, per resource, the tokens "inside" (written, not yet
        retired) and a floor (the highest token pushed out). A token inside is accepted;
        one at or below the floor is refused; a new one goes inside, and when that makes
        ``limit`` + 1 the lowest inside is pushed out (the floor rises): refused if that
        is the new one itself. A holder that wrote and will write again is inside, so no
        more than ``limit`` holders' accepted writes interleave. Unfenced (plain mode):
        always written."""
        res, token = row["resource"], row["token"]
        p = self.p
        with self.tx() as c:
            if self.postgres:  # one writer per resource: the log ids follow the commits
                c.execute(f"SELECT pg_advisory_xact_lock(hashtext({p}))", [res])
            rows = c.execute(
                f"SELECT token, inside FROM permit_fence WHERE resource = {p}", [res]
            ).fetchall()
            inside = sorted(int(t) for t, i in rows if i)
            floor = max((int(t) for t, i in rows if not i), default=0)
            accepted = not fenced or token in inside
            if fenced and not accepted and token > floor:
                out = min(inside) if len(inside) >= limit else None
                accepted = out is None or out < token
                if accepted:
                    values = [res, token, row["holder"], row["seq"]]
                    c.execute(
                        f"INSERT INTO permit_fence (resource, token, holder, seq, inside) "
                        f"VALUES ({p}, {p}, {p}, {p}, 1)",
                        values,
                    )
                if out is not None and accepted:  # pushed out: the floor rises
                    c.execute(
                        f"DELETE FROM permit_fence WHERE resource = {p} AND inside = 0",
                        [res],
                    )
                    c.execute(
                        f"UPDATE permit_fence SET inside = 0 WHERE resource = {p} AND token = {p}",
                        [res, out],
                    )
            self.insert("lock_log", logged | {"accepted": accepted}, c)
        return accepted

    def retire(self, resource: str, token: int) -> None:
        """A permit's holder has made its last write: its token leaves the counted
        fence's inside (the floor stays), so a newer holder takes its place without
        pushing out a live one. Never again written with: a retired token that writes
        is a new one to the fence."""
        with self.tx() as c:
            p = self.p
            c.execute(
                f"DELETE FROM permit_fence WHERE resource = {p} AND token = {p} AND inside = 1",
                [resource, token],
            )

    def snapshot(self, queries: dict[str, str] = SNAPSHOTS) -> dict[str, Any]:
        with self.tx(write=False) as c:
            return {name: c.execute(sql).fetchall() for name, sql in queries.items()}
