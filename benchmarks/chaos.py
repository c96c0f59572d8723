"""Fault injection: do effects stay exactly-once-in-effect while everything breaks?

    python benchmarks/chaos.py --store sqlite|redis|redis-cluster|postgres
        [--same-transaction] [--mode idemlock|plain|both]
        [--jobs N --workers W --duration S --seed X --fault-every S --lease S ...]
    python benchmarks/chaos.py --all [--mode both]      # every store (the long run)
    python benchmarks/chaos.py --all --short            # what CI runs
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
  same; PostgreSQL: ``pg_ctl restart -m immediate``, a crash) and a cut of every
  connection through the loopback TCP proxy between the workers and the store.
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

Exits 1 on any violation (plain mode: duplicates and stale overwrites are reported,
not violations; only harness failures fail it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
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
for _p in (str(HERE), str(ROOT / "src")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import _servers  # noqa: E402

HOST = _servers.HOST
STORES = ("sqlite", "redis", "redis-cluster", "postgres")
KINDS = ("kill", "stop", "restart", "cut")
#: which faults apply: SQLite has no server to restart and no connection to cut.
STORE_KINDS = {
    "sqlite": ("kill", "stop"),
    "redis": KINDS,
    "redis-cluster": KINDS,
    "postgres": KINDS,
}
#: stores whose restart loses data (their records are not expected to survive)
LOSSY = ("redis", "redis-cluster")
SPEC = "chaos"
PRESETS: dict[str, dict[str, Any]] = {
    # CI: ~15-25 s per store on a 2-core machine, servers included.
    "short": {"jobs": 120, "workers": 4, "duration": 8.0, "fault_every": 0.25},
    # By command; the README's figures.
    "long": {"jobs": 3000, "workers": 6, "duration": 120.0, "fault_every": 0.5},
}


# ---- the loopback TCP proxy -------------------------------------------------------------


class Proxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target``; :meth:`ProxyHub.cut`
    aborts every connection through it (both sides see a reset)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = 0
        self.pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, HOST, 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(HOST, self.target), 3)
        except (OSError, asyncio.TimeoutError):
            writer.transport.abort()  # the server is down: so is the connection
            return
        pair = (writer, up_w)
        self.pairs.add(pair)
        pumps = [
            asyncio.ensure_future(_pump(reader, up_w)),
            asyncio.ensure_future(_pump(up_r, writer)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for p in pumps:
                p.cancel()
            self.pairs.discard(pair)
            writer.transport.abort()
            up_w.transport.abort()

    def cut(self) -> int:
        pairs = list(self.pairs)
        for a, b in pairs:
            a.transport.abort()
            b.transport.abort()
        return len(pairs)


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()


class ProxyHub:
    """One event loop in a thread serving every proxy of a run."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.proxies: list[Proxy] = []
        self.thread = threading.Thread(target=self.loop.run_forever, name="proxy", daemon=True)
        self.thread.start()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def add(self, target: int) -> Proxy:
        proxy = Proxy(target)
        self._call(proxy.start())
        self.proxies.append(proxy)
        return proxy

    def cut(self) -> int:
        async def cut_all() -> int:
            return sum(p.cut() for p in self.proxies)

        return int(self._call(cut_all()))

    def close(self) -> None:
        async def close_all() -> None:
            for p in self.proxies:
                p.cut()
                if p.server is not None:
                    p.server.close()

        with contextlib.suppress(Exception):
            self._call(close_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


# ---- the effects database: queue, effects, log ------------------------------------------

PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id integer PRIMARY KEY,
    state text NOT NULL DEFAULT 'ready',           -- ready | done
    worker text,
    visible_at double precision NOT NULL,          -- epoch seconds; invisible until then
    deliveries integer NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_ready ON jobs (visible_at) WHERE state = 'ready';
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

SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY,
    state TEXT NOT NULL DEFAULT 'ready',
    worker TEXT,
    visible_at REAL NOT NULL,
    deliveries INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS jobs_ready ON jobs (state, visible_at);
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
        self.sql = {
            name: text.format(p=self.p, lock=self.skip_locked, where="{where}")
            for name, text in {
                "take": TAKE,
                "ack": ACK,
                "nack": NACK,
                "release": RELEASE,
                "busy": BUSY,
                "upsert": UPSERT,
                "log": LOG,
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
            return int(c.execute("SELECT COUNT(*) FROM jobs WHERE state != 'done'").fetchone()[0])

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

    # setup and checks (supervisor)
    def create(self, visible: list[float]) -> None:
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

    def create(self, visible: list[float]) -> None:
        c = self.conn
        c.execute("PRAGMA journal_mode=WAL")
        c.executescript(SQLITE_SCHEMA)
        with self.tx():
            c.executemany(
                "INSERT INTO jobs (id, visible_at) VALUES (?, ?)",
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
                    "INSERT INTO jobs (id, visible_at) VALUES (%s, %s)",
                    [(i + 1, t) for i, t in enumerate(visible)],
                )

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


def _worker_entry(raw: dict[str, Any], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor ends us
    raw["step_ms"] = tuple(raw["step_ms"])
    worker_main(WorkerConfig(**raw))


def _context() -> Any:
    """Workers come from a fork server with the drivers imported, so a replacement
    for a killed worker starts in milliseconds."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["idemlock", "idemlock.stores.postgres", "redis", "psycopg"])
    return ctx


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


@dataclass
class Slot:
    index: int
    incarnation: int = 0
    worker: str = ""
    proc: Any = None
    stopped_until: float | None = None
    log: Path | None = None


@dataclass
class Outcome:
    faults: Counter[str] = field(default_factory=Counter)
    worker_exits: list[str] = field(default_factory=list)
    seconds: float = 0.0
    drained: bool = False


class Run:
    """One store, one mode: start, inject, drain, check, tear down."""

    def __init__(self, store: str, mode: str, same_tx: bool, opts: Options, say: Any) -> None:
        assert not same_tx or (store, mode) == ("postgres", "idemlock")
        self.store, self.mode, self.same_tx, self.opts = store, mode, same_tx, opts
        self.say = say
        self.kinds = tuple(k for k in STORE_KINDS[store] if k in opts.kinds)
        self.rng = random.Random(f"{opts.seed}:{store}:{mode}:{same_tx}:faults")
        self.root = Path(tempfile.mkdtemp(prefix=f"idemlock-chaos-{store}-"))
        self.hub: ProxyHub | None = None
        self.redis: _servers.RedisServer | None = None
        self.cluster: _servers.RedisCluster | None = None
        self.pg: _servers.PgServer | None = None  # the store's PostgreSQL
        self.fx_pg: _servers.PgServer | None = None  # the effects' PostgreSQL (Redis runs)
        self.store_url = ""
        self.fx_kind = ""
        self.fx_worker_dsn = ""
        self.fx: Fx | None = None  # the supervisor's own view (never through the proxy)
        self.slots: list[Slot] = []
        self.ctx: Any = None
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
        if self.store == "postgres":
            # Crashed by the restarts: every acknowledged commit must come back.
            self.pg = _servers.start_postgres({"synchronous_commit": "on"})
            proxy = hub.add(self.pg.port)
            self.store_url = self.pg.dsn_at(proxy.port)
            self.fx_kind, self.fx_worker_dsn = "postgres", self.store_url
            self.fx = PgFx(self.pg.dsn, supervisor=True)
            return
        if self.store == "redis":
            self.redis = _servers.start_redis(self.root / "redis")
            self.store_url = f"redis://{HOST}:{hub.add(self.redis.port).port}/0"
        else:
            self.cluster = _servers.start_cluster(
                self.root / "cluster", announce=lambda port: hub.add(port).port
            )
            self.store_url = self.cluster.url
        self.fx_pg = _servers.start_postgres()
        self.fx_kind, self.fx_worker_dsn = "postgres", self.fx_pg.dsn
        self.fx = PgFx(self.fx_pg.dsn, supervisor=True)

    def restart_store(self) -> str:
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

    def stop_servers(self) -> None:
        if self.hub is not None:
            self.hub.close()
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

    def spawn(self, slot: Slot) -> None:
        slot.incarnation += 1
        slot.worker = f"w{slot.index}.{slot.incarnation}"
        slot.log = self.root / "logs" / f"{slot.worker}.log"
        slot.stopped_until = None
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
        )
        slot.proc = self.ctx.Process(
            target=_worker_entry, args=(asdict(cfg), str(slot.log)), daemon=True
        )
        slot.proc.start()

    def kill(self, slot: Slot) -> None:
        slot.proc.kill()
        slot.proc.join()
        slot.stopped_until = None

    def candidates(self) -> list[Slot]:
        """Live, running workers that hold a job (a fault on an idle worker tests
        nothing; the fault waits for a busy one). If the queue cannot be read (its
        database is restarting), any live worker."""
        live = [s for s in self.slots if s.stopped_until is None and s.proc.is_alive()]
        assert self.fx is not None
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
            if kind == "kill":
                self.kill(slot)
                assert self.fx is not None
                # As a broker does when the consumer's connection drops.
                with contextlib.suppress(FxError):
                    self.fx.release(slot.worker)
                self.spawn(slot)
                detail = slot.worker
            else:
                os.kill(slot.proc.pid, signal.SIGSTOP)
                pause = self.opts.lease * self.rng.uniform(1.3, 2.5)
                slot.stopped_until = now + pause
                detail = f"{slot.worker} for {pause:.2f}s"
        elif kind == "restart":
            detail = self.restart_store()
        elif kind == "cut":
            assert self.hub is not None
            detail = f"{self.hub.cut()} connections"
        self.outcome.faults[kind] += 1
        if self.opts.verbose:
            took = time.monotonic() - now
            self.say(f"  {time.time():.3f} {kind}: {detail} ({took:.3f}s)")
        return True

    def wake_due(self, force: bool = False) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.stopped_until is not None and (force or now >= slot.stopped_until):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(slot.proc.pid, signal.SIGCONT)
                slot.stopped_until = None

    def reap(self) -> None:
        """A worker that exited without being killed by us: note it, replace it."""
        for slot in self.slots:
            code = slot.proc.exitcode
            if code is None:
                continue
            tail = slot.log.read_text(errors="replace")[-2000:] if slot.log else ""
            self.outcome.worker_exits.append(f"{slot.worker} exited with {code}: {tail}")
            self.spawn(slot)

    def undone(self) -> int | None:
        assert self.fx is not None
        try:
            return self.fx.undone()
        except FxError:
            return None

    def drive(self) -> None:
        opts = self.opts
        (self.root / "logs").mkdir()
        (self.root / "stats").mkdir()
        assert self.fx is not None
        t0 = time.time() + 0.5
        visible = [t0 + opts.duration * i / opts.jobs for i in range(opts.jobs)]
        self.fx.create(visible)
        if self.mode == "idemlock":
            import idemlock

            # Create the store's schema once, before the workers race to.
            with idemlock.connect(self.store_url, **store_options(self.store_url)) as coord:
                coord.keys()
        self.ctx = _context()
        self.slots = [Slot(i + 1) for i in range(opts.workers)]
        for slot in self.slots:
            self.spawn(slot)
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
            # Let paused workers wake and finish what they were doing (their late
            # writes are part of the test), then end every worker.
            while any(s.stopped_until is not None for s in self.slots):
                self.wake_due()
                time.sleep(0.01)
            time.sleep(0.5)
            self.reap()
        finally:
            self.wake_due(force=True)
            for slot in self.slots:
                if slot.proc is not None and slot.proc.is_alive():
                    self.kill(slot)

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
            self.say(
                f"{self.name}, {self.mode}: {self.opts.jobs} jobs over {self.opts.duration:g}s, "
                f"{self.opts.workers} workers, faults {'/'.join(self.kinds)} every "
                f"~{self.opts.fault_every:g}s"
            )
            self.drive()
            report = self.check()
        finally:
            self.stop_servers()
        return report


# ---- output -----------------------------------------------------------------------------

COLUMNS = [
    ("store", 24),
    ("mode", 8),
    ("jobs", 5),
    ("kill", 5),
    ("stop", 5),
    ("restart", 7),
    ("cut", 4),
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


def render(reports: list[dict[str, Any]]) -> str:
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
    preset = PRESETS["short" if args.short else "long"]
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1_000_000)
    return args


def plan(args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    modes = ("plain", "idemlock") if args.mode == "both" else (args.mode,)
    runs: list[tuple[str, str, bool]] = []
    for store in STORES if args.all else (args.store,):
        for mode in modes:
            if args.all or not args.same_transaction:
                runs.append((store, mode, False))
            if store == "postgres" and mode == "idemlock" and (args.all or args.same_transaction):
                runs.append((store, mode, True))
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
    )

    def say(text: str) -> None:
        print(text, file=sys.stderr if args.json else sys.stdout, flush=True)

    say(f"chaos: seed {opts.seed}")
    reports = []
    runs = plan(args)
    for store, mode, same_tx in runs:
        reports.append(Run(store, mode, same_tx, opts, say).execute())
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
