"""An at-least-once job queue in a table, as a broker behaves.

``take`` hands the oldest visible job to a worker and makes it invisible for
``visibility`` seconds (a stalled worker's job is delivered again after that);
``ack`` marks it done; ``nack`` makes it visible again at a given time; ``release``
makes a dead worker's jobs visible at once (a broker does this when a consumer's
connection drops). Every delivery counts in ``deliveries``.

The statements take the driver's placeholder (``{p}``) and, for PostgreSQL, row
locking that skips jobs other takers hold (``{lock}``); ``statements()`` fills them.
``SqliteQueue`` runs them on one SQLite connection.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator

JOBS_SQLITE = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY,
    state TEXT NOT NULL DEFAULT 'ready',           -- ready | done
    worker TEXT,
    visible_at REAL NOT NULL,                      -- epoch seconds; invisible until then
    deliveries INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_ready ON jobs (state, visible_at);
"""
JOBS_PG = """
CREATE TABLE IF NOT EXISTS jobs (
    id integer PRIMARY KEY,
    state text NOT NULL DEFAULT 'ready',
    worker text,
    visible_at double precision NOT NULL,
    deliveries integer NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_ready ON jobs (visible_at) WHERE state = 'ready';
"""

_SQL = {
    "take": (
        "UPDATE jobs SET worker = {p}, deliveries = deliveries + 1, visible_at = {p} "
        "WHERE id = (SELECT id FROM jobs WHERE state = 'ready' AND visible_at <= {p} "
        "ORDER BY visible_at, id LIMIT 1{lock}) RETURNING id, deliveries"
    ),
    "ack": "UPDATE jobs SET state = 'done' WHERE id = {p} AND state = 'ready'",
    # only the delivery it was given: a late nack cannot hide a job delivered since
    "nack": (
        "UPDATE jobs SET visible_at = {p}, worker = NULL "
        "WHERE id = {p} AND worker = {p} AND deliveries = {p} AND state = 'ready'"
    ),
    "release": (
        "UPDATE jobs SET visible_at = {p} "
        "WHERE worker = {p} AND state = 'ready' AND visible_at > {p}"
    ),
    "busy": "SELECT DISTINCT worker FROM jobs WHERE state = 'ready' AND visible_at > {p}",
    "undone": "SELECT COUNT(*) FROM jobs WHERE state != 'done'",
    "create": "INSERT INTO jobs (id, visible_at) VALUES ({p}, {p})",
}


def statements(p: str = "?", lock: str = "") -> dict[str, str]:
    """The queue's statements for a driver (``p``: its placeholder; ``lock``: e.g.
    PostgreSQL's `` FOR UPDATE SKIP LOCKED``)."""
    return {name: sql.format(p=p, lock=lock) for name, sql in _SQL.items()}


class SqliteQueue:
    """The queue in a SQLite file (WAL), one connection per process."""

    def __init__(self, path: str, timeout: float = 60.0) -> None:
        # Autocommit mode: every transaction below is an explicit BEGIN IMMEDIATE.
        self.conn = sqlite3.connect(path, timeout=timeout, isolation_level=None)
        self.conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL survives a kill
        self.sql = statements()

    @contextlib.contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.conn
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def create(self, visible: list[float]) -> None:
        """The table, and one job per entry of ``visible`` (ids 1, 2, ...)."""
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.executescript(JOBS_SQLITE)
        with self.tx() as c:
            c.executemany(self.sql["create"], [(i + 1, t) for i, t in enumerate(visible)])

    def take(self, worker: str, visibility: float) -> tuple[int, int] | None:
        """(job, delivery number) or None when no job is visible."""
        now = time.time()
        with self.tx() as c:
            row = c.execute(self.sql["take"], (worker, now + visibility, now)).fetchone()
        return None if row is None else (int(row[0]), int(row[1]))

    def ack(self, job: int) -> None:
        with self.tx() as c:
            c.execute(self.sql["ack"], (job,))

    def nack(self, job: int, worker: str, delivery: int, until: float) -> None:
        with self.tx() as c:
            c.execute(self.sql["nack"], (until, job, worker, delivery))

    def release(self, worker: str) -> None:
        now = time.time()
        with self.tx() as c:
            c.execute(self.sql["release"], (now, worker, now))

    def busy(self) -> set[str]:
        rows = self.conn.execute(self.sql["busy"], (time.time(),)).fetchall()
        return {str(r[0]) for r in rows if r[0] is not None}

    def undone(self) -> int:
        return int(self.conn.execute(self.sql["undone"]).fetchone()[0])

    def close(self) -> None:
        self.conn.close()
