"""Fault injection: do effects stay exactly-once-in-effect while everything breaks?

    python benchmarks/chaos.py --store sqlite|redis|redis-cluster|postgres|etcd
        [--same-transaction] [--mode idemlock|plain|both]
        [--jobs N --workers W --duration S --seed X --fault-every S --lease S ...]
    python benchmarks/chaos.py --all [--mode both]      # every store (the long run)
    python benchmarks/chaos.py --all --short            # what CI runs
    python benchmarks/chaos.py --all --workload lock    # the lock workload, every store
    ... --json                                          # the report as JSON

What one run does, on throwaway servers on free loopback ports (never anything else):

* The **effects database** holds an at-least-once queue (``jobs``: a job taken by a
  worker turns invisible for ``--visibility`` seconds and is delivered again when its
  worker dies or stalls), the side effect (``effects(job_id PRIMARY KEY, fence,
  value)``) and an append-only ``effect_log(id, job_id, fence, worker, accepted)``
  written in the same transaction as each attempted effect. It is a SQLite file for
  the SQLite store and a PostgreSQL database otherwise (for the PostgreSQL store, the
  store's own database, reached through the same proxy as the store).
* ``--workers`` processes take jobs (released at a steady rate over ``--duration``)
  and run each through ``@coord.idempotent`` keyed ``job-<id>``: the function writes
  the effect **fenced** by ``current_claim().fence`` (``... ON CONFLICT (job_id) DO
  UPDATE ... WHERE effects.fence <= new fence``) and returns the value it wrote; then
  the job is acknowledged. In **same-transaction** mode (PostgreSQL) the worker claims
  through the port and commits the effect, its log row and ``complete_in_transaction``
  in one transaction. In **plain** mode there is no idemlock: the effect is an
  unfenced upsert and the retry is the queue's redelivery (the delivery number stands
  in for the token, so stale overwrites can be counted).
* Faults, at random (exponential gaps of mean ``--fault-every``, kinds taken in
  shuffled rounds so each kind occurs): SIGKILL of a worker (a replacement starts; its
  jobs are redelivered at once, as a broker does when a consumer's connection drops),
  SIGSTOP of a worker for 1.3-2.5 leases then SIGCONT, a restart of the store server
  (Redis: killed and started empty, ``--save '' --appendonly no``; a Cluster node the
  same; PostgreSQL: ``pg_ctl restart -m immediate``, a crash), a cut of every
  connection through the loopback TCP proxy between the workers and the store, and a
  **blackhole** of that proxy for 0.5-4 leases: it stops forwarding without closing
  anything (a dead switch, a partition), either everything (new connections hang
  after the kernel's accept) or a random half of the open connections.
* At the end, from the data alone: every job is done and has exactly one effect row;
  in the log, no write was accepted with a token lower than one accepted before it
  for that key, and the effect row carries the highest accepted token; every
  completed key replays (the wrapped function is called again in the checker: it
  must not run) the value found in the effect row; after a lease no key is still
  claimed; in same-transaction mode every effect ran exactly once. Counted, not
  violations: effects that ran again (a worker died or stalled between its effect and
  ``complete``: the window no claim can close; the fenced, keyed write makes the
  re-run replace the row instead of adding one), stale writes refused by the fence,
  and records Redis lost with its data.

The **lock workload** (``--workload lock``): workers contend for ``--resources`` locks
through ``hold()`` (ttl ``--lease``, renewed every ttl/3), each hold lasting 0.2-2.5
ttls, and under it decide to write (noting the time, ``lease.remaining()`` and
``lease.lost``), prepare for 5-25 ms, then make a **fenced write** with the lease's
token: Redis and Cluster through the store's own gate, ``FenceGate.set_if_fresh``,
logged afterwards with the times around it; SQLite and PostgreSQL by a fenced upsert
(PostgreSQL: idemlock's ``fenced_upsert``) committed with its log row, so the log's ids
are the order of acceptance. Faults: SIGKILL and SIGSTOP past the ttl of a holder,
blackholes, cuts, and PostgreSQL crashes (no Redis restarts here: an empty Redis
forgets its leases and gates, the data loss the job workload already counts). The
checker (``check_lock_history``) reads the history: no accepted write's token is below
one accepted before it; accepted writes of two holders never go A, B, A; a hold that
began after another was granted got a higher token, and no token went to two holders;
no write was decided while ``remaining()`` still showed time on a lease another holder
had been granted. ``--mode plain`` writes without the fence: the negative control,
whose stale and interleaved writes are reported, not failures.

**etcd** (``--store etcd``): a 3-member cluster on free loopback ports, each member
behind its own proxy (the workers' URL names the three proxies). Its "restart" is, at
random, a SIGKILL of the current leader followed by its restart (same ports and data;
the supervisor waits for the member to answer again) or a SIGSTOP of one member for
0.5-3 leases, then SIGCONT (a pause; at most one member paused at a time); the report's
``etcd_faults`` counts each. A cut aborts the connections of one member's proxy or of
all; a blackhole silences everything or every connection of one member's proxy. The
effects database is a local SQLite file; the lock workload's write is
``FenceGate.check_and_advance`` on the workers' own coordinator, logged to that file
afterwards with the times around it (judged as the Redis gate's writes are).

Exits 1 on any violation (plain mode: duplicates and stale overwrites are reported,
not violations; only harness failures fail it).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import os
import random
import shutil
import signal
import sqlite3
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(HERE), str(ROOT / "src"), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# The servers are the tests' own (tests/servers/), one module for both.
from tests.servers.postgres import PgServer, start_postgres  # noqa: E402
from tests.servers.redis import RedisCluster, RedisServer, start_cluster, start_redis  # noqa: E402

from idemlock._faults.queue import JOBS_PG, JOBS_SQLITE, statements  # noqa: E402
from idemlock._faults.workers import Slot, Workers, context, redirect  # noqa: E402

HOST = "127.0.0.1"
STORES = ("sqlite", "redis", "redis-cluster", "postgres", "etcd")
KINDS = ("kill", "stop", "restart", "cut", "blackhole")
#: which faults apply: SQLite has no server to restart and no connection to cut.
STORE_KINDS = {
    "sqlite": ("kill", "stop"),
    "redis": KINDS,
    "redis-cluster": KINDS,
    "postgres": KINDS,
    "etcd": KINDS,
}
#: the lock workload's faults: no Redis restarts there (an empty Redis forgets its leases
#: and gates: data loss the job workload already measures, not a failure of the lock)
LOCK_KINDS = {
    "sqlite": ("kill", "stop"),
    "redis": ("kill", "stop", "cut", "blackhole"),
    "redis-cluster": ("kill", "stop", "cut", "blackhole"),
    "postgres": KINDS,
    # etcd keeps its leases and fences through a leader's crash: restarts apply
    "etcd": KINDS,
}
#: faults on the proxy: with nothing connected through it they are skipped, not retried
NETWORK_KINDS = ("cut", "blackhole")
WORKLOADS = ("jobs", "lock")
LOCK_SPEC = "chaos-lock"
#: slack for clock granularity when comparing times taken in different processes (one
#: machine, CLOCK_MONOTONIC) with lease expiry judged by the store's clock
SLACK = 0.02
#: stores whose restart loses data (their records are not expected to survive)
LOSSY = ("redis", "redis-cluster")
SPEC = "chaos"
#: stores whose lock write is the store's own gate (timed log, not acceptance order)
GATED = ("redis", "redis-cluster", "etcd")
PRESETS: dict[str, dict[str, Any]] = {
    # CI: ~15-25 s per store on a 2-core machine, servers included.
    "short": {"jobs": 120, "workers": 4, "duration": 8.0, "fault_every": 0.25},
    # By command; the README's figures.
    "long": {"jobs": 3000, "workers": 6, "duration": 120.0, "fault_every": 0.5},
}
#: the lock workload: workers contend for ``--resources`` locks (no job count)
LOCK_PRESETS: dict[str, dict[str, Any]] = {
    "short": {"workers": 4, "duration": 6.0, "fault_every": 0.25},
    "long": {"workers": 6, "duration": 180.0, "fault_every": 0.5},
}


# ---- the loopback TCP proxy -------------------------------------------------------------


class Conn:
    """One client connection through a proxy: both sides, the two pumps, and the gate a
    partial blackhole closes (data is then held, not forwarded and not dropped)."""

    def __init__(self, down: asyncio.StreamWriter, up: asyncio.StreamWriter) -> None:
        self.down, self.up = down, up
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.generation = 0  # of the blackhole that closed the gate (only it reopens it)
        self.pumps: list[asyncio.Future[None]] = []

    def abort(self) -> None:
        self.down.transport.abort()
        self.up.transport.abort()
        for p in self.pumps:
            p.cancel()


class Proxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target``. :meth:`ProxyHub.cut`
    aborts every connection through it (both sides see a reset); a blackhole
    (:meth:`ProxyHub.blackhole`) stops forwarding without closing anything, as a dead
    switch or a partition does: bytes sent meanwhile are held and delivered when it
    ends (TCP would retransmit them), new connections are accepted by the kernel and
    then answered by nobody."""

    def __init__(self, target: int, open_: asyncio.Event) -> None:
        self.target = target
        self.port = 0
        self.conns: set[Conn] = set()
        self.open = open_  # the hub's gate: closed during a full blackhole
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, HOST, 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.open.wait()
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(HOST, self.target), 3)
        except (OSError, asyncio.TimeoutError):
            writer.transport.abort()  # the server is down: so is the connection
            return
        conn = Conn(writer, up_w)
        self.conns.add(conn)
        gates = (self.open, conn.flowing)
        conn.pumps = [
            asyncio.ensure_future(_pump(reader, up_w, gates)),
            asyncio.ensure_future(_pump(up_r, writer, gates)),
        ]
        try:
            await asyncio.wait(conn.pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.conns.discard(conn)
            conn.abort()

    def cut(self) -> int:
        conns = list(self.conns)
        self.conns.clear()
        for conn in conns:
            conn.abort()
        return len(conns)


async def _pump(
    src: asyncio.StreamReader, dst: asyncio.StreamWriter, gates: tuple[asyncio.Event, ...]
) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await src.read(65536):
            for gate in gates:
                if not gate.is_set():
                    await gate.wait()
            dst.write(data)
            await dst.drain()


class ProxyHub:
    """One event loop in a thread serving every proxy of a run."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.proxies: list[Proxy] = []
        self.open = asyncio.Event()
        self.open.set()
        self.generation = 0  # of the latest blackhole
        self.full_generation = 0  # of the latest full blackhole (only it reopens the gate)
        self.thread = threading.Thread(target=self.loop.run_forever, name="proxy", daemon=True)
        self.thread.start()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def add(self, target: int) -> Proxy:
        proxy = Proxy(target, self.open)
        self._call(proxy.start())
        self.proxies.append(proxy)
        return proxy

    def cut(self, only: Proxy | None = None) -> int:
        async def cut_all() -> int:
            return sum(p.cut() for p in self.proxies if only is None or p is only)

        return int(self._call(cut_all()))

    def blackhole(
        self, seconds: float, share: float, rng: random.Random, only: Proxy | None = None
    ) -> str:
        """Stop forwarding for ``seconds``: everything (``share`` >= 1: every
        connection, and new ones hang after the kernel's accept) or a random ``share``
        of the open connections (at least one; the rest and new ones keep working, as
        when one path through the network dies); with ``only``, every open connection
        of that proxy (one member cut off). "" if there was nothing to silence."""

        async def go() -> str:
            self.generation += 1
            gen = self.generation
            if share >= 1:
                n = sum(len(p.conns) for p in self.proxies)
                if not n:
                    return ""  # nobody uses this store (plain mode on Redis)
                self.full_generation = gen
                self.open.clear()

                def heal_full() -> None:
                    if self.full_generation == gen:
                        self.open.set()

                self.loop.call_later(seconds, heal_full)
                return f"everything for {seconds:.2f}s ({n} connections)"
            conns = [c for p in self.proxies for c in p.conns if c.flowing.is_set()]
            if not conns or not self.open.is_set():
                return ""  # nothing to silence (or everything is silent already)
            if only is not None:
                chosen = [c for c in conns if c in only.conns]
                if not chosen:
                    return ""
            else:
                chosen = [c for c in conns if rng.random() < share] or conns[:1]
            for c in chosen:
                c.generation = gen
                c.flowing.clear()

            def heal_some() -> None:
                for c in chosen:
                    if c.generation == gen:
                        c.flowing.set()

            self.loop.call_later(seconds, heal_some)
            where = f" of :{only.target}" if only is not None else ""
            return f"{len(chosen)} of {len(conns)} connections{where} for {seconds:.2f}s"

        return str(self._call(go()))

    def heal(self) -> None:
        """End every blackhole now."""

        async def heal_all() -> None:
            self.full_generation = -1
            self.open.set()
            for p in self.proxies:
                for c in p.conns:
                    c.generation = -1
                    c.flowing.set()

        self._call(heal_all())

    def close(self) -> None:
        async def close_all() -> None:
            self.open.set()
            for p in self.proxies:
                p.cut()
                if p.server is not None:
                    p.server.close()

        with contextlib.suppress(Exception):
            self._call(close_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


# ---- the effects database: queue, effects, log ------------------------------------------

PG_SCHEMA = (
    JOBS_PG
    + """
CREATE TABLE IF NOT EXISTS effects (
    job_id integer PRIMARY KEY,
    fence bigint NOT NULL,
    value text NOT NULL,
    worker text NOT NULL
);
CREATE TABLE IF NOT EXISTS effect_log (
    id bigserial PRIMARY KEY,
    job_id integer NOT NULL,
    fence bigint NOT NULL,
    worker text NOT NULL,
    accepted boolean NOT NULL
);
"""
)

SQLITE_SCHEMA = (
    JOBS_SQLITE
    + """
CREATE TABLE IF NOT EXISTS effects (
    job_id INTEGER PRIMARY KEY,
    fence INTEGER NOT NULL,
    value TEXT NOT NULL,
    worker TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS effect_log (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id INTEGER NOT NULL,
    fence INTEGER NOT NULL,
    worker TEXT NOT NULL,
    accepted INTEGER NOT NULL
);
"""
)

LOCK_PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS lock_fence (
    resource text PRIMARY KEY,
    token bigint NOT NULL,                         -- the highest token accepted
    holder text NOT NULL,
    seq integer NOT NULL
);
CREATE TABLE IF NOT EXISTS lock_log (
    id bigserial PRIMARY KEY,                      -- SQL fences: the order of acceptance
    resource text NOT NULL,
    holder text NOT NULL,
    token bigint NOT NULL,
    seq integer NOT NULL,
    t_sent double precision NOT NULL,              -- CLOCK_MONOTONIC, before the write
    t_done double precision,                       -- after its reply (Redis gate only)
    accepted boolean,                              -- NULL: outcome unknown (store error)
    lost boolean NOT NULL,                         -- lease.lost when the write was sent
    remaining double precision NOT NULL            -- lease.remaining() then
);
CREATE TABLE IF NOT EXISTS lock_holds (
    id bigserial PRIMARY KEY,
    resource text NOT NULL,
    holder text NOT NULL,
    token bigint NOT NULL,
    t_before double precision NOT NULL,            -- before hold() was entered
    t_after double precision NOT NULL              -- when its body started
);
"""

LOCK_SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS lock_fence (
    resource TEXT PRIMARY KEY,
    token INTEGER NOT NULL,
    holder TEXT NOT NULL,
    seq INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS lock_log (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    resource TEXT NOT NULL,
    holder TEXT NOT NULL,
    token INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    t_sent REAL NOT NULL,
    t_done REAL,
    accepted INTEGER,
    lost INTEGER NOT NULL,
    remaining REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS lock_holds (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    resource TEXT NOT NULL,
    holder TEXT NOT NULL,
    token INTEGER NOT NULL,
    t_before REAL NOT NULL,
    t_after REAL NOT NULL
);
"""

LOCK_LOG = (
    "INSERT INTO lock_log (resource, holder, token, seq, t_sent, t_done, accepted, lost, "
    "remaining) VALUES ({p}, {p}, {p}, {p}, {p}, {p}, {p}, {p}, {p})"
)
LOCK_HOLD = (
    "INSERT INTO lock_holds (resource, holder, token, t_before, t_after) "
    "VALUES ({p}, {p}, {p}, {p}, {p})"
)
#: SQLite's fenced write (PostgreSQL uses idemlock's own ``fenced_upsert``); without
#: the WHERE, plain mode's unfenced write (the checker's negative control)
LOCK_UPSERT = (
    "INSERT INTO lock_fence AS f (resource, token, holder, seq) VALUES ({p}, {p}, {p}, {p}) "
    "ON CONFLICT (resource) DO UPDATE SET token = excluded.token, holder = excluded.holder, "
    "seq = excluded.seq{where} RETURNING 1"
)
LOCK_FENCED = LOCK_UPSERT.format(p="?", where=" WHERE f.token <= excluded.token")

UPSERT = (
    "INSERT INTO lock_fence AS f (resource, token, holder, seq) VALUES ({p}, {p}, {p}, {p}) "
    "ON CONFLICT (resource) DO UPDATE SET token = excluded.token, holder = excluded.holder, "
    "seq = excluded.seq{where} RETURNING 1"
)
LOCK_FENCED = LOCK_UPSERT.format(p="?", where=" WHERE f.token <= excluded.token")

TAKE = (
    "UPDATE jobs SET worker = {p}, deliveries = deliveries + 1, visible_at = {p} "
    "WHERE id = (SELECT id FROM jobs WHERE state = 'ready' AND visible_at <= {p} "
    "ORDER BY visible_at, id LIMIT 1{lock}) RETURNING id, deliveries"
)
ACK = "UPDATE jobs SET state = 'done' WHERE id = {p} AND state = 'ready'"
NACK = (
    "UPDATE jobs SET visible_at = {p}, worker = NULL "
    "WHERE id = {p} AND worker = {p} AND deliveries = {p} AND state = 'ready'"
)
RELEASE = (
    "UPDATE jobs SET visible_at = {p} WHERE worker = {p} AND state = 'ready' AND visible_at > {p}"
)
BUSY = "SELECT DISTINCT worker FROM jobs WHERE state = 'ready' AND visible_at > {p}"
UPSERT = (
    "INSERT INTO effects AS e (job_id, fence, value, worker) VALUES ({p}, {p}, {p}, {p}) "
    "ON CONFLICT (job_id) DO UPDATE SET fence = excluded.fence, value = excluded.value, "
    "worker = excluded.worker{where} RETURNING 1"
)
FENCED = " WHERE e.fence <= excluded.fence"
LOG = "INSERT INTO effect_log (job_id, fence, worker, accepted) VALUES ({p}, {p}, {p}, {p})"


class FxError(Exception):
    """The effects database failed (connection lost, locked too long, ...)."""


class Fx:
    """The effects database of one run, seen from one process."""

    kind = ""
    p = "?"  # the driver's placeholder
    skip_locked = ""  # how TAKE skips rows other takers hold (SQLite: one writer at a time)

    def __init__(self, dsn: str, supervisor: bool = False) -> None:
        self.dsn = dsn
        #: the supervisor never waits long for a lock a paused worker holds
        self.supervisor = supervisor
        self._conn: Any = None
        # the queue's statements are the fault harness's, shared with `idemlock demo`
        self.sql = statements(self.p, self.skip_locked) | {
            name: text.format(p=self.p, where="{where}")
            for name, text in {
                "upsert": UPSERT,
                "log": LOG,
                "lock_log": LOCK_LOG,
                "lock_hold": LOCK_HOLD,
            }.items()
        }

    # connections: a failed one is dropped and made again on next use
    def connect(self) -> Any:
        raise NotImplementedError

    @property
    def conn(self) -> Any:
        if self._conn is None:
            self._conn = self.connect()
        return self._conn

    def reset(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    @contextlib.contextmanager
    def tx(self) -> Iterator[Any]:
        raise NotImplementedError
        yield

    @contextlib.contextmanager
    def read(self) -> Iterator[Any]:
        """A read-only transaction (never waits for writers)."""
        with self.tx() as c:
            yield c

    def errors(self) -> tuple[type[BaseException], ...]:
        raise NotImplementedError

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Driver errors become FxError and drop the connection."""
        try:
            yield
        except self.errors() as exc:
            self.reset()
            raise FxError(f"{type(exc).__name__}: {exc}") from exc

    # the queue
    def take(self, worker: str, visibility: float) -> tuple[int, int] | None:
        now = time.time()
        with self.guard(), self.tx() as c:
            row = c.execute(self.sql["take"], (worker, now + visibility, now)).fetchone()
        return None if row is None else (int(row[0]), int(row[1]))

    def ack(self, job: int) -> None:
        with self.guard(), self.tx() as c:
            c.execute(self.sql["ack"], (job,))

    def nack(self, job: int, worker: str, delivery: int, until: float) -> None:
        with self.guard(), self.tx() as c:
            c.execute(self.sql["nack"], (until, job, worker, delivery))

    def release(self, worker: str) -> None:
        now = time.time()
        with self.guard(), self.tx() as c:
            c.execute(self.sql["release"], (now, worker, now))

    def busy(self) -> set[str]:
        with self.guard(), self.read() as c:
            return {r[0] for r in c.execute(self.sql["busy"], (time.time(),)).fetchall()}

    def undone(self) -> int:
        with self.guard(), self.read() as c:
            return int(c.execute(self.sql["undone"]).fetchone()[0])

    # the side effect and its log row, in one transaction
    def _write(self, c: Any, job: int, fence: int, value: str, worker: str, fenced: bool) -> bool:
        sql = self.sql["upsert"].format(where=FENCED if fenced else "")
        accepted = c.execute(sql, (job, fence, value, worker)).fetchone() is not None
        c.execute(self.sql["log"], (job, fence, worker, accepted))
        return accepted

    def effect(self, job: int, fence: int, value: str, worker: str, fenced: bool) -> bool:
        """Write the effect (fenced: only over a row with a fence <= ours) and its log
        row; True if the effect was accepted."""
        with self.guard(), self.tx() as c:
            return self._write(c, job, fence, value, worker, fenced)

    # the lock workload
    def lock_hold(self, res: str, holder: str, token: int, before: float, after: float) -> None:
        with self.guard(), self.tx() as c:
            c.execute(self.sql["lock_hold"], (res, holder, token, before, after))

    def lock_log(self, row: tuple[Any, ...]) -> None:
        """One write attempt: (resource, holder, token, seq, t_sent, t_done, accepted,
        lost, remaining)."""
        with self.guard(), self.tx() as c:
            c.execute(self.sql["lock_log"], row)

    def _lock_fence(self, c: Any, res: str, holder: str, token: int, seq: int) -> bool:
        raise NotImplementedError

    def lock_write(
        self,
        res: str,
        holder: str,
        token: int,
        seq: int,
        sent: float,
        lost: bool,
        left: float,
        fenced: bool = True,
    ) -> bool:
        """The fenced write (accepted only over a row with a token <= ours) and its log
        row in one transaction: the log's ids give the order of acceptance."""
        with self.guard(), self.tx() as c:
            if fenced:
                ok = self._lock_fence(c, res, holder, token, seq)
            else:
                sql = LOCK_UPSERT.format(p=self.p, where="")
                ok = c.execute(sql, (res, token, holder, seq)).fetchone() is not None
            c.execute(self.sql["lock_log"], (res, holder, token, seq, sent, None, ok, lost, left))
            return ok

    def lock_snapshot(self) -> dict[str, Any]:
        with self.guard(), self.read() as c:
            holds = c.execute(
                "SELECT resource, holder, token, t_before, t_after FROM lock_holds ORDER BY id"
            ).fetchall()
            log = c.execute(
                "SELECT id, resource, holder, token, seq, t_sent, t_done, accepted, lost, "
                "remaining FROM lock_log ORDER BY id"
            ).fetchall()
        return {"holds": holds, "log": log}

    # setup and checks (supervisor)
    def create(self, visible: list[float]) -> None:
        raise NotImplementedError

    def lock_create(self) -> None:
        raise NotImplementedError

    def snapshot(self) -> dict[str, Any]:
        with self.guard(), self.read() as c:
            jobs = c.execute("SELECT id, state, deliveries FROM jobs ORDER BY id").fetchall()
            effects = c.execute("SELECT job_id, fence, value FROM effects").fetchall()
            log = c.execute(
                "SELECT id, job_id, fence, worker, accepted FROM effect_log ORDER BY id"
            ).fetchall()
        return {"jobs": jobs, "effects": effects, "log": log}


class SqliteFx(Fx):
    kind = "sqlite"

    def connect(self) -> Any:
        timeout = 0.25 if self.supervisor else 30
        conn = sqlite3.connect(self.dsn, timeout=timeout, isolation_level=None)
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    def errors(self) -> tuple[type[BaseException], ...]:
        return (sqlite3.Error,)

    @contextlib.contextmanager
    def tx(self, begin: str = "BEGIN IMMEDIATE") -> Iterator[Any]:
        c = self.conn
        c.execute(begin)
        try:
            yield c
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                c.execute("ROLLBACK")
            raise
        c.execute("COMMIT")

    @contextlib.contextmanager
    def read(self) -> Iterator[Any]:
        with self.tx("BEGIN") as c:  # deferred: a WAL reader takes no lock
            yield c

    def _lock_fence(self, c: Any, res: str, holder: str, token: int, seq: int) -> bool:
        return c.execute(LOCK_FENCED, (res, token, holder, seq)).fetchone() is not None

    def lock_create(self) -> None:
        c = self.conn
        c.execute("PRAGMA journal_mode=WAL")
        c.executescript(LOCK_SQLITE_SCHEMA)

    def create(self, visible: list[float]) -> None:
        c = self.conn
        c.execute("PRAGMA journal_mode=WAL")
        c.executescript(SQLITE_SCHEMA)
        with self.tx():
            c.executemany(
                self.sql["create"],
                [(i + 1, t) for i, t in enumerate(visible)],
            )


class PgFx(Fx):
    kind = "postgres"
    p = "%s"
    skip_locked = " FOR UPDATE SKIP LOCKED"

    def connect(self) -> Any:
        import psycopg

        options = "-c lock_timeout=250" if self.supervisor else ""
        try:
            return psycopg.connect(self.dsn, autocommit=True, connect_timeout=3, options=options)
        except psycopg.Error as exc:
            raise FxError(f"connect: {exc}") from exc

    def errors(self) -> tuple[type[BaseException], ...]:
        import psycopg

        return (psycopg.Error,)

    @contextlib.contextmanager
    def tx(self) -> Iterator[Any]:
        with self.conn.transaction():
            yield self.conn

    def create(self, visible: list[float]) -> None:
        with self.guard():
            self.conn.execute(PG_SCHEMA)
            with self.tx() as c, c.cursor() as cur:
                cur.executemany(
                    self.sql["create"],
                    [(i + 1, t) for i, t in enumerate(visible)],
                )

    def lock_create(self) -> None:
        with self.guard():
            self.conn.execute(LOCK_PG_SCHEMA)

    def _lock_fence(self, c: Any, res: str, holder: str, token: int, seq: int) -> bool:
        from idemlock import FencedOut
        from idemlock.stores.postgres import fenced_upsert

        values = {"resource": res, "holder": holder, "seq": seq}
        try:
            fenced_upsert(c, "lock_fence", values, ["resource"], token, fence_column="token")
        except FencedOut:
            return False
        return True

    def effect_fenced(self, job: int, fence: int, value: str, worker: str) -> bool:
        """The effect through idemlock's own helper, ``fenced_upsert``."""
        with self.guard(), self.tx() as c:
            return self._fenced(c, job, fence, value, worker)

    def _fenced(self, c: Any, job: int, fence: int, value: str, worker: str) -> bool:
        from idemlock import FencedOut
        from idemlock.stores.postgres import fenced_upsert

        values = {"job_id": job, "value": value, "worker": worker}
        try:
            fenced_upsert(c, "effects", values, ["job_id"], fence, fence_column="fence")
            accepted = True
        except FencedOut:
            accepted = False
        c.execute(self.sql["log"], (job, fence, worker, accepted))
        return accepted

    def effect_and_complete(
        self, job: int, fence: int, value: str, worker: str, finish: Callable[[Any], None]
    ) -> bool:
        """Same-transaction mode: the effect, its log row and ``finish(conn)`` (the
        completion) commit together or not at all. A refused effect commits only its
        log row and skips ``finish``."""
        with self.guard(), self.tx() as c:
            if not self._fenced(c, job, fence, value, worker):
                return False
            finish(c)
            return True


def make_fx(kind: str, dsn: str) -> Fx:
    return SqliteFx(dsn) if kind == "sqlite" else PgFx(dsn)


# ---- a worker process -------------------------------------------------------------------


@dataclass
class WorkerConfig:
    worker: str
    mode: str  # idemlock | plain
    same_tx: bool
    store_url: str
    fx_kind: str
    fx_dsn: str
    lease: float
    visibility: float
    seed: int
    stats: str
    step_ms: tuple[float, float] = (5.0, 25.0)
    workload: str = "jobs"  # jobs | lock
    resources: int = 3  # the lock workload's locks
    state: str = ""  # the lock workload: a byte, 1 while this worker holds a lock


class Stats:
    """Event counts of one worker, one line per event, appended as they happen (a
    killed worker's counts survive it)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def add(self, event: str) -> None:
        os.write(self.fd, event.encode() + b"\n")


def store_options(url: str) -> dict[str, Any]:
    # Small pools: a few worker processes, each with one job at a time.
    return {"max_size": 3, "timeout": 5.0} if url.startswith("postgresql") else {}


def job_key(job: int) -> str:
    return f"job-{job}"


def idempotent_job(coord: Any, lease: float, body: Callable[[int], str]) -> Callable[[int], str]:
    """The job as the workers and the checker wrap it: same spec, key and signature
    (so the same payload fingerprint)."""
    import idemlock

    spec = idemlock.IdempotencySpec(SPEC, ttl=timedelta(hours=2), lease=timedelta(seconds=lease))

    @coord.idempotent(spec, key=job_key)
    def run_job(job: int) -> str:
        return body(job)

    return run_job  # type: ignore[no-any-return]


def worker_main(cfg: WorkerConfig) -> None:
    import idemlock
    from idemlock import (
        Completed,
        FencedOut,
        InFlight,
        InFlightError,
        StaleClaim,
        StoreUnavailable,
    )

    rng = random.Random(f"{cfg.seed}:{cfg.worker}")
    stats = Stats(cfg.stats)
    fx = make_fx(cfg.fx_kind, cfg.fx_dsn)

    def step() -> None:
        time.sleep(rng.uniform(*cfg.step_ms) / 1000)

    def value_of(job: int, fence: int) -> str:
        return f"job-{job}/fence-{fence}/{cfg.worker}"

    coord: Any = None
    port: Any = None
    ran: list[int] = []
    if cfg.mode == "idemlock":
        coord = idemlock.connect(cfg.store_url, **store_options(cfg.store_url))
        spec = idemlock.IdempotencySpec(
            SPEC, ttl=timedelta(hours=2), lease=timedelta(seconds=cfg.lease)
        )
        port = coord.idempotency(spec)

    def body(job: int) -> str:
        claim = idemlock.current_claim()
        assert claim is not None
        ran.append(job)
        step()
        value = value_of(job, claim.fence)
        if isinstance(fx, PgFx):
            accepted = fx.effect_fenced(job, claim.fence, value, cfg.worker)
        else:
            accepted = fx.effect(job, claim.fence, value, cfg.worker, fenced=True)
        if not accepted:
            raise FencedOut(f"effects/{job}", claim.fence, None)
        step()  # the rest of the handler: the window between the effect and complete
        return value

    run_job = idempotent_job(coord, cfg.lease, body) if coord is not None else None

    def same_tx(job: int) -> str:
        assert isinstance(fx, PgFx)
        from idemlock.stores.postgres import complete_in_transaction

        claim = port.claim(job_key(job), payload={"job": job})
        if isinstance(claim, Completed):
            return "replayed"
        if isinstance(claim, InFlight):
            raise InFlightError(job_key(job), claim.expires_at)
        token = claim.token
        ran.append(job)
        try:
            step()
            value = value_of(job, token.fence)

            def finish(conn: Any) -> None:
                step()  # the window: inside the transaction here
                complete_in_transaction(conn, port, token, value)

            if not fx.effect_and_complete(job, token.fence, value, cfg.worker, finish):
                raise FencedOut(f"effects/{job}", token.fence, None)
        except BaseException:
            with contextlib.suppress(Exception):
                port.abandon(token)
            raise
        return "ran"

    def plain(job: int, delivery: int) -> None:
        ran.append(job)
        step()
        fx.effect(job, delivery, f"job-{job}/delivery-{delivery}/{cfg.worker}", cfg.worker, False)
        step()

    idle = 0.0
    while True:
        try:
            got = fx.take(cfg.worker, cfg.visibility)
        except FxError:
            stats.add("fx_error")
            time.sleep(0.05)
            continue
        if got is None:
            idle = min(0.02, idle + 0.002)
            time.sleep(idle)
            continue
        idle = 0.0
        job, delivery = got
        ran.clear()
        retry_at: float | None = None
        try:
            if cfg.mode == "plain":
                plain(job, delivery)
            elif cfg.same_tx:
                same_tx(job)
            else:
                assert run_job is not None
                run_job(job)
            stats.add("ran" if ran else "replayed")
        except InFlightError as exc:
            stats.add("in_flight")
            until = exc.expires_at.timestamp() if exc.expires_at else time.time() + cfg.lease
            retry_at = until + 0.01
        except FencedOut:
            stats.add("fenced_out")
            retry_at = time.time() + 0.05
        except StaleClaim:
            stats.add("stale_complete")
            retry_at = time.time()
        except StoreUnavailable as exc:
            stats.add("store_error")
            print(f"{time.time():.3f} job {job}: store error: {exc}", file=sys.stderr, flush=True)
            retry_at = time.time() + 0.05
        except FxError:
            stats.add("fx_error")
            retry_at = time.time() + 0.05
        except Exception as exc:
            # Not a failure a worker expects: report it (the run fails) and go on.
            stats.add(f"unexpected:{type(exc).__module__}.{type(exc).__name__}")
            traceback.print_exc()
            sys.stderr.flush()
            retry_at = time.time() + 0.05
        try:
            if retry_at is None:
                fx.ack(job)
            else:
                fx.nack(job, cfg.worker, delivery, retry_at)
        except FxError:
            stats.add("fx_error")  # the visibility timeout delivers it again


def resource_name(i: int) -> str:
    # The hash tag keeps the gate and the key set_if_fresh writes in one slot on a
    # Redis Cluster (set_if_fresh writes the resource's own name).
    return f"{{res-{i}}}"


def lock_worker_main(cfg: WorkerConfig) -> None:
    """Hold a random resource's lock with renewals for 0.2-2.5 ttls, writing fenced
    records under it, again and again until killed. Each write is logged with the
    holder, its token, a sequence number and the times around it."""
    import idemlock
    from idemlock import FencedOut, LockLost, LockNotAcquired, StoreUnavailable

    rng = random.Random(f"{cfg.seed}:{cfg.worker}")
    stats = Stats(cfg.stats)
    lost_fd = os.open(cfg.stats + ".lost", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    state_fd = os.open(cfg.state, os.O_WRONLY | os.O_CREAT, 0o644)
    fx = make_fx(cfg.fx_kind, cfg.fx_dsn)
    coord = idemlock.connect(cfg.store_url, **store_options(cfg.store_url))
    ttl = cfg.lease
    locks = coord.lock(idemlock.LockSpec(LOCK_SPEC, ttl=timedelta(seconds=ttl)))
    resources = [resource_name(i) for i in range(cfg.resources)]
    # Redis: the write is the store's own gate (set_if_fresh: check the token and SET
    # in one script); SQL stores: a fenced upsert in the effects database.
    # Plain mode: an unfenced upsert in the effects database (the negative control).
    redis = cfg.store_url.startswith("redis") and cfg.mode == "idemlock"
    # etcd: the gate's check_and_advance (one Txn), logged afterwards as Redis's is
    etcd = cfg.store_url.startswith("etcd") and cfg.mode == "idemlock"
    gates = {r: coord.fence(r) for r in resources} if redis or etcd else {}

    def write(res: str, holder: str, lease: Any, seq: int) -> None:
        # What the holder knows when it decides to write; then it prepares the write
        # (a pause there, SIGSTOP or blackhole, is the window only the fence closes).
        sent = time.monotonic()  # before remaining(): a pause in between only shortens it
        left = lease.remaining_seconds()
        lost = bool(lease.lost)
        token = int(lease.token)
        time.sleep(rng.uniform(*cfg.step_ms) / 1000)
        if not gates:
            fenced = cfg.mode == "idemlock"
            ok = fx.lock_write(res, holder, token, seq, sent, lost, left, fenced)
            stats.add("write_accepted" if ok else "write_refused")
            return
        accepted: bool | None
        try:
            if etcd:
                gates[res].check_and_advance(token)
            else:
                gates[res].set_if_fresh(token, res, f"{holder}/{token}/{seq}")
            accepted = True
        except FencedOut:
            accepted = False
        except StoreUnavailable:
            accepted = None  # maybe applied: never counted either way
        done = time.monotonic()
        fx.lock_log((res, holder, token, seq, sent, done, accepted, lost, left))
        stats.add({True: "write_accepted", False: "write_refused", None: "write_unknown"}[accepted])

    n = 0
    while True:
        n += 1
        res = rng.choice(resources)
        holder = f"{cfg.worker}#{n}"

        entered: list[float] = []

        def on_lost(lease: Any, entered: list[float] = entered) -> None:
            # The lease's own deadline (from the last renewal's send), when we were told,
            # and since when we held it: an acquire answered after its own deadline (sent
            # into a silent network) gives a lease that is lost on arrival, and telling
            # then is on time.
            now = time.monotonic()
            deadline = lease._sent + lease._ttl_ms / 1000
            since = entered[0] if entered else now
            os.write(lost_fd, f"{max(deadline, since):.4f} {now:.4f}\n".encode())

        before = time.monotonic()
        try:
            with locks.hold(
                res, wait=3 * ttl, owner=holder, renew_every=ttl / 3, on_lost=on_lost
            ) as lease:
                after = time.monotonic()
                entered.append(after)
                os.pwrite(state_fd, b"1", 0)
                fx.lock_hold(res, holder, int(lease.token), before, after)
                until = after + ttl * rng.uniform(0.2, 2.5)
                seq = 0
                while not lease.lost and time.monotonic() < until:
                    seq += 1
                    write(res, holder, lease, seq)
                os.pwrite(state_fd, b"0", 0)
            stats.add("held")
        except LockLost:
            stats.add("lock_lost")
        except LockNotAcquired:
            stats.add("not_acquired")
        except StoreUnavailable as exc:
            stats.add("store_error")
            print(f"{time.time():.3f} {holder}: store error: {exc}", file=sys.stderr, flush=True)
        except FxError:
            stats.add("fx_error")
        except Exception as exc:
            stats.add(f"unexpected:{type(exc).__module__}.{type(exc).__name__}")
            traceback.print_exc()
            sys.stderr.flush()
        os.pwrite(state_fd, b"0", 0)
        time.sleep(rng.uniform(0, 0.02))


def _worker_entry(raw: dict[str, Any], log: str) -> None:
    redirect(log, append=True)
    raw["step_ms"] = tuple(raw["step_ms"])
    cfg = WorkerConfig(**raw)
    (lock_worker_main if cfg.workload == "lock" else worker_main)(cfg)


#: what the workers' fork server imports once, so a replacement starts in milliseconds
PRELOAD = ["idemlock", "idemlock.stores.postgres", "redis", "psycopg"]


# ---- the supervisor: servers, workers, faults ------------------------------------------


@dataclass
class Options:
    jobs: int
    workers: int
    duration: float
    fault_every: float
    lease: float
    visibility: float
    seed: int
    kinds: tuple[str, ...]
    keep: bool = False
    verbose: bool = False
    resources: int = 3


@dataclass
class Outcome:
    faults: Counter[str] = field(default_factory=Counter)
    #: (worker, from, until) of each SIGSTOP, CLOCK_MONOTONIC
    stops: list[tuple[str, float, float]] = field(default_factory=list)
    worker_exits: list[str] = field(default_factory=list)
    seconds: float = 0.0
    drained: bool = False


class Run:
    """One store, one mode: start, inject, drain, check, tear down."""

    workload = "jobs"

    def __init__(self, store: str, mode: str, same_tx: bool, opts: Options, say: Any) -> None:
        assert not same_tx or (store, mode) == ("postgres", "idemlock")
        self.store, self.mode, self.same_tx, self.opts = store, mode, same_tx, opts
        self.say = say
        applies = LOCK_KINDS if self.workload == "lock" else STORE_KINDS
        self.kinds = tuple(k for k in applies[store] if k in opts.kinds)
        self.rng = random.Random(f"{opts.seed}:{store}:{mode}:{same_tx}:{self.workload}:faults")
        self.root = Path(tempfile.mkdtemp(prefix=f"idemlock-chaos-{store}-"))
        self.hub: ProxyHub | None = None
        self.redis: RedisServer | None = None
        self.cluster: RedisCluster | None = None
        self.pg: PgServer | None = None  # the store's PostgreSQL
        self.fx_pg: PgServer | None = None  # the effects' PostgreSQL (Redis runs)
        self.etcd: Any = None  # tests.servers.etcd.EtcdCluster
        self.etcd_proxies: list[Proxy] = []
        #: (member, until) of the one paused etcd member
        self.member_paused: tuple[int, float] | None = None
        self.etcd_faults: Counter[str] = Counter()
        self.store_url = ""
        self.fx_kind = ""
        self.fx_worker_dsn = ""
        self.fx: Fx | None = None  # the supervisor's own view (never through the proxy)
        self.workers: Workers | None = None
        self.outcome = Outcome()

    @property
    def name(self) -> str:
        return f"{self.store}{' (same transaction)' if self.same_tx else ''}"

    # -- servers ------------------------------------------------------------------------

    def start_servers(self) -> None:
        if self.store != "sqlite":
            self.hub = ProxyHub()
        if self.store == "sqlite":
            self.store_url = f"sqlite:///{self.root / 'idemlock.db'}"
            self.fx_kind, self.fx_worker_dsn = "sqlite", str(self.root / "effects.db")
            self.fx = SqliteFx(self.fx_worker_dsn, supervisor=True)
            return
        assert self.hub is not None
        hub = self.hub
        if self.store == "etcd":
            from tests.servers.etcd import start_etcd

            self.etcd = start_etcd(3)
            self.etcd_proxies = [hub.add(port) for port in self.etcd.client_ports]
            self.store_url = "etcd://" + ",".join(f"{HOST}:{p.port}" for p in self.etcd_proxies)
            self.fx_kind, self.fx_worker_dsn = "sqlite", str(self.root / "effects.db")
            self.fx = SqliteFx(self.fx_worker_dsn, supervisor=True)
            return
        if self.store == "postgres":
            # Crashed by the restarts: every acknowledged commit must come back.
            self.pg = start_postgres({"synchronous_commit": "on"})
            proxy = hub.add(self.pg.port)
            self.store_url = self.pg.dsn_at(proxy.port)
            self.fx_kind, self.fx_worker_dsn = "postgres", self.store_url
            self.fx = PgFx(self.pg.dsn, supervisor=True)
            return
        if self.store == "redis":
            self.redis = start_redis(self.root / "redis")
            self.store_url = f"redis://{HOST}:{hub.add(self.redis.port).port}/0"
        else:
            self.cluster = start_cluster(
                self.root / "cluster", announce=lambda port: hub.add(port).port
            )
            self.store_url = self.cluster.url
        self.fx_pg = start_postgres()
        self.fx_kind, self.fx_worker_dsn = "postgres", self.fx_pg.dsn
        self.fx = PgFx(self.fx_pg.dsn, supervisor=True)

    def restart_store(self) -> str:
        if self.etcd is not None:
            return self.etcd_member_fault()
        if self.redis is not None:
            self.redis.restart()
            return "redis-server restarted empty"
        if self.cluster is not None:
            node = self.rng.choice(self.cluster.nodes)
            node.restart()
            return f"cluster node :{node.port} restarted empty"
        assert self.pg is not None
        self.pg.restart("immediate")
        return "postgres crashed and restarted"

    def etcd_member_fault(self) -> str:
        """A SIGKILL of the leader and its restart, or a pause (SIGSTOP) of a member."""
        cluster = self.etcd
        self.wake_member(force=True)  # one member fault at a time: quorum stays
        if self.rng.random() < 0.5:
            i = self.rng.randrange(cluster.size)
            pause = self.opts.lease * self.rng.uniform(0.5, 3.0)
            os.kill(cluster.procs[i].pid, signal.SIGSTOP)
            self.member_paused = (i, time.monotonic() + pause)
            self.etcd_faults["member_pause"] += 1
            return f"etcd member {cluster.names[i]} paused for {pause:.2f}s"
        leader = cluster.leader()
        cluster.kill(leader)
        cluster.start_member(leader)
        cluster.wait_ready()
        self.etcd_faults["leader_kill"] += 1
        return f"etcd leader {cluster.names[leader]} killed and restarted"

    def wake_member(self, force: bool = False) -> None:
        if self.member_paused is None:
            return
        i, until = self.member_paused
        if force or time.monotonic() >= until:
            proc = self.etcd.procs[i]
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
            self.member_paused = None

    def heal_store(self) -> None:
        """End every network fault and member pause (the fault window is over)."""
        if self.hub is not None:
            self.hub.heal()
        self.wake_member(force=True)

    def stop_servers(self) -> None:
        if self.hub is not None:
            self.hub.close()
        if self.etcd is not None:
            self.etcd.destroy()  # SIGCONTs a paused member, kills all by pid
        for server in (self.redis, self.cluster):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()
        for pg in (self.pg, self.fx_pg):
            if pg is not None:
                pg.destroy()
        if self.fx is not None:
            self.fx.reset()
        if not self.opts.keep:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- workers --------------------------------------------------------------------------

    @property
    def slots(self) -> list[Slot]:
        return self.workers.slots if self.workers is not None else []

    def config(self, slot: Slot) -> dict[str, Any]:
        cfg = WorkerConfig(
            worker=slot.worker,
            mode=self.mode,
            same_tx=self.same_tx,
            store_url=self.store_url,
            fx_kind=self.fx_kind,
            fx_dsn=self.fx_worker_dsn,
            lease=self.opts.lease,
            visibility=self.opts.visibility,
            seed=self.opts.seed,
            stats=str(self.root / "stats" / f"{slot.worker}.txt"),
            workload=self.workload,
            resources=self.opts.resources,
            state=str(self.root / "stats" / f"{slot.worker}.state"),
        )
        return asdict(cfg)

    def start_workers(self) -> Workers:
        (self.root / "stats").mkdir()
        self.workers = Workers(
            context(PRELOAD), _worker_entry, self.config, self.root / "logs", self.opts.workers
        )
        self.workers.start()
        return self.workers

    def candidates(self) -> list[Slot]:
        """Live, running workers that hold a job (a fault on an idle worker tests
        nothing; the fault waits for a busy one). If the queue cannot be read (its
        database is restarting), any live worker."""
        assert self.fx is not None and self.workers is not None
        live = self.workers.live()
        try:
            busy = self.fx.busy()
        except FxError:
            return live
        return [s for s in live if s.worker in busy]

    # -- faults ---------------------------------------------------------------------------

    def inject(self, kind: str) -> bool:
        """Inject one fault of ``kind``; False if there was nothing to do it to."""
        now = time.monotonic()
        detail = ""
        if kind in ("kill", "stop"):
            pool = self.candidates()
            if kind == "stop":
                stopped = sum(1 for s in self.slots if s.stopped_until is not None)
                if stopped >= len(self.slots) - 1:
                    return False
            if not pool:
                return False
            slot = self.rng.choice(pool)
            assert self.workers is not None
            if kind == "kill":
                self.workers.kill_and_replace(slot, self.redeliver)
                detail = slot.worker
            else:
                pause = self.opts.lease * self.rng.uniform(1.3, 2.5)
                self.workers.stop(slot, pause)
                # (woken by a poll every few ms: a little later than planned)
                self.outcome.stops.append((slot.worker, now, now + pause + 0.1))
                detail = f"{slot.worker} for {pause:.2f}s"
        elif kind == "restart":
            detail = self.restart_store()
        elif kind == "cut":
            assert self.hub is not None
            only = None
            if self.etcd is not None and self.rng.random() < 0.5:
                only = self.rng.choice(self.etcd_proxies)  # one member's connections
            cut = self.hub.cut(only)
            if not cut:
                return False  # nothing connected (e.g. during a blackhole): not a fault
            detail = f"{cut} connections"
        elif kind == "blackhole":
            assert self.hub is not None
            # Half of them silence everything (a partition of the store), half a random
            # half of the open connections (one path dies; others and new ones work).
            share = 1.0 if self.rng.random() < 0.5 else 0.5
            seconds = self.opts.lease * self.rng.uniform(0.5, 4.0)
            only = None
            if self.etcd is not None and share < 1:
                # etcd: one member cut off (of those the clients use)
                used = [p for p in self.etcd_proxies if p.conns]
                only = self.rng.choice(used) if used else None
            detail = self.hub.blackhole(seconds, share, self.rng, only)
            if not detail:
                return False
        self.outcome.faults[kind] += 1
        if self.opts.verbose:
            took = time.monotonic() - now
            self.say(f"  {time.time():.3f} {kind}: {detail} ({took:.3f}s)")
        return True

    def redeliver(self, worker: str) -> None:
        assert self.fx is not None
        # As a broker does when the consumer's connection drops.
        with contextlib.suppress(FxError):
            self.fx.release(worker)

    def wake_due(self, force: bool = False) -> None:
        self.wake_member(force)
        if self.workers is not None:
            self.workers.wake_due(force)

    def reap(self) -> None:
        """A worker that exited without being killed by us: note it, replace it."""
        for slot in self.slots:
            code = slot.proc.exitcode
            if code is None:
                continue
            tail = slot.log.read_text(errors="replace")[-2000:] if slot.log else ""
            self.outcome.worker_exits.append(f"{slot.worker} exited with {code}: {tail}")
            assert self.workers is not None
            self.workers.spawn(slot)

    def undone(self) -> int | None:
        assert self.fx is not None
        try:
            return self.fx.undone()
        except FxError:
            return None

    def drive(self) -> None:
        opts = self.opts
        assert self.fx is not None
        t0 = time.time() + 0.5
        visible = [t0 + opts.duration * i / opts.jobs for i in range(opts.jobs)]
        self.fx.create(visible)
        if self.mode == "idemlock":
            import idemlock

            # Create the store's schema once, before the workers race to.
            with idemlock.connect(self.store_url, **store_options(self.store_url)) as coord:
                coord.keys()
        workers = self.start_workers()
        start = time.monotonic()
        faults_until = start + 0.5 + opts.duration
        # A restart of Redis deletes every record: they stop for the last quarter of
        # the window, so the keys completed after the last one can be replay-checked.
        lossy_until = start + 0.5 + opts.duration * (0.75 if self.store in LOSSY else 1.0)
        deadline = faults_until + 60 + 10 * opts.lease
        order: list[str] = []
        next_fault = start + 0.5 + self.rng.expovariate(1 / opts.fault_every)
        next_check = start
        try:
            while True:
                now = time.monotonic()
                self.wake_due()
                self.reap()
                if self.kinds and now >= next_fault and now < faults_until:
                    if not order:
                        order = list(self.kinds)
                        self.rng.shuffle(order)
                    if order[0] == "restart" and now >= lossy_until:
                        order.pop(0)  # skipped, not counted: the next kind goes next tick
                        gap = 0.0
                    elif self.inject(order[0]):
                        order.pop(0)
                        gap = self.rng.expovariate(1 / opts.fault_every)
                    elif order[0] in NETWORK_KINDS:
                        # Nothing connected (plain mode never uses Redis): skip this round.
                        order.pop(0)
                        gap = 0.0
                    else:
                        gap = 0.01  # nobody to do it to yet: try again shortly
                    next_fault = time.monotonic() + gap
                if now >= next_check and now >= faults_until:
                    next_check = now + 0.2
                    if self.undone() == 0:
                        self.outcome.drained = True
                        break
                if now > deadline:
                    break
                time.sleep(0.005)
            self.outcome.seconds = time.monotonic() - start
            self.heal_store()
            # Let paused workers wake and finish what they were doing (their late
            # writes are part of the test), then end every worker.
            while any(s.stopped_until is not None for s in self.slots):
                self.wake_due()
                time.sleep(0.01)
            time.sleep(0.5)
            self.reap()
        finally:
            self.wake_member(force=True)
            workers.close()

    # -- checks ---------------------------------------------------------------------------

    def check(self) -> dict[str, Any]:
        assert self.fx is not None
        deadline = time.monotonic() + 30
        while True:  # the store's PostgreSQL may still be recovering from a crash
            try:
                snap = self.fx.snapshot()
                break
            except FxError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        violations: Counter[str] = Counter()
        examples: list[str] = []

        def bad(kind: str, text: str) -> None:
            violations[kind] += 1
            if len(examples) < 10:
                examples.append(f"{kind}: {text}")

        jobs = {int(j): (state, int(d)) for j, state, d in snap["jobs"]}
        effects = {int(j): (int(f), v) for j, f, v in snap["effects"]}
        accepted: dict[int, list[int]] = {}
        refused = 0
        stale_accepted = 0
        for _id, job, fence, _worker, ok in snap["log"]:
            if not ok:
                refused += 1
                continue
            seen = accepted.setdefault(int(job), [])
            if seen and int(fence) < max(seen):
                stale_accepted += 1
                if self.mode == "idemlock":
                    bad("stale_write_accepted", f"job {job}: fence {fence} after {max(seen)}")
            seen.append(int(fence))
        for job, (state, _) in jobs.items():
            if state != "done":
                bad("job_not_done", f"job {job} is {state}")
            if job not in effects:
                bad("missing_effect", f"job {job} has no effect row")
            elif self.mode == "idemlock" and effects[job][0] != max(accepted.get(job, [0])):
                bad(
                    "effect_not_highest",
                    f"job {job}: row fence {effects[job][0]}, log {accepted.get(job)}",
                )
        runs = {job: len(f) for job, f in accepted.items()}
        repeated = sum(n - 1 for n in runs.values() if n > 1)
        if self.same_tx:
            for job, n in runs.items():
                if n != 1:
                    bad("effect_ran_twice", f"job {job}: {n} accepted effects")
        lost = 0
        if self.mode == "idemlock":
            lost = self.check_store(jobs, effects, bad)
        for text in self.outcome.worker_exits:
            bad("worker_crashed", text)
        events = self.events()
        for event, n in events.items():
            if event.startswith("unexpected:"):
                violations["unexpected_error"] += n
                if len(examples) < 10:
                    examples.append(f"unexpected_error: {n} x {event[11:]}")
        if not self.outcome.drained:
            bad("not_drained", f"jobs still undone after {self.outcome.seconds:.0f}s")
        return {
            "store": self.store,
            "mode": self.mode,
            "same_transaction": self.same_tx,
            "seed": self.opts.seed,
            "jobs": len(jobs),
            "workers": self.opts.workers,
            "seconds": round(self.outcome.seconds, 1),
            "lease_s": self.opts.lease,
            "faults": {k: self.outcome.faults.get(k, 0) for k in KINDS},
            "deliveries": sum(d for _, d in jobs.values()),
            "effects_run": sum(runs.values()),
            "repeated_effects": repeated,
            "jobs_with_repeats": sum(1 for n in runs.values() if n > 1),
            "stale_writes_refused": refused,
            "stale_writes_accepted": stale_accepted,
            "records_lost_with_data": lost,
            **({"etcd_faults": dict(self.etcd_faults)} if self.etcd is not None else {}),
            "worker_events": dict(sorted(events.items())),
            "violations": dict(violations),
            "violations_total": sum(violations.values()),
            "examples": examples,
        }

    def check_store(
        self,
        jobs: dict[int, tuple[str, int]],
        effects: dict[int, tuple[int, str]],
        bad: Callable[[str, str], None],
    ) -> int:
        """After a lease: no key claimed; every completed key replays its effect's value
        (the wrapped function is called and must not run)."""
        import idemlock

        time.sleep(self.opts.lease + 0.2)
        lost = 0
        coord = self.connect_checker()
        try:
            spec = idemlock.IdempotencySpec(
                SPEC, ttl=timedelta(hours=2), lease=timedelta(seconds=self.opts.lease)
            )
            port = coord.idempotency(spec)
            records = coord.keys()
            for rec in records:
                if rec.state == "in_flight":
                    bad("left_claimed", f"{rec.key} still in flight after the lease")
            ran: list[int] = []

            def body(job: int) -> str:
                ran.append(job)
                return "ran-in-checker"

            run_job = idempotent_job(coord, self.opts.lease, body)
            for job in jobs:
                status = port.status(job_key(job))
                if status is None:
                    if self.store in LOSSY and self.outcome.faults["restart"]:
                        lost += 1  # the restart deleted it with the rest of the data
                    else:
                        bad("record_missing", f"{job_key(job)} has no record")
                    continue
                if status.state != "completed":
                    bad("left_claimed", f"{job_key(job)} is {status.state}")
                    continue
                got = run_job(job)
                if ran:
                    ran.clear()
                    bad("replay_ran", f"{job_key(job)} ran again instead of replaying")
                elif job in effects and got != effects[job][1]:
                    bad("replay_differs", f"{job_key(job)}: {got!r} != {effects[job][1]!r}")
        finally:
            coord.close()
        return lost

    def connect_checker(self) -> Any:
        import idemlock

        deadline = time.monotonic() + 30
        while True:
            try:
                coord = idemlock.connect(self.store_url, **store_options(self.store_url))
                coord.keys()
                return coord
            except idemlock.StoreUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def events(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        for path in (self.root / "stats").glob("*.txt"):
            counts.update(line for line in path.read_text().splitlines() if line)
        return counts

    def execute(self) -> dict[str, Any]:
        try:
            self.say(f"{self.name}, {self.mode}: starting servers in {self.root}")
            self.start_servers()
            what = (
                f"locks on {self.opts.resources} resources (ttl {self.opts.lease:g}s)"
                if self.workload == "lock"
                else f"{self.opts.jobs} jobs"
            )
            self.say(
                f"{self.name}, {self.workload}, {self.mode}: {what} over "
                f"{self.opts.duration:g}s, {self.opts.workers} workers, faults "
                f"{'/'.join(self.kinds)} every ~{self.opts.fault_every:g}s"
            )
            self.drive()
            report = self.check()
        finally:
            self.stop_servers()
        return report


# ---- the lock workload: supervisor and checker ------------------------------------------


class LockRun(Run):
    """Workers contend for ``--resources`` locks with ``hold()`` (ttl ``--lease``,
    renewed every ttl/3) and write fenced records under them while faults hit; then
    the history is checked (:func:`check_lock_history`)."""

    workload = "lock"

    def holding(self, slot: Slot) -> bool:
        try:
            return (self.root / "stats" / f"{slot.worker}.state").read_bytes()[:1] == b"1"
        except OSError:
            return False

    def candidates(self) -> list[Slot]:
        """Live, running workers inside a ``hold()`` block (a fault on a waiting
        worker tests little)."""
        return [s for s in self.workers.live() if self.holding(s)] if self.workers else []

    def redeliver(self, worker: str) -> None:
        pass  # its lease runs out on its own: that is what is being tested

    def drive(self) -> None:
        import idemlock

        opts = self.opts
        assert self.fx is not None
        self.fx.lock_create()
        # Create the store's schema once, before the workers race to.
        with idemlock.connect(self.store_url, **store_options(self.store_url)) as coord:
            coord.locks()
        workers = self.start_workers()
        start = time.monotonic()
        faults_until = start + 0.5 + opts.duration
        order: list[str] = []
        next_fault = start + 0.5 + self.rng.expovariate(1 / opts.fault_every)
        try:
            while (now := time.monotonic()) < faults_until:
                self.wake_due()
                self.reap()
                if self.kinds and now >= next_fault:
                    if not order:
                        order = list(self.kinds)
                        self.rng.shuffle(order)
                    if self.inject(order[0]):
                        order.pop(0)
                        gap = self.rng.expovariate(1 / opts.fault_every)
                    elif order[0] in NETWORK_KINDS:
                        order.pop(0)  # nothing connected: skipped this round, not counted
                        gap = 0.0
                    else:
                        gap = 0.01  # nobody holds a lock right now: try again shortly
                    next_fault = time.monotonic() + gap
                time.sleep(0.005)
            self.outcome.seconds = time.monotonic() - start
            self.heal_store()
            # Paused holders wake and try their late writes (the fence must refuse
            # them); then the workers are ended wherever they are.
            while any(s.stopped_until is not None for s in self.slots):
                self.wake_due()
                time.sleep(0.01)
            time.sleep(1.0 + opts.lease)
            self.reap()
            self.outcome.drained = True
        finally:
            self.wake_member(force=True)
            workers.close()

    def check(self) -> dict[str, Any]:
        assert self.fx is not None
        deadline = time.monotonic() + 30
        while True:  # the store's PostgreSQL may still be recovering from a crash
            try:
                snap = self.fx.lock_snapshot()
                break
            except FxError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        exact = self.store not in GATED or self.mode == "plain"
        found = check_lock_history(snap["holds"], snap["log"], exact=exact)
        violations: Counter[str] = found.pop("violations")
        examples: list[str] = found.pop("examples")
        unfenced: dict[str, int] = {}
        if self.mode == "plain":
            # Without the fence these are what the run shows, not failures of it.
            for kind in ("stale_write_accepted", "writes_interleaved"):
                unfenced[kind] = violations.pop(kind, 0)
            examples = [e for e in examples if e.split(":")[0] not in unfenced]
        for text in self.outcome.worker_exits:
            violations["worker_crashed"] += 1
            if len(examples) < 10:
                examples.append(f"worker_crashed: {text}")
        events = self.events()
        for event, n in events.items():
            if event.startswith("unexpected:"):
                violations["unexpected_error"] += n
                if len(examples) < 10:
                    examples.append(f"unexpected_error: {n} x {event[11:]}")
        late: list[float] = []  # told how long after the deadline, holder not paused
        paused_late: list[float] = []
        for path in (self.root / "stats").glob("*.lost"):
            worker = path.name.split(".txt")[0]
            for line in path.read_text().splitlines():
                deadline, told = map(float, line.split())
                paused = any(
                    w == worker and start < told and end > deadline
                    for w, start, end in self.outcome.stops
                )
                (paused_late if paused else late).append(told - deadline)
        late.sort()
        paused_late.sort()
        return {
            "workload": "lock",
            "store": self.store,
            "mode": self.mode,
            "same_transaction": False,
            "seed": self.opts.seed,
            "workers": self.opts.workers,
            "resources": self.opts.resources,
            "seconds": round(self.outcome.seconds, 1),
            "ttl_s": self.opts.lease,
            "fence": "none"
            if self.mode == "plain"
            else "sql"
            if exact
            else "check_and_advance"
            if self.store == "etcd"
            else "set_if_fresh",
            **({"etcd_faults": dict(self.etcd_faults)} if self.etcd is not None else {}),
            "unfenced_findings": unfenced,
            "faults": {k: self.outcome.faults.get(k, 0) for k in KINDS},
            **found,
            "leases_lost": events.get("lock_lost", 0),
            "on_lost_calls": len(late) + len(paused_late),
            # How long after the lease's deadline (counted from the renewal's send; or
            # from when hold() returned a lease already past it) on_lost ran, for
            # holders not paused meanwhile (a SIGSTOPped holder is told only when it
            # runs again: those are apart).
            "on_lost_late_s": {
                "count": len(late),
                "median": round(late[len(late) // 2], 3) if late else None,
                "max": round(late[-1], 3) if late else None,
            },
            "on_lost_late_paused_s": {
                "count": len(paused_late),
                "max": round(paused_late[-1], 3) if paused_late else None,
            },
            "worker_events": dict(sorted(events.items())),
            "violations": dict(violations),
            "violations_total": sum(violations.values()),
            "examples": examples,
        }


def check_lock_history(
    holds: list[tuple[Any, ...]], log: list[tuple[Any, ...]], exact: bool
) -> dict[str, Any]:
    """Check a lock workload's history from the data alone.

    ``holds``: (resource, holder, token, t_before, t_after) per ``hold()`` entered;
    ``log``: (id, resource, holder, token, seq, t_sent, t_done, accepted, lost,
    remaining) per write attempt. Times are CLOCK_MONOTONIC (one machine). With
    ``exact``, the ids of accepted writes are their order of acceptance (SQL fence and
    log row in one transaction); otherwise (the Redis gate, logged after its reply) an
    accepted write is only known to have taken effect within [t_sent, t_done], and
    only pairs whose order is certain are judged. Violations:

    * ``stale_write_accepted``: an accepted write's token is lower than one accepted
      before it for the resource;
    * ``writes_interleaved``: accepted writes of holders A and B went A, B, A;
    * ``token_not_increasing`` / ``token_reused``: a hold that began after another
      had been granted got a token that is not higher; two holders got one token;
    * ``lease_overlap``: a holder wrote while ``lease.remaining()`` said its lease
      was good, after another holder had been granted the lock (its ``hold()`` block
      had started): the lease's own promise, fence aside.
    """
    violations: Counter[str] = Counter()
    examples: list[str] = []

    def bad(kind: str, text: str) -> None:
        violations[kind] += 1
        if len(examples) < 10:
            examples.append(f"{kind}: {text}")

    t_zero = min([float(h[3]) for h in holds] + [float(r[5]) for r in log] or [0.0])

    def at(t: float) -> str:
        return f"+{t - t_zero:.3f}s"

    holds_by: dict[str, list[tuple[str, int, float, float]]] = {}
    hold_of: dict[str, tuple[str, int, float, float]] = {}
    for res, holder, token, before, after in holds:
        h = (str(holder), int(token), float(before), float(after))
        holds_by.setdefault(str(res), []).append(h)
        hold_of[h[0]] = h
    logs_by: dict[str, list[tuple[Any, ...]]] = {}
    counts: Counter[str] = Counter()
    for row in log:
        _id, res, holder, token, _seq, _sent, _done, accepted, lost, left = row
        logs_by.setdefault(str(res), []).append(row)
        outcome = "unknown" if accepted is None else "accepted" if accepted else "refused"
        counts[outcome] += 1
        if float(left) <= 0:
            counts["after_deadline"] += 1  # sent unprotected: only the fence stood guard
            if not lost:
                counts["lost_flag_late"] += 1  # remaining() was 0, lease.lost not yet
        h = hold_of.get(str(holder))
        if h is not None and h[1] != int(token):
            bad("token_changed", f"{res}: {holder} held token {h[1]}, wrote with {token}")

    # Tokens: strictly higher for every hold granted after another; never shared.
    for res, hs in holds_by.items():
        owner_of: dict[int, str] = {}
        for holder, token, _, _ in hs:
            other = owner_of.setdefault(token, holder)
            if other != holder:
                bad("token_reused", f"{res}: token {token} went to {other} and {holder}")
        by_after = sorted(hs, key=lambda h: h[3])
        afters = [h[3] for h in by_after]
        best: list[tuple[int, str]] = []
        for h in by_after:
            best.append(max(best[-1], (h[1], h[0])) if best else (h[1], h[0]))
        for holder, token, before, _after in hs:
            i = bisect.bisect_left(afters, before)
            if i and best[i - 1][0] >= token and best[i - 1][1] != holder:
                bad(
                    "token_not_increasing",
                    f"{res}: {holder} entered at {at(before)} and got token {token}, not "
                    f"above token {best[i - 1][0]} of {best[i - 1][1]} granted before",
                )

    # The lease's promise: no write "with time left" once someone else holds the lock.
    for res, hs in holds_by.items():
        by_before = sorted(hs, key=lambda h: h[2])
        befores = [h[2] for h in by_before]
        # suffix minimum of t_after over holds entered later
        first: list[tuple[float, str, int]] = [(float("inf"), "", 0)] * (len(by_before) + 1)
        for i in range(len(by_before) - 1, -1, -1):
            h = by_before[i]
            first[i] = min(first[i + 1], (h[3], h[0], h[1]))
        successor = {h[0]: first[bisect.bisect_right(befores, h[3])] for h in hs}
        for row in logs_by.get(res, []):
            _id, _res, holder, token, _seq, sent, _done, _acc, _lost, left = row
            nxt = successor.get(str(holder))
            if nxt is None or float(left) <= 0 or nxt[1] == holder:
                continue
            if float(sent) > nxt[0] + SLACK:
                bad(
                    "lease_overlap",
                    f"{res}: {holder} (token {token}) wrote at {at(float(sent))} with "
                    f"remaining()={float(left):.3f}s, but {nxt[1]} (token {nxt[2]}) held the "
                    f"lock from {at(nxt[0])}",
                )
                successor.pop(str(holder))  # once per holder

    for res, rows in logs_by.items():
        acc = [r for r in rows if r[7]]
        if exact:
            top: tuple[int, str] | None = None
            current: str | None = None
            finished: set[str] = set()
            for r in sorted(acc, key=lambda r: int(r[0])):
                holder, token = str(r[2]), int(r[3])
                if top is not None and token < top[0]:
                    bad(
                        "stale_write_accepted",
                        f"{res}: {holder} token {token} accepted (log id {r[0]}) after "
                        f"token {top[0]} of {top[1]}",
                    )
                if top is None or token > top[0]:
                    top = (token, holder)
                if holder != current:
                    if holder in finished:
                        bad(
                            "writes_interleaved",
                            f"{res}: {holder} (token {token}) wrote again (log id {r[0]}) "
                            f"after {current} had written",
                        )
                    if current is not None:
                        finished.add(current)
                    current = holder
        timed = [r for r in acc if r[6] is not None]
        if not timed:
            continue
        # Certain order only: Y before X when Y's reply came before X was sent.
        by_done = sorted(timed, key=lambda r: float(r[6]))
        dones = [float(r[6]) for r in by_done]
        high: list[tuple[int, str]] = []
        for r in by_done:
            high.append(max(high[-1], (int(r[3]), str(r[2]))) if high else (int(r[3]), str(r[2])))
        for r in timed:
            i = bisect.bisect_left(dones, float(r[5]))
            if i and high[i - 1][0] > int(r[3]):
                bad(
                    "stale_write_accepted",
                    f"{res}: {r[2]} token {r[3]} accepted (sent {at(float(r[5]))}) after token "
                    f"{high[i - 1][0]} of {high[i - 1][1]} had been",
                )
        by_sent = sorted(timed, key=lambda r: float(r[5]))
        sents = [float(r[5]) for r in by_sent]
        span: dict[str, list[float]] = {}
        for r in timed:
            s = span.setdefault(str(r[2]), [float("inf"), float("-inf")])
            s[0] = min(s[0], float(r[6]))  # its first write surely done
            s[1] = max(s[1], float(r[5]))  # its last write surely not yet sent
        for holder, (lo, hi) in span.items():
            if hi <= lo:
                continue
            for b in by_sent[bisect.bisect_right(sents, lo) : bisect.bisect_left(sents, hi)]:
                if str(b[2]) != holder and float(b[6]) < hi:
                    bad(
                        "writes_interleaved",
                        f"{res}: {b[2]} (token {b[3]}) wrote between {at(float(b[5]))} and "
                        f"{at(float(b[6]))}, after {holder}'s write done at {at(lo)} and "
                        f"before its write sent at {at(hi)}",
                    )
                    break

    return {
        "holds": len(holds),
        "writes": len(log),
        "writes_accepted": counts["accepted"],
        "stale_writes_refused": counts["refused"],
        "writes_unknown": counts["unknown"],
        "writes_after_deadline": counts["after_deadline"],
        "writes_lost_flag_late": counts["lost_flag_late"],
        "violations": violations,
        "examples": examples,
    }


# ---- output -----------------------------------------------------------------------------

COLUMNS = [
    ("store", 24),
    ("mode", 8),
    ("jobs", 5),
    ("kill", 5),
    ("stop", 5),
    ("restart", 7),
    ("cut", 4),
    ("blackhole", 9),
    ("repeated effects", 16),
    ("stale refused", 13),
    ("stale accepted", 14),
    ("viol.", 5),
]


def row_of(r: dict[str, Any]) -> list[str]:
    store = r["store"] + (" (same tx)" if r["same_transaction"] else "")
    f = r["faults"]
    applies = STORE_KINDS[r["store"]]
    return [
        store,
        r["mode"],
        str(r["jobs"]),
        *(str(f[k]) if k in applies else "-" for k in KINDS),
        str(r["repeated_effects"]),
        str(r["stale_writes_refused"]),
        str(r["stale_writes_accepted"]),
        str(r["violations_total"]),
    ]


LOCK_COLUMNS = [
    ("store", 24),
    ("mode", 8),
    ("holds", 6),
    ("writes", 7),
    ("kill", 5),
    ("stop", 5),
    ("restart", 7),
    ("cut", 4),
    ("blackhole", 9),
    ("accepted", 8),
    ("stale refused", 13),
    ("unknown", 7),
    ("leases lost", 11),
    ("viol.", 5),
]


def lock_row_of(r: dict[str, Any]) -> list[str]:
    f = r["faults"]
    applies = LOCK_KINDS[r["store"]]
    return [
        r["store"],
        r["mode"],
        str(r["holds"]),
        str(r["writes"]),
        *(str(f[k]) if k in applies else "-" for k in KINDS),
        str(r["writes_accepted"]),
        str(r["stale_writes_refused"]),
        str(r["writes_unknown"]),
        str(r["leases_lost"]),
        str(r["violations_total"]),
    ]


def _table(columns: list[tuple[str, int]], rows: list[list[str]]) -> list[str]:
    def line(cells: list[str]) -> str:
        return " ".join(
            c.rjust(w) if i > 0 else c.ljust(w)
            for i, (c, (_, w)) in enumerate(zip(cells, columns, strict=True))
        )

    head = line([name for name, _ in columns])
    return [head, "-" * len(head), *(line(cells) for cells in rows)]


def render_locks(reports: list[dict[str, Any]]) -> list[str]:
    lines = ["lock workload:", *_table(LOCK_COLUMNS, [lock_row_of(r) for r in reports]), ""]
    for r in reports:
        ev, late = r["worker_events"], r["on_lost_late_s"]
        lines.append(
            f"{r['store']}, lock, {r['mode']}: {r['seconds']}s, ttl {r['ttl_s']:g}s, "
            f"{r['workers']} workers, "
            f"{r['resources']} resources, fence {r['fence']}; {r['writes_after_deadline']} "
            f"writes sent after the lease's deadline ({r['writes_lost_flag_late']} of them "
            f"before lease.lost turned True); on_lost ran {late['count']} times for running "
            f"holders, after their deadline by median {late['median']}s, max "
            f"{late['max']}s (and {r['on_lost_late_paused_s']['count']} times for "
            f"SIGSTOPped ones, on waking); {ev.get('store_error', 0)} store errors, "
            f"{ev.get('not_acquired', 0)} waits timed out"
        )
        if r["unfenced_findings"]:
            lines.append(f"    without a fence: {r['unfenced_findings']}")
        for text in r["examples"]:
            lines.append(f"    VIOLATION {text[:400]}")
    return lines


def render(reports: list[dict[str, Any]]) -> str:
    locks = [r for r in reports if r.get("workload") == "lock"]
    reports = [r for r in reports if r.get("workload") != "lock"]
    if not reports:
        return "\n".join(render_locks(locks))
    head = " ".join(
        name.rjust(w) if i > 1 else name.ljust(w) for i, (name, w) in enumerate(COLUMNS)
    )
    lines = [head, "-" * len(head)]
    for r in reports:
        cells = row_of(r)
        lines.append(
            " ".join(
                c.rjust(w) if i > 1 else c.ljust(w)
                for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS, strict=True))
            )
        )
    lines.append("")
    for r in reports:
        ev = r["worker_events"]
        extra = (
            f"{r['store']}{' (same tx)' if r['same_transaction'] else ''}, {r['mode']}: "
            f"{r['seconds']}s, {r['deliveries']} deliveries, {r['effects_run']} effects run "
            f"({r['jobs_with_repeats']} jobs more than once)"
        )
        if r["mode"] == "idemlock":
            extra += (
                f", {ev.get('replayed', 0)} replayed, {ev.get('in_flight', 0)} found in flight, "
                f"{ev.get('store_error', 0)} store errors, {ev.get('stale_complete', 0)} stale "
                f"completes, {r['records_lost_with_data']} records lost with Redis data"
            )
        lines.append(extra)
        for text in r["examples"]:
            lines.append(f"    VIOLATION {text[:300]}")
    if locks:
        lines += ["", *render_locks(locks)]
    return "\n".join(lines)


# ---- the command ------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="chaos.py", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    ap.add_argument("--store", choices=STORES)
    ap.add_argument("--all", action="store_true", help="every store (and same-transaction)")
    ap.add_argument(
        "--same-transaction",
        action="store_true",
        help="PostgreSQL: effect, log row and complete commit in one transaction",
    )
    ap.add_argument("--mode", choices=("idemlock", "plain", "both"), default="idemlock")
    ap.add_argument(
        "--workload",
        choices=(*WORKLOADS, "both"),
        default="jobs",
        help="jobs: keyed jobs from an at-least-once queue; lock: hold() with renewals "
        "and fenced writes under the lock (ttl --lease)",
    )
    ap.add_argument("--resources", type=int, default=3, help="lock workload: locks contended")
    ap.add_argument("--short", action="store_true", help="the CI configuration")
    ap.add_argument("--jobs", type=int)
    ap.add_argument("--workers", type=int)
    ap.add_argument("--duration", type=float, help="seconds over which jobs are released")
    ap.add_argument("--fault-every", type=float, help="mean seconds between faults")
    ap.add_argument("--lease", type=float, default=1.0, help="claim lease (s)")
    ap.add_argument("--visibility", type=float, default=1.0, help="queue visibility timeout (s)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="faults to inject (comma list)")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--verbose", action="store_true", help="print every fault as it happens")
    args = ap.parse_args(argv)
    if not args.all and not args.store:
        ap.error("give --store or --all")
    if args.same_transaction and args.store != "postgres":
        ap.error("--same-transaction needs --store postgres")
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds takes a comma list of {', '.join(KINDS)}")
    args.kinds = kinds
    if args.workload == "lock":
        if args.same_transaction:
            ap.error("the lock workload has no --same-transaction")
        preset = LOCK_PRESETS["short" if args.short else "long"]
        for name, value in preset.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    preset = PRESETS["short" if args.short else "long"]
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1_000_000)
    return args


def plan(args: argparse.Namespace) -> list[tuple[str, str, bool, str]]:
    """(store, mode, same transaction, workload) of each run."""
    modes = ("plain", "idemlock") if args.mode == "both" else (args.mode,)
    runs: list[tuple[str, str, bool, str]] = []
    stores = STORES if args.all else (args.store,)
    if args.workload in ("jobs", "both"):
        for store in stores:
            for mode in modes:
                if args.all or not args.same_transaction:
                    runs.append((store, mode, False, "jobs"))
                if (
                    store == "postgres"
                    and mode == "idemlock"
                    and (args.all or args.same_transaction)
                ):
                    runs.append((store, mode, True, "jobs"))
    if args.workload in ("lock", "both"):
        runs += [(store, mode, False, "lock") for store in stores for mode in modes]
    return runs


def _terminate(signum: int, frame: Any) -> None:
    # Leave through the finally blocks: they stop the workers and the servers (a
    # PostgreSQL started by pg_ctl would outlive us otherwise).
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _terminate)
    opts = Options(
        jobs=args.jobs,
        workers=args.workers,
        duration=args.duration,
        fault_every=args.fault_every,
        lease=args.lease,
        visibility=args.visibility,
        seed=args.seed,
        kinds=args.kinds,
        keep=args.keep,
        verbose=args.verbose,
        resources=args.resources,
    )

    def say(text: str) -> None:
        print(text, file=sys.stderr if args.json else sys.stdout, flush=True)

    say(f"chaos: seed {opts.seed}")
    reports = []
    runs = plan(args)
    for store, mode, same_tx, workload in runs:
        kind = LockRun if workload == "lock" else Run
        reports.append(kind(store, mode, same_tx, opts, say).execute())
        if not args.json and len(runs) > 1:
            say(render(reports[-1:]))
    failed = sum(r["violations_total"] for r in reports)
    if args.json:
        print(json.dumps({"seed": opts.seed, "runs": reports, "violations": failed}, indent=2))
    else:
        print()
        print(render(reports))
        print(f"\n{'FAILED' if failed else 'OK'}: {failed} violation(s); seed {opts.seed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
