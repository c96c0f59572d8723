"""One command, one run: every benchmark scenario on every store, next to the peers.

    python benchmarks/report.py [--quick] [--out docs/benchmarks.md]
                                [--json docs/benchmarks.json] [--png docs/benchmarks.png]

Starts its own throwaway servers (redis-server, a three-master Redis Cluster and
PostgreSQL, as the test fixtures in tests/servers/ do) and measures, on the memory,
SQLite, Redis, Redis Cluster and PostgreSQL stores:

* uncontended: acquire+release and claim+complete per second, sync, one thread;
* asyncio: the same with 1 task and with 100 concurrent tasks;
* contended hand-off: 4 processes (threads, for the in-process memory store) on one
  lock, each holding it ~1 ms: critical sections per second, the share of
  acquisitions that go to a contender that was already waiting (hand-offs), the median
  gap from a release to the next acquisition, and the worst wait;
* the idempotent job end to end: our claim (with its fence) + a fenced write +
  complete, next to the same crash-safe job built from each peer's pieces, with the
  round trips of one job counted (not assumed) and jobs per second.

Every figure is a ratio against a baseline measured in the same run: the raw driver
doing the same work in the same number of round trips (``BASELINES`` says which for
each store). Throughput subjects run interleaved round by round (baseline, idemlock,
peers, baseline, ...) and each ratio is the median of the per-round ratios, so drift
of a busy machine moves every side alike. The peers (redis-py ``Lock``,
``python-redis-lock``, ``fencekit``, ``idemkit``, AWS Lambda Powertools' idempotency
utility) are optional imports: a missing one is reported as "not installed".

Writes a JSON of every result, a Markdown report with the machine, the tables of
ratios and a chart (PNG, matplotlib). ``--quick`` is a reduced configuration for CI.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import importlib.metadata
import importlib.util
import json
import math
import multiprocessing as mp
import os
import platform
import selectors
import socket
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _path in (str(ROOT), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import bench_embedded as E  # noqa: E402
import bench_postgres as P  # noqa: E402
import bench_redis as R  # noqa: E402
import psycopg  # noqa: E402
import psycopg_pool  # noqa: E402
import redis  # noqa: E402
import redis.asyncio  # noqa: E402
import redis.asyncio.cluster  # noqa: E402
import redis.cluster  # noqa: E402

import idemlock  # noqa: E402
import idemlock.aio  # noqa: E402
from idemlock import Claimed, FencedOut  # noqa: E402
from idemlock.stores.postgres import fenced as PF  # noqa: E402
from idemlock.stores.redis import _common as C  # noqa: E402

# Powertools warns on every call outside Lambda that it cannot tell the time left (no
# Lambda context); its Redis layer's class is marked deprecated in favour of an alias.
warnings.filterwarnings("ignore", message="Couldn't determine the remaining time")
warnings.filterwarnings("ignore", message="RedisCachePersistenceLayer will be removed")


# ---- configuration ---------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    n: int  # pairs per round (sync and asyncio; a multiple of 100 for the 100-task runs)
    rounds: int  # interleaved rounds
    job_n: int  # jobs per round
    seconds: float  # length of each contention run
    count: int  # operations run to count round trips
    scaled: bool  # longer rounds for the in-process stores (SCALE)


FULL = Config(n=1000, rounds=7, job_n=500, seconds=5.0, count=50, scaled=True)
QUICK = Config(n=200, rounds=3, job_n=100, seconds=0.6, count=10, scaled=False)

STORES = ("memory", "sqlite", "redis", "redis-cluster", "postgres")
TITLE = {
    "memory": "memory",
    "sqlite": "SQLite",
    "redis": "Redis",
    "redis-cluster": "Redis Cluster",
    "postgres": "PostgreSQL",
}
UNC, AIO1, AIO100, HAND, JOB = (
    "uncontended",
    "asyncio, 1 task",
    "asyncio, 100 tasks",
    "contended hand-off",
    "idempotent job",
)
LOCK_OP, CLAIM_OP = "acquire+release", "claim+complete"
HAND_OP = "4 contenders, hold ~1 ms"
JOB_OP = "claim + fenced write + complete"
SCENARIOS = [
    (UNC, LOCK_OP),
    (UNC, CLAIM_OP),
    (AIO1, LOCK_OP),
    (AIO1, CLAIM_OP),
    (AIO100, LOCK_OP),
    (AIO100, CLAIM_OP),
    (HAND, HAND_OP),
    (JOB, JOB_OP),
]

BASE, OURS = "baseline", "idemlock"
OURS_AIO, OURS_TX, OURS_W = (
    "idemlock (asyncio)",
    "idemlock (same transaction)",
    "idemlock (write in complete)",
)
RPY, PRL, FK, IK, PT = "redis-py Lock", "python-redis-lock", "fencekit", "idemkit", "Powertools"
SUBJECTS = (BASE, OURS, OURS_AIO, OURS_W, OURS_TX, RPY, PRL, FK, IK, PT)

#: peer -> (distribution, module, what is measured)
PEERS: dict[str, tuple[str, str, str]] = {
    RPY: ("redis", "redis", "redis-py's Lock: SET NX PX, Lua release; sync and asyncio"),
    PRL: ("python-redis-lock", "redis_lock", "Lock with a signal list (BLPOP wake-up); sync"),
    FK: (
        "fencekit",
        "fencekit",
        "DistributedLock with fencing tokens, IdempotencyGuard, FenceGate; sync",
    ),
    IK: (
        "idemkit",
        "idemkit",
        "idempotency backends (Redis, PostgreSQL via asyncpg); asyncio only",
    ),
    PT: (
        "aws-lambda-powertools",
        "aws_lambda_powertools",
        "idempotent_function with the Redis (cache) persistence layer; sync",
    ),
}

BASELINES = {
    "memory": (
        "a dict under a threading.Lock doing the same critical sections (claim: insert; "
        "complete: update; acquire: insert; release: delete; the job adds the same fenced "
        "write); contended: a threading.Lock shared by 4 threads"
    ),
    "sqlite": (
        "raw sqlite3 on a file with the store's schema, WAL + synchronous=NORMAL, the same "
        "number of transactions (BEGIN IMMEDIATE, one statement, COMMIT); asyncio: each "
        "transaction in asyncio.to_thread, as the store runs its calls; contended: a lock "
        "row INSERTed by 4 processes, retried every 1 ms, DELETEd on release"
    ),
    "redis": (
        "raw redis-py (hiredis) calling EVALSHA on idemlock's own scripts with the same "
        "arguments: the same round trips; contended: SET NX PX retried every 1 ms, "
        "compare-and-delete on release"
    ),
    "redis-cluster": (
        "as for Redis, through redis-py's RedisCluster client (3 masters, no replicas)"
    ),
    "postgres": (
        "raw psycopg, prepared statements, autocommit: one comparable statement per round "
        "trip on tables with the same columns and indexes; asyncio, 100 tasks: through a "
        "psycopg_pool of 10 connections (idemlock's default pool size); contended: "
        "pg_advisory_lock / pg_advisory_unlock (the server queues the waiters)"
    ),
}

JOB_DESC = {
    BASE: "the raw driver doing the same 3 round trips",
    OURS: "claim -> fenced write with the claim's fence -> complete",
    OURS_AIO: "as idemlock, on the asyncio API (1 task)",
    OURS_W: "claim -> complete(writes=...): record and write in one script",
    OURS_TX: "claim -> one transaction: fenced upsert + complete_in_transaction",
    FK: "try_begin -> lock acquire -> fenced set -> mark_done -> release",
    RPY: "lock acquire -> GET done -> SET effect -> SET done -> release",
    PRL: "lock acquire -> GET done -> SET effect -> SET done -> release",
    PT: "idempotent_function: SET NX in progress -> SET effect -> SET result",
    IK: "claim -> write -> complete (asyncio, 1 task)",
}
BASE_JOB = {
    "memory": "the same 3 steps on the dict (claim, fenced write, complete)",
    "sqlite": "raw sqlite3: the same 3 transactions (claim, fenced upsert, complete)",
    "redis": "raw EVALSHA of idemlock's claim, fence_set and complete scripts",
    "redis-cluster": "raw EVALSHA of idemlock's claim, fence_set and complete scripts",
    "postgres": "raw psycopg: claim INSERT, fenced upsert, complete UPDATE",
}
JOB_FENCED = {
    BASE: "yes",
    OURS: "yes",
    OURS_AIO: "yes",
    OURS_W: "yes (claim token)",
    OURS_TX: "yes (+ same transaction)",
    FK: "yes",
    RPY: "no",
    PRL: "no",
    PT: "no",
    IK: "no",
}

HAVE = {name: importlib.util.find_spec(mod) is not None for name, (_, mod, _) in PEERS.items()}
HAVE_ASYNCPG = importlib.util.find_spec("asyncpg") is not None

RESULT_BYTES = b"J" + b"x" * 40  # what the raw baselines store as a result
LEASE_MS, TTL_MS = 300_000, 3_600_000

X = "\u00d7"  # the multiplication sign of the ratios
SyncFn = Callable[[int], Any]
Make = Callable[[int, int], Awaitable[None]]  # (task index, pairs) -> coroutine


def role(subject: str) -> str:
    if subject == BASE:
        return "baseline"
    return "idemlock" if subject.startswith(OURS) else "peer"


# ---- results -----------------------------------------------------------------------------


class Results:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.not_run: list[dict[str, str]] = []

    def rates(
        self,
        scenario: str,
        op: str,
        store: str,
        rates: R.Rates,
        unit: str,
        extra: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        base = rates[BASE]
        for name, series in rates.items():
            ratio = statistics.median(a / b for a, b in zip(series, base, strict=True))
            row = {
                "scenario": scenario,
                "operation": op,
                "store": store,
                "subject": name,
                "role": role(name),
                "value": statistics.median(series),
                "unit": unit,
                "ratio": ratio,
                "rounds": len(series),
            }
            row.update((extra or {}).get(name, {}))
            self.rows.append(row)

    def skip(self, where: tuple[str, str, str], subject: str, status: str, why: str) -> None:
        scenario, op, store = where
        self.not_run.append(
            {"scenario": scenario, "operation": op, "store": store, "subject": subject,
             "status": status, "why": why}
        )  # fmt: skip

    def get(self, scenario: str, op: str, store: str, subject: str) -> dict[str, Any] | None:
        for row in self.rows:
            if (row["scenario"], row["operation"], row["store"], row["subject"]) == (
                scenario,
                op,
                store,
                subject,
            ):
                return row
        return None

    def missing(self, scenario: str, op: str, store: str, subject: str) -> str | None:
        for row in self.not_run:
            if (row["scenario"], row["operation"], row["store"], row["subject"]) == (
                scenario,
                op,
                store,
                subject,
            ):
                return row["status"]
        return None


def _why(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= 240 else text[:237] + "..."


def peer(
    res: Results, where: tuple[str, str, str], name: str, build: Callable[[], SyncFn]
) -> SyncFn | None:
    """A peer's measured function, tried once; None (and why, in ``res``) if it cannot run."""
    if name in HAVE and not HAVE[name]:
        res.skip(where, name, "not installed", f"pip install {PEERS[name][0]}")
        return None
    try:
        fn = build()
        fn(2)
    except idemlock.ConfigurationError as exc:
        res.skip(where, name, "not supported", _why(exc))
        return None
    except Exception as exc:
        res.skip(where, name, "failed", _why(exc))
        return None
    return fn


async def apeer(
    res: Results, where: tuple[str, str, str], name: str, build: Callable[[], Awaitable[Make]]
) -> Make | None:
    if name in HAVE and not HAVE[name]:
        res.skip(where, name, "not installed", f"pip install {PEERS[name][0]}")
        return None
    try:
        make = await build()
        await make(0, 2)
    except Exception as exc:
        res.skip(where, name, "failed", _why(exc))
        return None
    return make


def _fail() -> Any:
    raise RuntimeError("lock not acquired")


class PeerFailed(Exception):
    """A peer raised while it was measured: it is dropped, the others measured again."""

    def __init__(self, name: str, cause: BaseException) -> None:
        super().__init__(f"{name}: {_why(cause)}")
        self.name, self.cause = name, cause


def guarded(fns: dict[str, Any]) -> dict[str, Any]:
    """Peers' functions (sync ones taking n, asyncio makes taking (t, n)) raising
    ``PeerFailed`` instead of whatever they raise; idemlock's and the baseline's raise."""
    out = dict(fns)
    for name, fn in fns.items():
        if role(name) != "peer":
            continue
        if asyncio.iscoroutinefunction(fn):

            async def amake(t: int, n: int, fn: Any = fn, name: str = name) -> None:
                try:
                    await fn(t, n)
                except Exception as exc:
                    raise PeerFailed(name, exc) from exc

            out[name] = amake
        else:

            def run(n: int, fn: Any = fn, name: str = name) -> Any:
                try:
                    return fn(n)
                except Exception as exc:
                    raise PeerFailed(name, exc) from exc

            out[name] = run
    return out


def new_prefix(tag: str = "b") -> str:
    return tag + uuid.uuid4().hex[:8]


# ---- counting round trips ----------------------------------------------------------------


@contextlib.contextmanager
def count_redis_requests() -> Iterator[Callable[[], int]]:
    """Requests redis-py writes to its sockets (sync and asyncio): one per command, one
    per pipeline. Counted on the client because the server's INFO commandstats also
    counts every command a Lua script calls, which is no round trip."""
    import redis.asyncio.connection as aconn
    import redis.connection as sconn

    box = [0]
    s_orig = sconn.AbstractConnection.send_packed_command
    a_orig = aconn.AbstractConnection.send_packed_command

    def s_send(self: Any, command: Any, check_health: bool = True) -> Any:
        box[0] += 1
        return s_orig(self, command, check_health)

    async def a_send(self: Any, command: Any, check_health: bool = True) -> Any:
        box[0] += 1
        return await a_orig(self, command, check_health)

    sconn.AbstractConnection.send_packed_command = s_send  # type: ignore[method-assign]
    aconn.AbstractConnection.send_packed_command = a_send  # type: ignore[method-assign]
    try:
        yield lambda: box[0]
    finally:
        sconn.AbstractConnection.send_packed_command = s_orig  # type: ignore[method-assign]
        aconn.AbstractConnection.send_packed_command = a_orig  # type: ignore[method-assign]


@contextlib.contextmanager
def count_sqlite_transactions() -> Iterator[Callable[[], int]]:
    """Transactions run on SQLite connections opened meanwhile (every BEGIN, and every
    statement run outside one, which SQLite runs as a transaction of its own)."""
    real = sqlite3.connect
    box = [0]

    def connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = real(*args, **kwargs)
        inside = [False]

        def trace(sql: str) -> None:
            head = sql.lstrip()[:8].upper()
            if head.startswith("BEGIN"):
                box[0] += 1
                inside[0] = True
            elif head.startswith(("COMMIT", "END", "ROLLBACK")):
                inside[0] = False
            elif not inside[0]:
                box[0] += 1

        conn.set_trace_callback(trace)
        return conn

    sqlite3.connect = connect  # type: ignore[assignment]
    try:
        yield lambda: box[0]
    finally:
        sqlite3.connect = real  # type: ignore[assignment]


class TurnProxy:
    """A loopback TCP relay that counts round trips whatever the driver (psycopg,
    asyncpg): one each time a client sends after the server has answered."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.turns = 0
        self._listen = socket.socket()
        self._listen.bind(("127.0.0.1", 0))
        self._listen.listen(128)
        self.port: int = self._listen.getsockname()[1]
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listen, selectors.EVENT_READ, None)
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="turn-proxy", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            for key, _ in self._sel.select(0.05):
                if key.data is None:
                    self._accept()
                    continue
                sock, (other, side, state) = key.fileobj, key.data
                try:
                    data = sock.recv(65536)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                if not data:
                    self._drop(sock, other)
                    continue
                if side == "c" and state[0] != "c":
                    self.turns += 1
                state[0] = side
                try:
                    other.sendall(data)
                except OSError:
                    self._drop(sock, other)

    def _accept(self) -> None:
        client, _ = self._listen.accept()
        server = socket.create_connection(("127.0.0.1", self.upstream))
        for s in (client, server):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        state = [""]
        self._sel.register(client, selectors.EVENT_READ, (server, "c", state))
        self._sel.register(server, selectors.EVENT_READ, (client, "s", state))

    def _drop(self, *socks: Any) -> None:
        for s in socks:
            with contextlib.suppress(Exception):
                self._sel.unregister(s)
            with contextlib.suppress(Exception):
                s.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=2)
        for key in list(self._sel.get_map().values()):
            self._drop(key.fileobj)
        self._sel.close()


# ---- generic measured functions ------------------------------------------------------------


def aio_lock(coord: idemlock.aio.AsyncCoordinator) -> Make:
    locks = coord.lock(R.LOCK)

    async def make(t: int, count: int) -> None:
        for _ in range(count):
            lease = await locks.acquire(f"k{t}")
            assert lease is not None
            await locks.release(lease)

    return make


def aio_claim(coord: idemlock.aio.AsyncCoordinator) -> Make:
    port = coord.idempotency(R.SPEC)

    async def make(t: int, count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            claim = await port.claim(f"{tag}-{t}-{i}")
            assert isinstance(claim, Claimed)
            await port.complete(claim.token, R.RESULT)

    return make


def ik_claim(backend: Any) -> Make:
    """idemkit's backend claim + complete, the calls its middleware makes per request."""

    async def make(t: int, count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{t}-{i}"
            res = await backend.claim(key, "f" * 64, 1, 300.0)
            await backend.complete(key, res.our_claim_token, 200, {}, b"x" * 40, 3600.0)

    return make


def ik_job(
    backend: Any, write: Callable[[str], Awaitable[Any]]
) -> Callable[[int], Awaitable[None]]:
    async def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            res = await backend.claim(key, "f" * 64, 1, 300.0)
            await write(key)
            await backend.complete(key, res.our_claim_token, 200, {}, b"x" * 40, 3600.0)

    return run


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[int], Awaitable[None]]) -> SyncFn:
    """An asyncio subject measured among sync ones (1 task, its loop kept between calls)."""
    return lambda n: loop.run_until_complete(fn(n))


def new_loop(stack: contextlib.ExitStack) -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    stack.callback(loop.close)
    return loop


# ---- memory --------------------------------------------------------------------------------


class MemoryRaw:
    """The floor of an in-process store: a dict under a lock, the same critical sections."""

    def __init__(self) -> None:
        self.mu = threading.Lock()
        self.claims: dict[str, list[Any]] = {}
        self.locks: dict[str, tuple[str, int, float]] = {}
        self.effects: dict[str, tuple[int, str]] = {}
        self.counter = 0

    def claim(self, key: str, token: str) -> int | None:
        now = time.monotonic()
        with self.mu:
            rec = self.claims.get(key)
            if rec is not None and rec[3] > now:
                return None
            self.counter += 1
            self.claims[key] = ["in_flight", token, self.counter, now + 300.0, None]
            return self.counter

    def complete(self, key: str, token: str, result: bytes) -> bool:
        now = time.monotonic()
        with self.mu:
            rec = self.claims.get(key)
            if rec is None or rec[1] != token or rec[0] != "in_flight":
                return False
            rec[0], rec[3], rec[4] = "completed", now + 3600.0, result
            return True

    def acquire(self, key: str, owner: str) -> int | None:
        now = time.monotonic()
        with self.mu:
            cur = self.locks.get(key)
            if cur is not None and cur[2] > now:
                return None
            self.counter += 1
            self.locks[key] = (owner, self.counter, now + 30.0)
            return self.counter

    def release(self, key: str, owner: str, token: int) -> bool:
        with self.mu:
            cur = self.locks.get(key)
            if cur is None or cur[0] != owner or cur[1] != token:
                return False
            del self.locks[key]
            return True

    def fenced_write(self, key: str, fence: int, value: str) -> None:
        with self.mu:
            cur = self.effects.get(key)
            if cur is not None and cur[0] > fence:
                raise FencedOut(key, fence, cur[0])
            self.effects[key] = (fence, value)

    def claim_pairs(self, count: int, t: int = 0) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key, token = f"{tag}-{t}-{i}", uuid.uuid4().hex
            assert self.claim(key, token) is not None
            assert self.complete(key, token, RESULT_BYTES)

    def lock_pairs(self, count: int, t: int = 0) -> None:
        key = f"k{t}"
        for _ in range(count):
            token = self.acquire(key, "owner")
            assert token is not None
            assert self.release(key, "owner", token)

    def jobs(self, count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key, token = f"{tag}-{i}", uuid.uuid4().hex
            fence = self.claim(key, token)
            assert fence is not None
            self.fenced_write(key, fence, "done")
            assert self.complete(key, token, RESULT_BYTES)

    async def aclaim(self, t: int, count: int) -> None:
        self.claim_pairs(count, t)

    async def alock(self, t: int, count: int) -> None:
        self.lock_pairs(count, t)


def memory_job(coord: idemlock.Coordinator, effects: MemoryRaw) -> SyncFn:
    port = coord.idempotency(R.SPEC)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            claim = port.claim(key)
            assert isinstance(claim, Claimed)
            effects.fenced_write(key, claim.fence, "done")
            port.complete(claim.token, R.RESULT)

    return run


def memory_ajob(coord: idemlock.aio.AsyncCoordinator, effects: MemoryRaw) -> Any:
    port = coord.idempotency(R.SPEC)

    async def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            claim = await port.claim(key)
            assert isinstance(claim, Claimed)
            effects.fenced_write(key, claim.fence, "done")
            await port.complete(claim.token, R.RESULT)

    return run


#: rounds of the in-process stores are longer (their operations take microseconds), so
#: that a scheduler hiccup on a busy machine averages out
SCALE = {"memory": 10, "sqlite": 2, "redis": 1, "redis-cluster": 1, "postgres": 1}


class MemoryBench:
    name = "memory"
    scale = SCALE["memory"]
    trips_unit = "in-process"
    kinds = (BASE, OURS)

    def target(self) -> dict[str, Any]:
        return {}

    counting = None

    def sync_fns(
        self, op: str, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        raw = MemoryRaw()
        coord = idemlock.connect("memory://", key_prefix=new_prefix())
        stack.callback(coord.close)
        if op == LOCK_OP:
            return {BASE: raw.lock_pairs, OURS: R.ours_lock_pairs(coord)}
        return {BASE: raw.claim_pairs, OURS: R.ours_claim_pairs(coord)}

    async def async_fns(
        self, op: str, tasks: int, stack: contextlib.AsyncExitStack, res: Results, where: Any
    ) -> dict[str, Make]:
        raw = MemoryRaw()
        coord = idemlock.aio.connect("memory://", key_prefix=new_prefix())
        stack.push_async_callback(coord.close)
        if op == LOCK_OP:
            return {BASE: raw.alock, OURS: aio_lock(coord)}
        return {BASE: raw.aclaim, OURS: aio_claim(coord)}

    def job_fns(
        self, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        raw = MemoryRaw()
        coord = idemlock.connect("memory://", key_prefix=new_prefix())
        stack.callback(coord.close)
        loop = new_loop(stack)
        acoord = idemlock.aio.connect("memory://", key_prefix=new_prefix())
        stack.callback(lambda: loop.run_until_complete(acoord.close()))
        effects = MemoryRaw()
        return {
            BASE: raw.jobs,
            OURS: memory_job(coord, effects),
            OURS_AIO: on_loop(loop, memory_ajob(acoord, effects)),
        }


# ---- SQLite --------------------------------------------------------------------------------

SQLITE_EFFECTS = (
    "CREATE TABLE IF NOT EXISTS effects "
    "(key TEXT PRIMARY KEY, value TEXT NOT NULL, fence_token INTEGER NOT NULL)"
)
SQLITE_FENCED_UPSERT = (
    "INSERT INTO effects (key, value, fence_token) VALUES (?, ?, ?) ON CONFLICT (key) DO "
    "UPDATE SET value = excluded.value, fence_token = excluded.fence_token "
    "WHERE effects.fence_token <= excluded.fence_token"
)


def sqlite_effects(path: str) -> sqlite3.Cursor:
    """Your own table in the same file, written with a fenced upsert."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(SQLITE_EFFECTS)
    return conn.cursor()


def sqlite_fenced_write(cur: sqlite3.Cursor, key: str, fence: int) -> None:
    if cur.execute(SQLITE_FENCED_UPSERT, (key, "done", fence)).rowcount != 1:
        raise FencedOut(key, fence, None)


def sqlite_raw_job(cur: sqlite3.Cursor, effects: sqlite3.Cursor) -> SyncFn:
    def run(count: int) -> None:
        for i, key in enumerate(E.fresh_keys(count)):
            now = time.time_ns() // 1_000_000
            cur.execute("BEGIN IMMEDIATE")
            cur.execute(E.RAW_INSERT_CLAIM, (E.NS, key, "token", i, now + E.LEASE_MS))
            cur.execute("COMMIT")
            sqlite_fenced_write(effects, key, i)
            cur.execute("BEGIN IMMEDIATE")
            cur.execute(E.RAW_COMPLETE, (E.RESULT, now + E.TTL_MS, E.NS, key))
            cur.execute("COMMIT")

    return run


def sqlite_job(coord: idemlock.Coordinator, effects: sqlite3.Cursor) -> SyncFn:
    port = coord.idempotency(R.SPEC)

    def run(count: int) -> None:
        for key in E.fresh_keys(count):
            claim = port.claim(key)
            assert isinstance(claim, Claimed)
            sqlite_fenced_write(effects, key, claim.fence)
            port.complete(claim.token, R.RESULT)

    return run


def sqlite_ajob(coord: idemlock.aio.AsyncCoordinator, effects: sqlite3.Cursor) -> Any:
    port = coord.idempotency(R.SPEC)

    async def run(count: int) -> None:
        for key in E.fresh_keys(count):
            claim = await port.claim(key)
            assert isinstance(claim, Claimed)
            await asyncio.to_thread(sqlite_fenced_write, effects, key, claim.fence)
            await port.complete(claim.token, R.RESULT)

    return run


class SqliteThreadedRaw:
    """The asyncio baseline: raw sqlite3 transactions, each in asyncio.to_thread (the
    store's async face does the same), one connection per worker thread."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.local = threading.local()

    def _cur(self) -> sqlite3.Cursor:
        cur = getattr(self.local, "cur", None)
        if cur is None:
            cur = self.local.cur = E.open_raw(self.path)
        return cur

    def _txn(self, sql: str, args: tuple[Any, ...]) -> None:
        cur = self._cur()
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(sql, args)
        cur.execute("COMMIT")

    async def aclaim(self, t: int, count: int) -> None:
        for i, key in enumerate(E.fresh_keys(count)):
            now = time.time_ns() // 1_000_000
            args = (E.NS, key, "token", i, now + E.LEASE_MS)
            await asyncio.to_thread(self._txn, E.RAW_INSERT_CLAIM, args)
            args = (E.RESULT, now + E.TTL_MS, E.NS, key)
            await asyncio.to_thread(self._txn, E.RAW_COMPLETE, args)

    async def alock(self, t: int, count: int) -> None:
        key = f"k{t}"
        for i in range(count):
            now = time.time_ns() // 1_000_000
            args = (E.NS, key, "owner", i, now + 30_000)
            await asyncio.to_thread(self._txn, E.RAW_INSERT_LOCK, args)
            await asyncio.to_thread(self._txn, E.RAW_DELETE_LOCK, (E.NS, key))


class SqliteBench:
    name = "sqlite"
    scale = SCALE["sqlite"]
    trips_unit = "transactions"
    kinds = (BASE, OURS)

    def __init__(self, tmp: str) -> None:
        self.tmp = tmp

    def _file(self) -> str:
        return os.path.join(self.tmp, f"{uuid.uuid4().hex[:10]}.db")

    def target(self) -> dict[str, Any]:
        path = self._file()
        return {"path": path, "url": f"sqlite:///{path}"}

    @contextlib.contextmanager
    def counting(self) -> Iterator[tuple[Callable[[], int], dict[str, Any]]]:
        with count_sqlite_transactions() as count:
            yield count, self.target()

    def contention_target(self) -> dict[str, Any]:
        """A file made ready here (schemas, WAL), before 4 processes open it at once."""
        t = self.target()
        E.open_raw(t["path"]).connection.close()
        coord = idemlock.connect(t["url"])
        coord.lock(R.LOCK).release(coord.lock(R.LOCK).acquire("warm") or _fail())
        coord.close()
        return t

    def _coord(self, stack: contextlib.ExitStack) -> idemlock.Coordinator:
        coord = idemlock.connect(f"sqlite:///{self._file()}", key_prefix=new_prefix())
        stack.callback(coord.close)
        return coord

    def _raw(self, stack: contextlib.ExitStack) -> sqlite3.Cursor:
        cur = E.open_raw(self._file())
        stack.callback(cur.connection.close)
        return cur

    def sync_fns(
        self, op: str, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        raw, coord = self._raw(stack), self._coord(stack)
        if op == LOCK_OP:
            return {
                BASE: lambda k: E.raw_acquire_release(raw, k),
                OURS: R.ours_lock_pairs(coord),
            }
        return {BASE: lambda k: E.raw_claim_complete(raw, k), OURS: R.ours_claim_pairs(coord)}

    async def async_fns(
        self, op: str, tasks: int, stack: contextlib.AsyncExitStack, res: Results, where: Any
    ) -> dict[str, Make]:
        raw = SqliteThreadedRaw(self._file())
        coord = idemlock.aio.connect(f"sqlite:///{self._file()}", key_prefix=new_prefix())
        stack.push_async_callback(coord.close)
        if op == LOCK_OP:
            return {BASE: raw.alock, OURS: aio_lock(coord)}
        return {BASE: raw.aclaim, OURS: aio_claim(coord)}

    def job_fns(
        self, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        fns: dict[str, SyncFn] = {}
        path = self._file()
        raw = E.open_raw(path)
        stack.callback(raw.connection.close)
        effects = sqlite_effects(path)
        stack.callback(effects.connection.close)
        fns[BASE] = sqlite_raw_job(raw, effects)
        path = self._file()
        coord = idemlock.connect(f"sqlite:///{path}", key_prefix=new_prefix())
        stack.callback(coord.close)
        effects = sqlite_effects(path)
        stack.callback(effects.connection.close)
        fns[OURS] = sqlite_job(coord, effects)
        path = self._file()
        loop = new_loop(stack)
        acoord = idemlock.aio.connect(f"sqlite:///{path}", key_prefix=new_prefix())
        stack.callback(lambda: loop.run_until_complete(acoord.close()))
        effects = sqlite_effects(path)
        stack.callback(effects.connection.close)
        fns[OURS_AIO] = on_loop(loop, sqlite_ajob(acoord, effects))
        return fns


# ---- Redis and Redis Cluster -----------------------------------------------------------

UNLOCK_LUA = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) "
    "else return 0 end"
)


def redis_client(t: dict[str, Any]) -> Any:
    if t["cluster"]:
        return redis.cluster.RedisCluster(host="127.0.0.1", port=t["ports"][0], **R.CLIENT)
    return redis.Redis(port=t["ports"][0], **R.CLIENT)


def redis_aclient(t: dict[str, Any]) -> Any:
    if t["cluster"]:
        return redis.asyncio.cluster.RedisCluster(host="127.0.0.1", port=t["ports"][0], **R.CLIENT)
    return redis.asyncio.Redis(port=t["ports"][0], **R.CLIENT)


def redis_raw_job(raw: R.Raw) -> SyncFn:
    """idemlock's job issued raw: EVALSHA of its claim, fence_set and complete scripts."""
    r, fp = raw.r, C.pack_id("ab" * 32)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            n, tok = C.names(raw.ns, key), C.pack_id(uuid.uuid4().hex)
            reply = r.evalsha(C.CLAIM.sha, 1, n.claim, fp, tok, LEASE_MS, R.KEEP)
            fence = int(reply[1])
            out = f"out:{key}"
            gate = C.gate_name(raw.ns, out)
            r.evalsha(C.FENCE_SET.sha, 2, gate, out.encode(), str(fence), b"done")
            r.evalsha(C.COMPLETE.sha, 1, n.claim, tok, RESULT_BYTES, TTL_MS,
                      n.claim_channel, C.nonce())  # fmt: skip

    return run


def redis_ajob(coord: idemlock.aio.AsyncCoordinator) -> Any:
    port = coord.idempotency(R.SPEC)

    async def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            claim = await port.claim(key)
            assert isinstance(claim, Claimed)
            await coord.fence(f"out:{key}").set_if_fresh(claim.fence, f"out:{key}", b"done")
            await port.complete(claim.token, R.RESULT)

    return run


def lock_job(r: Any, lock_of: Callable[[str], Any]) -> SyncFn:
    """A job from a lock alone: lock, check a done marker, write, mark done, release."""
    done = json.dumps(R.RESULT)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            lock = lock_of(key)
            assert lock.acquire(blocking=False)
            if r.get(f"done:{key}") is None:
                r.set(f"eff:{key}", "done")
                r.set(f"done:{key}", done, ex=3600)
            lock.release()

    return run


def powertools_fn(r: Any, body: Callable[[str], None]) -> Callable[[str], Any]:
    from aws_lambda_powertools.utilities.idempotency import (
        IdempotencyConfig,
        idempotent_function,
    )
    from aws_lambda_powertools.utilities.idempotency.persistence.cache import (
        CachePersistenceLayer,
    )

    layer = CachePersistenceLayer(client=r)
    config = IdempotencyConfig(expires_after_seconds=3600)

    @idempotent_function(data_keyword_argument="job", persistence_store=layer, config=config)
    def work(job: dict[str, str]) -> dict[str, Any]:
        body(job["key"])
        return R.RESULT

    return lambda key: work(job={"key": key})


def powertools_pairs(r: Any) -> SyncFn:
    work = powertools_fn(r, lambda key: None)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            work(f"{tag}-{i}")

    return run


def powertools_job(r: Any) -> SyncFn:
    work = powertools_fn(r, lambda key: r.set(f"ptout:{key}", "done"))

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            work(f"{tag}-{i}")

    return run


class RedisBench:
    scale = 1
    trips_unit = "requests"
    kinds = (BASE, OURS, RPY, PRL, FK)

    def __init__(self, url: str, ports: list[int], cluster: bool) -> None:
        self.name = "redis-cluster" if cluster else "redis"
        self.url, self.ports, self.cluster = url, ports, cluster
        r = redis_client(self.target())
        R.load_scripts(r)
        assert r.script_load(C.FENCE_SET.text) == C.FENCE_SET.sha
        r.close()

    def target(self) -> dict[str, Any]:
        return {"url": self.url, "ports": self.ports, "cluster": self.cluster}

    @contextlib.contextmanager
    def counting(self) -> Iterator[tuple[Callable[[], int], dict[str, Any]]]:
        with count_redis_requests() as count:
            yield count, self.target()

    def _tag(self, name: str) -> str:
        """A name whose keys share one Cluster slot (a hash tag) on a Cluster."""
        return "{" + name + "}" if self.cluster else name

    def _sync(self, t: dict[str, Any], stack: contextlib.ExitStack) -> tuple[Any, Any]:
        r = redis_client(t)
        stack.callback(r.close)
        coord = idemlock.connect(t["url"], key_prefix=new_prefix())
        stack.callback(coord.close)
        return r, coord

    def sync_fns(
        self, op: str, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        where = (UNC, op, self.name)
        r, coord = self._sync(t, stack)
        raw = R.Raw(r)
        fns: dict[str, SyncFn]
        builds: dict[str, Callable[[], SyncFn]]
        if op == LOCK_OP:
            fns = {BASE: raw.sync_lock_pairs, OURS: R.ours_lock_pairs(coord)}
            builds = {
                RPY: lambda: R.redispy_lock_pairs(r, name=new_prefix("rp")),
                PRL: lambda: R.prl_lock_pairs(
                    r, name=self._tag(new_prefix("prl")), strict=not self.cluster
                ),
                FK: lambda: R.fencekit_lock_pairs(r, prefix=self._tag(new_prefix("fk"))),
            }
        else:
            fns = {BASE: raw.sync_claim_pairs, OURS: R.ours_claim_pairs(coord)}
            builds = {
                FK: lambda: R.fencekit_guard_pairs(r, prefix=self._tag(new_prefix("fk"))),
                PT: lambda: powertools_pairs(r),
            }
        for name, build in builds.items():
            if (fn := peer(res, where, name, build)) is not None:
                fns[name] = fn
        return fns

    async def async_fns(
        self, op: str, tasks: int, stack: contextlib.AsyncExitStack, res: Results, where: Any
    ) -> dict[str, Make]:
        t = self.target()
        ar = redis_aclient(t)
        stack.push_async_callback(ar.aclose)
        if self.cluster:
            await ar.initialize()
        coord = idemlock.aio.connect(t["url"], key_prefix=new_prefix())
        stack.push_async_callback(coord.close)
        raw = R.Raw(ar)
        fns: dict[str, Make]
        if op == LOCK_OP:

            async def raw_lock(t: int, count: int) -> None:
                await raw.async_lock_pairs(count, key=f"k{t}")

            fns = {BASE: raw_lock, OURS: aio_lock(coord)}
            prefix = new_prefix("arp")

            async def build_rpy() -> Make:
                async def make(t: int, count: int) -> None:
                    for _ in range(count):
                        lock = ar.lock(f"{prefix}:{t}", timeout=30)
                        assert await lock.acquire(blocking=False)
                        await lock.release()

                return make

            if (fn := await apeer(res, where, RPY, build_rpy)) is not None:
                fns[RPY] = fn
            return fns

        async def raw_claim(t: int, count: int) -> None:
            await raw.async_claim_pairs(count, tag=f"{uuid.uuid4().hex[:6]}-{t}")

        fns = {BASE: raw_claim, OURS: aio_claim(coord)}

        async def build_ik() -> Make:
            from idemkit.backends.redis import RedisBackend

            client = redis_aclient(t)
            if self.cluster:
                await client.initialize()
            backend = RedisBackend(client, namespace=new_prefix("ik"))
            stack.push_async_callback(backend.aclose)
            return ik_claim(backend)

        if (fn := await apeer(res, where, IK, build_ik)) is not None:
            fns[IK] = fn
        return fns

    def job_fns(
        self, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        where = (JOB, JOB_OP, self.name)
        r, coord = self._sync(t, stack)
        loop = new_loop(stack)
        acoord = idemlock.aio.connect(t["url"], key_prefix=new_prefix())
        stack.callback(lambda: loop.run_until_complete(acoord.close()))
        fns: dict[str, SyncFn] = {
            BASE: redis_raw_job(R.Raw(r)),
            OURS: R.ours_job(coord),
            OURS_AIO: on_loop(loop, redis_ajob(acoord)),
        }

        def build_ik() -> SyncFn:
            from idemkit.backends.redis import RedisBackend

            ar = redis_aclient(t)
            backend = RedisBackend(ar, namespace=new_prefix("ik"))
            stack.callback(lambda: loop.run_until_complete(backend.aclose()))

            async def write(key: str) -> None:
                await ar.set(f"ikout:{key}", "done")

            return on_loop(loop, ik_job(backend, write))

        builds: dict[str, Callable[[], SyncFn]] = {
            OURS_W: lambda: R.ours_job_together(coord),
            FK: lambda: R.fencekit_job(r, prefix=self._tag(new_prefix("fkj"))),
            RPY: lambda: lock_job(r, lambda key: r.lock(f"rpj:{key}", timeout=300)),
            PRL: lambda: lock_job(r, self._prl(r)),
            PT: lambda: powertools_job(r),
            IK: build_ik,
        }
        for name, build in builds.items():
            if (fn := peer(res, where, name, build)) is not None:
                fns[name] = fn
        return fns

    def _prl(self, r: Any) -> Callable[[str], Any]:
        import redis_lock

        return lambda key: redis_lock.Lock(
            r, self._tag(f"prlj:{key}"), expire=300, strict=not self.cluster
        )


# ---- PostgreSQL ------------------------------------------------------------------------------

PG_EFFECTS = (
    "CREATE TABLE IF NOT EXISTS bench_effects "
    '(key text COLLATE "C" PRIMARY KEY, value text NOT NULL, fence_token bigint)'
)
PG_RAW_FENCED_UPSERT = (
    b"INSERT INTO bench_effects AS t (key, value, fence_token) VALUES (%s, %s, %s) "
    b"ON CONFLICT (key) DO UPDATE SET value = excluded.value, "
    b"fence_token = excluded.fence_token "
    b"WHERE t.fence_token IS NULL OR t.fence_token <= excluded.fence_token RETURNING 1"
)
PG_UPSERT = (
    b"INSERT INTO bench_effects (key, value) VALUES (%s, %s) "
    b"ON CONFLICT (key) DO UPDATE SET value = excluded.value"
)


def pg_raw_job(conn: psycopg.Connection[Any]) -> SyncFn:
    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:8]
        for i in range(count):
            key, token = f"{tag}-{i}", uuid.uuid4().hex
            row = conn.execute(
                P.RAW_CLAIM, ("ns", key, token, "fp", P._now_ms() + LEASE_MS), prepare=True
            ).fetchone()
            assert row is not None
            got = conn.execute(PG_RAW_FENCED_UPSERT, (key, "done", row[0]), prepare=True)
            if got.fetchone() is None:
                raise FencedOut(key, row[0], None)
            conn.execute(
                P.RAW_COMPLETE, (b"j1", P._now_ms() + TTL_MS, "ns", key, token), prepare=True
            ).fetchall()

    return run


def pg_job(coord: idemlock.Coordinator, conn: psycopg.Connection[Any], same_tx: bool) -> SyncFn:
    port = coord.idempotency(R.SPEC)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:8]
        for i in range(count):
            key = f"{tag}-{i}"
            claim = port.claim(key)
            assert isinstance(claim, Claimed)
            values = {"key": key, "value": "done"}
            if same_tx:
                with conn.transaction():
                    PF.fenced_upsert(conn, "bench_effects", values, ["key"], claim.fence)
                    PF.complete_in_transaction(conn, port, claim.token, R.RESULT)
            else:
                PF.fenced_upsert(conn, "bench_effects", values, ["key"], claim.fence)
                port.complete(claim.token, R.RESULT)

    return run


def pg_ajob(coord: idemlock.aio.AsyncCoordinator, conn: psycopg.AsyncConnection[Any]) -> Any:
    port = coord.idempotency(R.SPEC)

    async def run(count: int) -> None:
        tag = uuid.uuid4().hex[:8]
        for i in range(count):
            key = f"{tag}-{i}"
            claim = await port.claim(key)
            assert isinstance(claim, Claimed)
            values = {"key": key, "value": "done"}
            await PF.afenced_upsert(conn, "bench_effects", values, ["key"], claim.fence)
            await port.complete(claim.token, R.RESULT)

    return run


class PgPoolRaw:
    """The asyncio baseline for many tasks: raw statements through a pool of the size
    idemlock's own pool has (10), one checkout per statement as the store does."""

    def __init__(self, pool: psycopg_pool.AsyncConnectionPool[Any]) -> None:
        self.pool = pool

    async def _one(self, sql: bytes, args: tuple[Any, ...]) -> Any:
        async with self.pool.connection() as conn:
            cur = await conn.execute(sql, args, prepare=True)
            return await cur.fetchone()

    async def aclaim(self, t: int, count: int) -> None:
        tag = uuid.uuid4().hex[:8]
        for i in range(count):
            key, token = f"{tag}-{t}-{i}", uuid.uuid4().hex
            await self._one(P.RAW_CLAIM, ("ns", key, token, "fp", P._now_ms() + LEASE_MS))
            args = (b"j1", P._now_ms() + TTL_MS, "ns", key, token)
            await self._one(P.RAW_COMPLETE, args)

    async def alock(self, t: int, count: int) -> None:
        owner, key = uuid.uuid4().hex, f"k{t}"
        for _ in range(count):
            now = P._now_ms()
            row = await self._one(P.RAW_ACQUIRE, ("ns", key, owner, now + 30_000, now))
            assert row is not None
            await self._one(P.RAW_RELEASE, ("ns", key, owner, row[0]))


class PgBench:
    name = "postgres"
    scale = 1
    trips_unit = "requests"
    kinds = (BASE, OURS)

    def __init__(self, dsn: str, port: int) -> None:
        self.dsn, self.port = dsn, port
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(P.RAW_SCHEMA.encode())
            conn.execute(PG_EFFECTS.encode())

    def target(self) -> dict[str, Any]:
        return {"dsn": self.dsn, "url": self.dsn}

    @contextlib.contextmanager
    def counting(self) -> Iterator[tuple[Callable[[], int], dict[str, Any]]]:
        proxy = TurnProxy(self.port)
        try:
            dsn = self.dsn.replace(f":{self.port}/", f":{proxy.port}/")
            yield (lambda: proxy.turns), {"dsn": dsn, "url": dsn}
        finally:
            proxy.close()

    def _conn(self, t: dict[str, Any], stack: contextlib.ExitStack) -> psycopg.Connection[Any]:
        conn = psycopg.connect(t["dsn"], autocommit=True)
        stack.callback(conn.close)
        return conn

    def _coord(self, t: dict[str, Any], stack: contextlib.ExitStack) -> idemlock.Coordinator:
        coord = idemlock.connect(t["dsn"], key_prefix=new_prefix())
        stack.callback(coord.close)
        return coord

    def sync_fns(
        self, op: str, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        raw, coord = self._conn(t, stack), self._coord(t, stack)
        if op == LOCK_OP:
            return {BASE: lambda k: P.sync_raw_locks(raw, k), OURS: R.ours_lock_pairs(coord)}
        return {BASE: lambda k: P.sync_raw_claims(raw, k), OURS: R.ours_claim_pairs(coord)}

    async def async_fns(
        self, op: str, tasks: int, stack: contextlib.AsyncExitStack, res: Results, where: Any
    ) -> dict[str, Make]:
        coord = idemlock.aio.connect(self.dsn, key_prefix=new_prefix())
        stack.push_async_callback(coord.close)
        if tasks == 1:
            aconn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
            stack.push_async_callback(aconn.close)

            async def raw_claim(t: int, count: int) -> None:
                await P.async_raw_claims(aconn, count)

            async def raw_lock(t: int, count: int) -> None:
                await P.async_raw_locks(aconn, count)

            base = {LOCK_OP: raw_lock, CLAIM_OP: raw_claim}[op]
        else:
            pool: psycopg_pool.AsyncConnectionPool[Any] = psycopg_pool.AsyncConnectionPool(
                self.dsn, min_size=10, max_size=10, kwargs={"autocommit": True}, open=False
            )
            await pool.open(wait=True)
            stack.push_async_callback(pool.close)
            pr = PgPoolRaw(pool)
            base = {LOCK_OP: pr.alock, CLAIM_OP: pr.aclaim}[op]
        if op == LOCK_OP:
            return {BASE: base, OURS: aio_lock(coord)}
        fns = {BASE: base, OURS: aio_claim(coord)}

        async def build_ik() -> Make:
            if not HAVE_ASYNCPG:
                raise ImportError(
                    "idemkit's PostgreSQL backend needs asyncpg (pip install asyncpg)"
                )
            backend = await P._idemkit(self.dsn, max_size=10)
            stack.push_async_callback(backend.aclose)
            return ik_claim(backend)

        if (fn := await apeer(res, where, IK, build_ik)) is not None:
            fns[IK] = fn
        return fns

    def job_fns(
        self, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        where = (JOB, JOB_OP, self.name)
        coord = self._coord(t, stack)
        loop = new_loop(stack)
        acoord = idemlock.aio.connect(t["dsn"], key_prefix=new_prefix())
        stack.callback(lambda: loop.run_until_complete(acoord.close()))
        aconn = loop.run_until_complete(psycopg.AsyncConnection.connect(t["dsn"], autocommit=True))
        stack.callback(lambda: loop.run_until_complete(aconn.close()))
        fns: dict[str, SyncFn] = {
            BASE: pg_raw_job(self._conn(t, stack)),
            OURS: pg_job(coord, self._conn(t, stack), same_tx=False),
            OURS_TX: pg_job(coord, self._conn(t, stack), same_tx=True),
            OURS_AIO: on_loop(loop, pg_ajob(acoord, aconn)),
        }

        def build_ik() -> SyncFn:
            if not HAVE_ASYNCPG:
                raise ImportError(
                    "idemkit's PostgreSQL backend needs asyncpg (pip install asyncpg)"
                )
            backend = loop.run_until_complete(P._idemkit(t["dsn"], max_size=4))
            stack.callback(lambda: loop.run_until_complete(backend.aclose()))

            async def write(key: str) -> None:
                await aconn.execute(PG_UPSERT, (key, "done"), prepare=True)

            return on_loop(loop, ik_job(backend, write))

        if (fn := peer(res, where, IK, build_ik)) is not None:
            fns[IK] = fn
        return fns


Bench = MemoryBench | SqliteBench | RedisBench | PgBench


# ---- contention ------------------------------------------------------------------------------

_W: dict[str, Any] = {}


def _worker_init(ready: Any, go: Any, start_at: Any) -> None:
    _W.update(ready=ready, go=go, start_at=start_at)
    ready.put(("started", os.getpid()))


def _lock_id(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big", signed=True)


def lock_pair(
    store: str, kind: str, t: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[Any], Any], Callable[[], Any]]:
    """(acquire(key) -> handle, release(handle), close) of one contender."""
    prefix = t["prefix"]
    if kind == OURS:
        coord = idemlock.connect(t["url"], key_prefix=prefix)
        locks = coord.lock(R.LOCK)

        def acquire(key: str) -> Any:
            lease = locks.acquire(key, wait=30)
            if lease is None:
                raise RuntimeError("idemlock: no lease within 30 s")
            return lease

        return acquire, locks.release, coord.close
    if store == "sqlite":
        cur = E.open_raw(t["path"])
        owner = uuid.uuid4().hex

        def acquire_row(key: str) -> Any:
            while True:
                try:
                    now = time.time_ns() // 1_000_000
                    cur.execute(E.RAW_INSERT_LOCK, (E.NS, key, owner, 0, now + 30_000))
                    return key
                except sqlite3.IntegrityError:
                    time.sleep(0.001)

        def release_row(key: str) -> None:
            cur.execute(E.RAW_DELETE_LOCK, (E.NS, key))

        return acquire_row, release_row, cur.connection.close
    if store == "postgres":
        conn = psycopg.connect(t["dsn"], autocommit=True)

        def acquire_adv(key: str) -> Any:
            conn.execute("SELECT pg_advisory_lock(%s)", (_lock_id(prefix + key),))
            return key

        def release_adv(key: str) -> None:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_lock_id(prefix + key),))

        return acquire_adv, release_adv, conn.close
    r = redis_client(t)
    cluster = t["cluster"]
    if kind == BASE:
        unlock = r.register_script(UNLOCK_LUA)

        def acquire_nx(key: str) -> Any:
            name, token = f"{prefix}:raw:{key}", uuid.uuid4().hex
            while not r.set(name, token, nx=True, px=30_000):
                time.sleep(0.001)
            return name, token

        def release_nx(h: Any) -> None:
            unlock(keys=[h[0]], args=[h[1]])

        return acquire_nx, release_nx, r.close
    if kind == RPY:

        def acquire_rpy(key: str) -> Any:
            lock = r.lock(f"{prefix}:{key}", timeout=30)
            assert lock.acquire(blocking=True, blocking_timeout=30)
            return lock

        return acquire_rpy, lambda lock: lock.release(), r.close
    if kind == PRL:
        import redis_lock

        def acquire_prl(key: str) -> Any:
            name = "{" + f"{prefix}:{key}" + "}" if cluster else f"{prefix}:{key}"
            lock = redis_lock.Lock(r, name, expire=30, strict=not cluster)
            assert lock.acquire(blocking=True, timeout=30)
            return lock

        return acquire_prl, lambda lock: lock.release(), r.close
    import fencekit

    dl = fencekit.DistributedLock(r, prefix="{" + prefix + "}" if cluster else prefix)

    def acquire_fk(key: str) -> Any:
        return dl.acquire(key, ttl=timedelta(seconds=30), blocking=True,
                          wait=timedelta(seconds=30))  # fmt: skip

    return acquire_fk, dl.release, r.close


def critical_sections(
    acquire: Callable[[str], Any], release: Callable[[Any], Any], start: float, seconds: float,
    hold: float, pause: float = 0.0,
) -> list[tuple[float, float, float]]:  # fmt: skip
    """Take the lock, hold it, release, again, from ``start`` for ``seconds``:
    (called, acquired, released) of each, on the machine's monotonic clock."""
    while time.monotonic() < start:
        time.sleep(0.0005)
    end, events = start + seconds, []
    while time.monotonic() < end:
        called = time.monotonic()
        held = acquire("hot")
        acquired = time.monotonic()
        time.sleep(hold)
        released = time.monotonic()
        release(held)
        events.append((called, acquired, released))
        if pause:  # off the lock for a moment: the other contender is then always waiting
            time.sleep(pause)
    return events


def _contend(
    store: str, kind: str, t: dict[str, Any], seconds: float, hold: float, pause: float = 0.0
) -> list[tuple[float, float, float]]:
    try:
        acquire, release, close = lock_pair(store, kind, t)
    except BaseException as exc:
        _W["ready"].put(("error", _why(exc)))
        raise
    try:
        try:
            release(acquire(f"warm-{os.getpid()}"))  # connections, scripts, subscriptions
        except BaseException as exc:
            _W["ready"].put(("error", _why(exc)))
            raise
        _W["ready"].put(("ready", os.getpid()))
        if not _W["go"].wait(180):
            raise RuntimeError("no start signal")
        return critical_sections(acquire, release, _W["start_at"].value, seconds, hold, pause)
    finally:
        close()


class Contenders:
    """Four worker processes, started once and reused for every contention run."""

    PROCS = 4

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.ready, self.go, self.start_at = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
        self.pool = ctx.Pool(
            self.PROCS, initializer=_worker_init, initargs=(self.ready, self.go, self.start_at)
        )
        # Wait until every worker has imported everything: starting 4 interpreters
        # takes both cores for a few seconds, which must not fall on a measurement.
        for _ in range(self.PROCS):
            self.ready.get(timeout=120)

    def run(
        self, store: str, kind: str, t: dict[str, Any], seconds: float, hold: float = 0.001,
        procs: int = PROCS, pause: float = 0.0,
    ) -> dict[str, float]:  # fmt: skip
        self.go.clear()
        job = self.pool.starmap_async(
            _contend, [(store, kind, t, seconds, hold, pause)] * procs, chunksize=1
        )
        errors = []
        for _ in range(procs):
            what, detail = self.ready.get(timeout=150)
            if what == "error":
                errors.append(detail)
        self.start_at.value = time.monotonic() + 0.05
        self.go.set()  # also when one failed: the others then finish their run
        per_proc = job.get(timeout=seconds + 150)
        if errors:
            raise RuntimeError(errors[0])
        events = [(c, a, r, i) for i, evs in enumerate(per_proc) for c, a, r in evs]
        return R.summarize(events, seconds)

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


def contend_threads(kind: str, seconds: float, hold: float = 0.001) -> dict[str, float]:
    """The memory store lives in one process: its contenders are 4 threads."""
    close: Callable[[], Any] = lambda: None  # noqa: E731
    if kind == BASE:
        mu = threading.Lock()

        def acquire(key: str) -> Any:
            mu.acquire()

        def release(_: Any) -> None:
            mu.release()
    else:
        coord = idemlock.connect("memory://", key_prefix=new_prefix())
        locks = coord.lock(R.LOCK)
        close = coord.close

        def acquire(key: str) -> Any:
            return locks.acquire(key, wait=30)

        release = locks.release
    start = time.monotonic() + 0.05
    out: list[list[tuple[float, float, float]]] = [[] for _ in range(4)]

    def body(i: int) -> None:
        out[i] = critical_sections(acquire, release, start, seconds, hold)

    threads = [threading.Thread(target=body, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    close()
    return R.summarize([(c, a, r, i) for i, evs in enumerate(out) for c, a, r in evs], seconds)


# ---- running one store -------------------------------------------------------------------------


def count_trips(
    bench: Any,
    build: Callable[[dict[str, Any], contextlib.ExitStack, Results], dict[str, SyncFn]],
    k: int,
) -> dict[str, dict[str, Any]]:
    """Round trips per operation of each subject, counted on fresh clients."""
    if bench.counting is None:
        return {}
    out: dict[str, dict[str, Any]] = {}
    with bench.counting() as (count, t), contextlib.ExitStack() as stack:
        for name, fn in build(t, stack, Results()).items():
            try:
                fn(k)  # connections, scripts, prepared statements, a Cluster's nodes
                before = count()
                fn(k)
            except Exception:
                if role(name) != "peer":
                    raise
                continue  # measured (or reported as failed) by the timed run
            out[name] = {"round_trips": round((count() - before) / k, 2)}
    return out


def run_store(bench: Any, cfg: Config, res: Results, contenders: Contenders) -> None:
    name = bench.name
    scale = bench.scale if cfg.scaled else 1
    n, job_n = cfg.n * scale, cfg.job_n * scale

    def measure(fns: dict[str, SyncFn], count: int, where: tuple[str, str, str]) -> R.Rates:
        fns = guarded(fns)
        while True:
            try:
                return R.interleave(fns, count, cfg.rounds)
            except PeerFailed as exc:
                res.skip(where, exc.name, "failed", _why(exc.cause))
                del fns[exc.name]

    async def ameasure(
        fns: dict[str, Callable[[int], Awaitable[Any]]], where: tuple[str, str, str]
    ) -> R.Rates:
        while True:
            try:
                return await R.ainterleave(fns, n, cfg.rounds)
            except PeerFailed as exc:
                res.skip(where, exc.name, "failed", _why(exc.cause))
                del fns[exc.name]

    for op in (LOCK_OP, CLAIM_OP):
        with contextlib.ExitStack() as stack:
            fns = bench.sync_fns(op, bench.target(), stack, res)
            rates = measure(fns, n, (UNC, op, name))
        trips = count_trips(bench, lambda t, st, r, op=op: bench.sync_fns(op, t, st, r), cfg.count)
        res.rates(UNC, op, name, rates, "pairs/s", trips)
        print(f"  {UNC} {op}: " + ", ".join(
            f"{k} {statistics.median(v):.0f}/s" for k, v in rates.items()))  # fmt: skip

    async def aio() -> None:
        for tasks, scenario in ((1, AIO1), (100, AIO100)):
            for op in (LOCK_OP, CLAIM_OP):
                async with contextlib.AsyncExitStack() as stack:
                    where = (scenario, op, name)
                    makes = guarded(await bench.async_fns(op, tasks, stack, res, where))
                    for key, make in list(makes.items()):
                        # One task first: connections, scripts, a Cluster client's slot
                        # map (redis-py's asyncio RedisCluster drops connections in use if
                        # many tasks trigger its first discovery at once).
                        try:
                            await make(0, 1)
                        except PeerFailed as exc:
                            res.skip(where, exc.name, "failed", _why(exc.cause))
                            del makes[key]
                    fns = {k: R.fan_out(m, tasks) for k, m in makes.items()}
                    rates = await ameasure(fns, where)
                res.rates(scenario, op, name, rates, "pairs/s")
                print(f"  {scenario} {op}: " + ", ".join(
                    f"{k} {statistics.median(v):.0f}/s" for k, v in rates.items()))  # fmt: skip

    asyncio.run(aio())

    with contextlib.ExitStack() as stack:
        fns = bench.job_fns(bench.target(), stack, res)
        rates = measure(fns, job_n, (JOB, JOB_OP, name))
    trips = count_trips(bench, bench.job_fns, cfg.count)
    res.rates(JOB, JOB_OP, name, rates, "jobs/s", trips)
    print(f"  {JOB}: " + ", ".join(
        f"{k} {statistics.median(v):.0f}/s ({trips.get(k, {}).get('round_trips', '-')} trips)"
        for k, v in rates.items()))  # fmt: skip

    where = (HAND, HAND_OP, name)
    base_cs = None
    for kind in bench.kinds:
        if kind in HAVE and not HAVE[kind]:
            res.skip(where, kind, "not installed", f"pip install {PEERS[kind][0]}")
            continue
        try:
            if name == "memory":
                m = contend_threads(kind, cfg.seconds)
            else:
                target = getattr(bench, "contention_target", bench.target)
                t = {**target(), "prefix": new_prefix("ct")}
                m = contenders.run(name, kind, t, cfg.seconds)
        except Exception as exc:
            if kind in (BASE, OURS):
                raise
            res.skip(where, kind, "failed", _why(exc))
            continue
        if kind == BASE:
            base_cs = m["cs_per_s"]
        assert base_cs is not None
        res.rows.append({
            "scenario": HAND, "operation": HAND_OP, "store": name, "subject": kind,
            "role": role(kind), "value": m["cs_per_s"], "unit": "critical sections/s",
            "ratio": m["cs_per_s"] / base_cs, "rounds": 1,
            "handoff_share": m["handoff_share"], "gap_median_ms": m["gap_median_ms"],
            "handoff_gap_median_ms": m["handoff_gap_median_ms"],
            "worst_wait_ms": m["worst_wait_ms"], "count": m["count"],
        })  # fmt: skip
        print(
            f"  {HAND} {kind}: {m['cs_per_s']:.0f} cs/s, hand-offs {m['handoff_share']:.0%}, "
            f"gap median {m['gap_median_ms']:.2f} ms, worst wait {m['worst_wait_ms']:.1f} ms"
        )


# ---- machine, versions -------------------------------------------------------------------------


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def peer_status(res: Results) -> dict[str, dict[str, Any]]:
    out = {}
    for name, (dist, _, what) in PEERS.items():
        ran = sorted({(r["store"]) for r in res.rows if r["subject"] == name}, key=STORES.index)
        failed = [n for n in res.not_run if n["subject"] == name and n["status"] == "failed"]
        if not HAVE[name]:
            status = "not installed"
        elif ran:
            status = "ran"
        else:
            status = "could not run"
        notes = what
        if name == PT and HAVE[name]:
            notes += (
                ". Runs outside Lambda through idempotent_function (no Lambda context): it "
                "then sets no in-progress expiry, so a key whose worker died stays blocked "
                "until the record's whole expiry (1 h by default) instead of a lease; it "
                "issues no fencing token and its completion is an unconditional SET"
            )
        if name == IK and HAVE[name] and not HAVE_ASYNCPG:
            notes += ". Its PostgreSQL backend needs asyncpg, which is not installed"
        out[name] = {
            "distribution": dist,
            "version": version(dist),
            "status": status,
            "stores": ran,
            "failures": [f"{f['store']}, {f['scenario']}: {f['why']}" for f in failed],
            "notes": notes,
        }
    return out


# ---- report: JSON, Markdown, chart --------------------------------------------------


def fmt_rate(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 1e4:
        return f"{v / 1e3:.1f}k"
    if v >= 100:
        return f"{v:,.0f}"
    return f"{v:.1f}"


def subjects_of(data: dict[str, Any], scenario: str, op: str) -> list[str]:
    seen = {
        r["subject"] for r in data["results"] if (r["scenario"], r["operation"]) == (scenario, op)
    }
    seen |= {
        r["subject"] for r in data["not_run"] if (r["scenario"], r["operation"]) == (scenario, op)
    }
    return [s for s in SUBJECTS if s in seen]


def cell(data: dict[str, Any], scenario: str, op: str, store: str, subject: str) -> str:
    for r in data["results"]:
        if (r["scenario"], r["operation"], r["store"], r["subject"]) == (
            scenario,
            op,
            store,
            subject,
        ):
            text = f"{r['ratio']:.2f}{X} ({fmt_rate(r['value'])}/s)"
            return f"**{text}**" if subject == OURS else text
    for r in data["not_run"]:
        if (r["scenario"], r["operation"], r["store"], r["subject"]) == (
            scenario,
            op,
            store,
            subject,
        ):
            return r["status"]
    return "—"


def throughput_table(data: dict[str, Any], scenarios: list[str]) -> list[str]:
    stores = data["stores"]
    lines = [
        "| scenario | operation | subject | " + " | ".join(TITLE[s] for s in stores) + " |",
        "| --- | --- | --- | " + " | ".join("---:" for _ in stores) + " |",
    ]
    for scenario in scenarios:
        for op in (LOCK_OP, CLAIM_OP):
            for subject in subjects_of(data, scenario, op):
                cells = [cell(data, scenario, op, s, subject) for s in stores]
                lines.append(f"| {scenario} | {op} | {subject} | " + " | ".join(cells) + " |")
    return lines


def trips_table(data: dict[str, Any]) -> list[str]:
    rows = [r for r in data["results"] if r["scenario"] == UNC and r.get("round_trips")]
    stores = [s for s in data["stores"] if any(r["store"] == s for r in rows)]
    lines = [
        "| operation | subject | " + " | ".join(TITLE[s] for s in stores) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in stores) + " |",
    ]
    for op in (LOCK_OP, CLAIM_OP):
        for subject in SUBJECTS:
            got = {r["store"]: r for r in rows if r["operation"] == op and r["subject"] == subject}
            if got:
                cells = [f"{got[s]['round_trips']:g}" if s in got else "—" for s in stores]
                lines.append(f"| {op} | {subject} | " + " | ".join(cells) + " |")
    return lines


def trips_text(r: dict[str, Any]) -> str:
    trips = r.get("round_trips")
    if trips is None:
        return "in-process"
    text = f"{trips:g}"
    return text + (" txn" if r["store"] == "sqlite" else "")


def markdown(data: dict[str, Any], png_name: str | None) -> str:
    m = data["meta"]
    stores = data["stores"]
    cfg = m["config"]
    ls, le = m["load_average_start"], m["load_average_end"]
    out: list[str] = [
        "# idemlock benchmarks",
        "",
        f"Generated by `{m['command']}` on {m['date']} in {m['wall_seconds']:.0f} s "
        f"({'quick' if m['quick'] else 'full'} configuration). One run, on throwaway servers "
        "it started itself, of every scenario on every store and the peers that install "
        "from PyPI.",
        "",
        "**Every figure is a ratio against a baseline measured in the same run**: the raw "
        f"driver doing the same work in the same number of round trips (below). Above 1.00{X} "
        "is faster than the baseline. Throughput subjects run interleaved round by round "
        f"({cfg['rounds']} rounds) and each ratio is the median of the per-round ratios, so "
        "drift on a shared machine moves every side alike; rates in brackets are medians, "
        "for scale only. idemlock's rows are in bold.",
        "",
        "## Machine",
        "",
        "| | |",
        "| --- | --- |",
        f"| CPUs | {m['cpu_count']} {X} {m['cpu_model']} |",
        f"| load average at start (1, 5, 15 min) | {ls[0]:.2f}, {ls[1]:.2f}, {ls[2]:.2f} |",
        f"| load average at end (1, 5, 15 min) | {le[0]:.2f}, {le[1]:.2f}, {le[2]:.2f} "
        "(the run itself keeps both cores busy: client, servers, contention workers) |",
        f"| system | {m['platform']} |",
        f"| Python | {m['python']} |",
        f"| idemlock | {m['versions']['idemlock']} |",
        f"| Redis | redis-server {m['versions']['redis-server']} (standalone; Cluster: 3 masters, "
        "no replicas), no persistence |",
        f"| PostgreSQL | {m['versions']['postgresql']} (fsync, synchronous_commit and "
        "full_page_writes off: the data is thrown away; ratios are what matter) |",
        f"| SQLite | {m['versions']['sqlite']} (WAL, synchronous=NORMAL) |",
        "| drivers | " + ", ".join(
            f"{k} {v}" for k, v in m["versions"].items()
            if k in ("redis-py", "hiredis", "psycopg", "psycopg-pool", "asyncpg") and v
        ) + " |",
        f"| configuration | {cfg['n']} pairs {X} {cfg['rounds']} rounds per subject, "
        f"{cfg['job_n']} jobs per round"
        + (f" (memory {X}{SCALE['memory']}, SQLite {X}{SCALE['sqlite']}: their operations "
           "take microseconds)" if cfg["scaled"] else "")
        + f", contention runs of "
        f"{cfg['seconds']:g} s, round trips counted over {cfg['count']} operations |",
        "",
    ]  # fmt: skip
    if ls[0] > m["cpu_count"] * 0.5:
        out += [
            f"> The machine was busy when the run started (load {ls[0]:.2f} on "
            f"{m['cpu_count']} CPUs): absolute rates are low, ratios still pair rounds.",
            "",
        ]
    out += ["## Peers", "", "| peer | version | status | stores | notes |",
            "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for name, p in data["peers"].items():
        notes = p["notes"] + "".join(f"; failed on {f}" for f in p["failures"])
        stores_text = ", ".join(TITLE[s] for s in p["stores"]) or "—"
        out.append(f"| {name} | {p['version'] or '—'} | {p['status']} | {stores_text} | {notes} |")
    out += ["", "## Baselines", "", f"| store | baseline (1.00{X}) |", "| --- | --- |"]
    out += [f"| {TITLE[s]} | {BASELINES[s]} |" for s in stores]
    out += [""]
    if png_name:
        out += [f"![ratios to the baseline per scenario and store]({png_name})", ""]
    out += [
        "## Uncontended: sync, one thread",
        "",
        "Pairs per second (acquire+release of one key; claim+complete of a new key each "
        "time), as a ratio to the baseline.",
        "",
        *throughput_table(data, [UNC]),
        "",
        "Round trips per pair, counted (SQLite: transactions):",
        "",
        *trips_table(data),
        "",
        "## asyncio: 1 task and 100 concurrent tasks",
        "",
        "The same pairs on the asyncio API, split over 1 task or 100 tasks (each task its "
        "own lock key); the baseline is the raw asyncio driver (SQLite: raw transactions in "
        "asyncio.to_thread; memory: the dict, in a coroutine).",
        "",
        *throughput_table(data, [AIO1, AIO100]),
        "",
        "## Contended hand-off",
        "",
        "4 processes (threads for the memory store) take turns on one lock, each holding it "
        f"~1 ms, for {cfg['seconds']:g} s. Critical sections per second as a ratio to the "
        "baseline; hand-offs = share of acquisitions that went to a contender already "
        "waiting when the lock was released; gap = release to the next acquisition; "
        "worst wait = the longest any contender waited for the lock.",
        "",
        f"| store | subject | critical sections/s | {X} baseline | hand-offs | gap median | "
        "worst wait |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in stores:
        for subject in SUBJECTS:
            r = next((r for r in data["results"] if r["scenario"] == HAND and r["store"] == s
                      and r["subject"] == subject), None)  # fmt: skip
            if r is None:
                miss = next((n for n in data["not_run"] if n["scenario"] == HAND
                             and n["store"] == s and n["subject"] == subject), None)  # fmt: skip
                if miss:
                    out.append(f"| {TITLE[s]} | {subject} | {miss['status']} | | | | |")
                continue
            ratio = f"{r['ratio']:.2f}{X}"
            if subject == OURS:
                ratio = f"**{ratio}**"
            out.append(
                f"| {TITLE[s]} | {subject} | {r['value']:,.0f} | {ratio} | "
                f"{r['handoff_share']:.0%} | {r['gap_median_ms']:.2f} ms | "
                f"{r['worst_wait_ms']:.1f} ms |"
            )
    out += [
        "",
        "redis-py's Lock polls every 0.1 s and fencekit's every 50 ms by default (used as "
        "shipped); python-redis-lock wakes waiters through a signal list; idemlock hands the "
        "lock to the longest waiter by notification (pub/sub on Redis, LISTEN/NOTIFY on "
        "PostgreSQL, a condition in-process; SQLite waiters in other processes poll with a "
        "short jittered backoff).",
        "",
        "## Idempotent job, end to end",
        "",
        "One crash-safe job: claim the key, write the effect guarded by the claim's fence, "
        "record the result. Jobs per second as a ratio to the baseline (the raw driver "
        "issuing the same 3 round trips: claim, fenced write, complete), and the round "
        "trips of one job, counted (Redis: requests written by redis-py; PostgreSQL: "
        "request/response turns through a counting TCP relay, whatever the driver; SQLite: "
        "transactions).",
        "",
        f"| store | subject | the job | fenced | round trips | jobs/s | {X} baseline |",
        "| --- | --- | --- | --- | ---: | ---: | ---: |",
    ]
    for s in stores:
        for subject in SUBJECTS:
            r = next((r for r in data["results"] if r["scenario"] == JOB and r["store"] == s
                      and r["subject"] == subject), None)  # fmt: skip
            if r is None:
                miss = next((n for n in data["not_run"] if n["scenario"] == JOB
                             and n["store"] == s and n["subject"] == subject), None)  # fmt: skip
                if miss:
                    out.append(f"| {TITLE[s]} | {subject} | {JOB_DESC[subject]} | "
                               f"{JOB_FENCED[subject]} | | {miss['status']} | |")  # fmt: skip
                continue
            ratio = f"{r['ratio']:.2f}{X}"
            if subject == OURS:
                ratio = f"**{ratio}**"
            desc = JOB_DESC[subject] if subject != BASE else BASE_JOB[s]
            out.append(
                f"| {TITLE[s]} | {subject} | {desc} | {JOB_FENCED[subject]} | {trips_text(r)} | "
                f"{fmt_rate(r['value'])} | {ratio} |"
            )
    out += [
        "",
        '"fenced: no" means the peer offers no fencing token for the write: a worker '
        "paused past its lease can still land a late write after another took over.",
        "",
    ]
    if data["not_run"]:
        out += ["## Not run", "", "| store | scenario | subject | status | why |",
                "| --- | --- | --- | --- | --- |"]  # fmt: skip
        seen = set()
        for n in data["not_run"]:
            key = (n["store"], n["scenario"], n["operation"], n["subject"])
            if key in seen:
                continue
            seen.add(key)
            why = n["why"].replace("|", "/")
            out.append(
                f"| {TITLE[n['store']]} | {n['scenario']}, {n['operation']} | "
                f"{n['subject']} | {n['status']} | {why} |"
            )
        out += [""]
    out += [
        "## Reproduce",
        "",
        "```sh",
        'pip install -e ".[test]" matplotlib python-redis-lock fencekit idemkit asyncpg '
        '"aws-lambda-powertools[redis]"',
        "python benchmarks/report.py            # full run, a few minutes; --quick for CI",
        "```",
        "",
        "It needs `redis-server`, `redis-cli` and the PostgreSQL server binaries (as the "
        "tests do); it starts and removes its own servers. The figures above are in "
        "`docs/benchmarks.json`.",
        "",
    ]
    return "\n".join(out)


COLORS = {
    OURS: "#1f5fbf",
    OURS_AIO: "#6fa8ff",
    OURS_W: "#0b3b80",
    OURS_TX: "#17becf",
    RPY: "#d62728",
    PRL: "#ff7f0e",
    FK: "#2ca02c",
    IK: "#9467bd",
    PT: "#8c564b",
}
SHORT = {
    (UNC, LOCK_OP): "acquire+release\nsync",
    (UNC, CLAIM_OP): "claim+complete\nsync",
    (AIO1, LOCK_OP): f"acquire+release\nasyncio {X}1",
    (AIO1, CLAIM_OP): f"claim+complete\nasyncio {X}1",
    (AIO100, LOCK_OP): f"acquire+release\nasyncio {X}100",
    (AIO100, CLAIM_OP): f"claim+complete\nasyncio {X}100",
    (HAND, HAND_OP): "contended\nhand-off",
    (JOB, JOB_OP): "idempotent\njob",
}


def chart(data: dict[str, Any], path: Path) -> None:
    """One panel per store; in each, one group of bars per scenario (idemlock's
    variants and the peers that ran it), as ratios to that store's baseline (the
    dashed line), on a log scale so 0.5x and 2x are as far from it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    stores = data["stores"]
    fig, axes = plt.subplots(len(stores), 1, figsize=(13, 2.9 * len(stores) + 1.3))
    handles: dict[str, Any] = {}
    for ax, store in zip(axes, stores, strict=True):
        rows = [r for r in data["results"] if r["store"] == store and r["subject"] != BASE]
        ratios = [r["ratio"] for r in rows]
        for i, key in enumerate(SCENARIOS):
            group = [r for r in rows if (r["scenario"], r["operation"]) == key]
            group.sort(key=lambda r: SUBJECTS.index(r["subject"]))
            width = min(0.2, 0.84 / max(1, len(group)))
            for j, r in enumerate(group):
                x = i + (j - (len(group) - 1) / 2) * width
                bar = ax.bar(x, r["ratio"], width * 0.9, color=COLORS[r["subject"]],
                             label=r["subject"], zorder=3)  # fmt: skip
                handles.setdefault(r["subject"], bar)
                if r["role"] == "idemlock":
                    ax.annotate(f"{r['ratio']:.2f}", (x, r["ratio"]), ha="center",
                                va="bottom", fontsize=7, xytext=(0, 1),
                                textcoords="offset points")  # fmt: skip
        ax.axhline(1.0, color="black", linewidth=1.0, linestyle="--", zorder=2)
        ax.set_yscale("log")
        ax.set_ylim(min([*ratios, 0.8]) / 1.5, max([*ratios, 1.25]) * 1.5)
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.set_xticks(range(len(SCENARIOS)))
        ax.set_xticklabels([SHORT[k] for k in SCENARIOS], fontsize=8)
        ax.set_xlim(-0.55, len(SCENARIOS) - 0.45)
        ax.set_title(f"{TITLE[store]}  (1 = {BASELINE_SHORT[store]})", fontsize=10, loc="left")
        ax.set_ylabel(f"{X} baseline")
        ax.grid(axis="y", which="major", alpha=0.3, zorder=0)
        ax.set_axisbelow(True)
        for i in range(1, len(SCENARIOS)):
            ax.axvline(i - 0.5, color="#dddddd", linewidth=0.6, zorder=1)
    order = [s for s in SUBJECTS if s in handles]
    fig.suptitle(
        "idemlock and its peers: throughput as a ratio to the raw driver measured in the "
        "same run (dashed line = 1; higher is faster; log scale)",
        fontsize=11,
        y=0.995,
    )
    fig.legend([handles[s] for s in order], order, loc="upper center", ncol=5, fontsize=9,
               frameon=False, bbox_to_anchor=(0.5, 0.975))  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 1 - 1.1 / (2.9 * len(stores) + 1.3)))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


BASELINE_SHORT = {
    "memory": "dict + threading.Lock",
    "sqlite": "raw sqlite3, same transactions",
    "redis": "raw redis-py EVALSHA, same round trips",
    "redis-cluster": "raw RedisCluster EVALSHA, same round trips",
    "postgres": "raw psycopg, same statements",
}


# ---- main --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="reduced configuration (CI)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks.md")
    parser.add_argument("--json", type=Path, default=ROOT / "docs" / "benchmarks.json")
    parser.add_argument("--png", type=Path, default=ROOT / "docs" / "benchmarks.png")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    import matplotlib  # noqa: F401  (the chart is part of the report: fail before the run)
    from tests.servers.postgres import start_postgres
    from tests.servers.redis import start_cluster, start_redis

    started, load_start = time.monotonic(), os.getloadavg()
    print(f"idemlock benchmark report ({'quick' if args.quick else 'full'}): {asdict(cfg)}; "
          f"{os.cpu_count()} cpus, load average {load_start[0]:.2f}")  # fmt: skip
    res = Results()
    versions: dict[str, str | None] = {
        "idemlock": idemlock.__version__,
        "sqlite": sqlite3.sqlite_version,
        "redis-py": version("redis"),
        "hiredis": version("hiredis"),
        "psycopg": version("psycopg"),
        "psycopg-pool": version("psycopg-pool"),
        "asyncpg": version("asyncpg"),
        "matplotlib": version("matplotlib"),
    }
    with (
        tempfile.TemporaryDirectory(prefix="idemlock-report-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        server = start_redis(Path(tmp) / "redis")
        stack.callback(server.stop)
        cluster = start_cluster(Path(tmp) / "cluster")
        stack.callback(cluster.stop)
        pg = start_postgres()
        stack.callback(pg.destroy)
        with redis.Redis(port=server.port) as r:
            versions["redis-server"] = r.info("server")["redis_version"]
        with psycopg.connect(pg.dsn) as conn:
            row = conn.execute("SHOW server_version").fetchone()
            versions["postgresql"] = row[0] if row else None
        contenders = Contenders()
        stack.callback(contenders.close)
        benches: list[Any] = [
            MemoryBench(),
            SqliteBench(tmp),
            RedisBench(server.url, [server.port], cluster=False),
            RedisBench(cluster.url, cluster.ports, cluster=True),
            PgBench(pg.dsn, pg.port),
        ]
        for bench in benches:
            print(f"{TITLE[bench.name]}:")
            run_store(bench, cfg, res, contenders)
    load_end = os.getloadavg()
    data = {
        "meta": {
            "command": "python benchmarks/report.py" + (" --quick" if args.quick else ""),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "quick": args.quick,
            "config": asdict(cfg),
            "wall_seconds": time.monotonic() - started,
            "cpu_count": os.cpu_count(),
            "cpu_model": cpu_model(),
            "load_average_start": list(load_start),
            "load_average_end": list(load_end),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "versions": versions,
        },
        "stores": list(STORES),
        "scenarios": [{"scenario": s, "operation": o} for s, o in SCENARIOS],
        "baselines": BASELINES,
        "peers": peer_status(res),
        "results": res.rows,
        "not_run": res.not_run,
    }
    for r in data["results"]:
        for k, v in r.items():
            if isinstance(v, float) and not math.isfinite(v):
                r[k] = None
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    chart(data, args.png)
    png_name = os.path.relpath(args.png, args.out.parent)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(markdown(data, png_name))
    print(f"wrote {args.json}, {args.out}, {args.png} in {data['meta']['wall_seconds']:.0f} s; "
          f"load average {load_end[0]:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
