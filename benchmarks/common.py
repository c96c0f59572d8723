"""What every benchmark shares: the names of scenarios and subjects, the peers, the
results table, and the interleaved rounds that make every ratio a same-round ratio.

A throughput subject is a function ``fn(count)`` doing ``count`` operations (an asyncio
one: ``make(task, count)``, fanned out over tasks). ``interleave`` runs every subject
once per round, round after round (A, B, C, A, B, C, ...), so the drift of a shared
machine moves every side alike; a ratio is the median of the per-round ratios.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import importlib.util
import itertools
import math
import statistics
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import idemlock
from idemlock import IdempotencySpec, LockSpec

DOCS = Path(__file__).resolve().parent.parent / "docs"
SPEC = IdempotencySpec("orders", ttl=timedelta(hours=1))
LOCK = LockSpec("jobs", ttl=timedelta(seconds=30))
RESULT = {"charge": "ch_" + "x" * 20, "amount": 1200}
KEEP = 60_000
#: Every raw and peer client is configured like idemlock's own (bounded waits): with a
#: socket_timeout, redis-py's asyncio client wraps each send and read in a timeout,
#: which costs a few microseconds a call that the baseline must pay too.
CLIENT = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0}

STORES = ("memory", "sqlite", "redis", "redis-cluster", "postgres")
TITLE = dict(zip(STORES, ("memory", "SQLite", "Redis", "Redis Cluster", "PostgreSQL"), strict=True))
#: rounds of the in-process stores are longer (their operations take microseconds), so
#: that a scheduler hiccup on a busy machine averages out
SCALE = {"memory": 10, "sqlite": 2, "redis": 1, "redis-cluster": 1, "postgres": 1}

UNC, AIO1, AIO100 = "uncontended", "asyncio, 1 task", "asyncio, 100 tasks"
HAND, JOB = "contended hand-off", "idempotent job"
LOCK_OP, CLAIM_OP = "acquire+release", "claim+complete"
HAND_OP, JOB_OP = "4 contenders, hold ~1 ms", "claim + fenced write + complete"
#: (scenario, operation), in the report's order
SCENARIOS = [(s, op) for s in (UNC, AIO1, AIO100) for op in (LOCK_OP, CLAIM_OP)]
SCENARIOS += [(HAND, HAND_OP), (JOB, JOB_OP)]

BASE, OURS = "baseline", "idemlock"
OURS_AIO, OURS_TX = "idemlock (asyncio)", "idemlock (same transaction)"
OURS_W, OURS_PORT = "idemlock (write in complete)", "idemlock (store port)"
OURS_SQL = "idemlock (its SQL, raw driver)"  # the store's own statements, no Python layer
RPY, PRL, FK, IK, PT = "redis-py Lock", "python-redis-lock", "fencekit", "idemkit", "Powertools"
SUBJECTS = (BASE, OURS, OURS_PORT, OURS_SQL, OURS_AIO, OURS_W, OURS_TX, RPY, PRL, FK, IK, PT)

POWERTOOLS = "idempotent_function with the Redis (cache) persistence layer; sync"
#: peer -> (distribution, module, what is measured)
PEERS: dict[str, tuple[str, str, str]] = {
    RPY: ("redis", "redis", "redis-py's Lock: SET NX PX, Lua release; sync and asyncio"),
    PRL: ("python-redis-lock", "redis_lock", "Lock with a signal list (BLPOP wake-up); sync"),
    FK: ("fencekit", "fencekit", "fenced DistributedLock, IdempotencyGuard, FenceGate; sync"),
    IK: ("idemkit", "idemkit", "idempotency on Redis, PostgreSQL (asyncpg); asyncio only"),
    PT: ("aws-lambda-powertools", "aws_lambda_powertools", POWERTOOLS),
}

BASELINES = {
    "memory": "a dict under a threading.Lock doing the same critical sections (claim: insert; "
    "complete: update; acquire: insert; release: delete; the job adds the same fenced write); "
    "contended: a threading.Lock shared by 4 threads",
    "sqlite": "raw sqlite3 on a file with the store's schema, WAL + synchronous=NORMAL, the same "
    "number of transactions (BEGIN IMMEDIATE, one statement, COMMIT); asyncio: each transaction "
    "in asyncio.to_thread, as the store runs its calls; contended: a lock row INSERTed by 4 "
    "processes, retried every 1 ms, DELETEd on release",
    "redis": "raw redis-py (hiredis) calling EVALSHA on idemlock's own scripts with the same "
    "arguments: the same round trips; contended: SET NX PX retried every 1 ms, "
    "compare-and-delete on release",
    "redis-cluster": "as for Redis, through redis-py's RedisCluster (3 masters, no replicas)",
    "postgres": "raw psycopg, prepared statements, autocommit: one comparable statement per round "
    "trip on tables with the same columns and indexes; asyncio, 100 tasks: through a psycopg_pool "
    "of 10 connections (idemlock's default pool size); contended: pg_advisory_lock / "
    "pg_advisory_unlock (the server queues the waiters)",
}

#: subject -> (its job, whether the write is fenced)
JOB_DESC = {
    BASE: ("the raw driver doing the same 3 round trips", "yes"),
    OURS: ("claim -> fenced write with the claim's fence -> complete", "yes"),
    OURS_AIO: ("as idemlock, on the asyncio API (1 task)", "yes"),
    OURS_W: ("claim -> complete(writes=...): record and write in one script", "yes (claim token)"),
    OURS_TX: (
        "claim -> one transaction: fenced upsert + complete_in_transaction",
        "yes (+ same transaction)",
    ),
    FK: ("try_begin -> lock acquire -> fenced set -> mark_done -> release", "yes"),
    RPY: ("lock acquire -> GET done -> SET effect -> SET done -> release", "no"),
    PRL: ("lock acquire -> GET done -> SET effect -> SET done -> release", "no"),
    PT: ("idempotent_function: SET NX in progress -> SET effect -> SET result", "no"),
    IK: ("claim -> write -> complete (asyncio, 1 task)", "no"),
}
BASE_JOB = {
    "memory": "the same 3 steps on the dict (claim, fenced write, complete)",
    "sqlite": "raw sqlite3: the same 3 transactions (claim, fenced upsert, complete)",
    "redis": "raw EVALSHA of idemlock's claim, fence_set and complete scripts",
    "redis-cluster": "raw EVALSHA of idemlock's claim, fence_set and complete scripts",
    "postgres": "raw psycopg: claim INSERT, fenced upsert, complete UPDATE",
}

HAVE = {name: importlib.util.find_spec(mod) is not None for name, (_, mod, _) in PEERS.items()}
HAVE_ASYNCPG = importlib.util.find_spec("asyncpg") is not None

RESULT_BYTES = b"J" + b"x" * 40  # what the raw baselines store as a result
LEASE_MS, TTL_MS = 300_000, 3_600_000

X = "\u00d7"  # the multiplication sign of the ratios
SyncFn = Callable[[int], Any]
Make = Callable[[int, int], Awaitable[None]]  # (task index, pairs) -> coroutine
AsyncFn = Callable[[int], Awaitable[Any]]


@dataclass(frozen=True)
class Config:
    n: int  # pairs per round (sync and asyncio; a multiple of 100 for the 100-task runs)
    rounds: int  # interleaved rounds
    job_n: int  # jobs per round
    seconds: float  # length of each contention run
    count: int  # operations run to count round trips
    scaled: bool  # longer rounds for the in-process stores (SCALE)


def role(subject: str) -> str:
    if subject == BASE:
        return "baseline"
    return "idemlock" if subject.startswith(OURS) else "peer"


KEYS = ("scenario", "operation", "store", "subject")  # what identifies a row
Where = tuple[str, str, str]  # the scenario, operation and store of a row
Rates = dict[str, list[float]]
Extra = dict[str, dict[str, Any]] | None  # more columns of some subjects' rows


class Results:
    """The rows of a run, and the subjects that did not run (with why)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.not_run: list[dict[str, str]] = []

    def rates(
        self, scenario: str, op: str, store: str, rates: Rates, unit: str, extra: Extra = None
    ) -> None:
        """A row per subject: its median rate, its median same-round ratio to the baseline."""
        extra = extra or {}
        for name, series in rates.items():
            row: dict[str, Any] = dict(zip(KEYS, (scenario, op, store, name), strict=True))
            row.update(role=role(name), value=statistics.median(series), unit=unit)
            row.update(ratio=ratio(rates, name, BASE), rounds=len(series), **extra.get(name, {}))
            self.rows.append(row)
        trips = {k: f" ({e['round_trips']} trips)" for k, e in extra.items() if "round_trips" in e}
        done = [f"{k} {statistics.median(v):.0f}/s{trips.get(k, '')}" for k, v in rates.items()]
        print(f"  {scenario}, {op}: {', '.join(done)}")

    def skip(self, where: Where, subject: str, status: str, why: str) -> None:
        row = dict(zip(KEYS, (*where, subject), strict=True))
        self.not_run.append({**row, "status": status, "why": why})


def _why(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text if len(text) <= 240 else text[:237] + "..."


def installed(res: Results, where: Where, name: str) -> bool:
    """False (and why, in ``res``) for a peer that is not installed."""
    if name in HAVE and not HAVE[name]:
        res.skip(where, name, "not installed", f"pip install {PEERS[name][0]}")
        return False
    return True


@contextlib.contextmanager
def _peer_errors(name: str, res: Results | None = None, where: Any = None) -> Iterator[None]:
    """What a peer raises: with ``res``, reported there (the peer is then left out), else
    raised again as ``PeerFailed``."""
    try:
        yield
    except Exception as exc:
        if res is None:
            raise PeerFailed(name, exc) from exc
        why = "not supported" if isinstance(exc, idemlock.ConfigurationError) else "failed"
        res.skip(where, name, why, _why(exc))


def peer(res: Results, where: Where, name: str, build: Callable[[], SyncFn]) -> SyncFn | None:
    """A peer's measured function, tried once; None (and why, in ``res``) if it cannot run."""
    with _peer_errors(name, res, where):
        if installed(res, where, name):
            fn = build()
            fn(2)
            return fn
    return None


async def apeer(
    res: Results, where: Where, name: str, build: Callable[[], Awaitable[Make]]
) -> Make | None:
    """As ``peer``, for an asyncio peer's make (task index, pairs)."""
    with _peer_errors(name, res, where):
        if installed(res, where, name):
            make = await build()
            await make(0, 2)
            return make
    return None


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

    def wrap(name: str, fn: Any) -> Any:
        def run(*args: Any) -> Any:
            with _peer_errors(name):
                return fn(*args)

        async def amake(*args: Any) -> None:
            with _peer_errors(name):
                await fn(*args)

        return amake if asyncio.iscoroutinefunction(fn) else run

    return {k: fn if role(k) != "peer" else wrap(k, fn) for k, fn in fns.items()}


def new_prefix(tag: str = "b") -> str:
    return tag + uuid.uuid4().hex[:8]


def _rounds(
    fns: dict[str, Any],
    n: int,
    rounds: int,
    warm: int,
    rates: Rates,
    cpu: Rates | None,
    rotate: bool = False,
) -> Iterator[Any]:
    """The calls of ``interleave``: each function with ``warm`` operations, then each with
    ``n`` per round, timed into ``rates`` (and this process's CPU µs per operation into
    ``cpu``, if given); the caller makes (or awaits) them. ``rotate``: the order turns by
    one each round (A B C, B C A, C A B, ...), so no subject always runs after another."""
    cpu = {} if cpu is None else cpu
    for fn in fns.values():  # warm up: connections, script cache, imports
        yield fn, warm
    names = list(fns)
    for r in range(rounds):
        turn = r % len(names) if rotate else 0
        for name in names[turn:] + names[:turn]:
            fn = fns[name]
            # CPU time of this process (all its threads) is barely moved by other load on
            # the machine, unlike wall time: the steadier figure on a busy machine
            start, used = time.perf_counter(), time.process_time()
            yield fn, n
            rates[name].append(n / (time.perf_counter() - start))
            cpu.setdefault(name, []).append((time.process_time() - used) / n * 1e6)


def interleave(
    fns: dict[str, SyncFn], n: int, rounds: int, cpu: Rates | None = None, rotate: bool = False
) -> Rates:
    """Operations per second of each function in every round; rounds run A, B, A, B, ..."""
    rates: Rates = {k: [] for k in fns}
    for fn, count in _rounds(fns, n, rounds, max(50, n // 20), rates, cpu, rotate):
        fn(count)
    return rates


async def ainterleave(
    fns: dict[str, AsyncFn], n: int, rounds: int, cpu: Rates | None = None
) -> Rates:
    """As ``interleave``, for asyncio functions."""
    rates: Rates = {k: [] for k in fns}
    for fn, count in _rounds(fns, n, rounds, max(100, n // 20), rates, cpu):
        await fn(count)
    return rates


def cpu_us(cpu: Rates) -> dict[str, dict[str, float]]:
    """The ``cpu_us`` column of each subject's row: its median CPU µs per operation."""
    return {k: {"cpu_us": statistics.median(v)} for k, v in cpu.items()}


def fan_out(make: Make, tasks: int) -> AsyncFn:
    """Split ``count`` operations over ``tasks`` concurrent tasks (task index, share)."""

    async def run(count: int) -> None:
        share = max(1, count // tasks)
        await asyncio.gather(*(make(t, share) for t in range(tasks)))

    return run


def ratio(rates: Rates, num: str, den: str) -> float:
    """The median of the per-round ratios of two subjects."""
    return statistics.median(a / b for a, b in zip(rates[num], rates[den], strict=True))


def summarize(events: list[tuple[float, float, float, int]], seconds: float) -> dict[str, float]:
    """Contention figures from (called, acquired, released, process) of every critical
    section on one shared monotonic clock."""
    ordered = sorted(events, key=lambda e: e[1])
    pairs = list(itertools.pairwise(ordered))
    gaps = [cur[1] - prev[2] for prev, cur in pairs]
    cuts = statistics.quantiles(gaps, n=100) if len(gaps) > 1 else [math.nan] * 99
    # a hand-off: the next holder was already waiting when the lock was released
    handoff_gaps = [cur[1] - prev[2] for prev, cur in pairs if cur[0] < prev[2]]
    waits = [a - c for c, a, _, _ in events]
    # "released" is stamped before release is called: a section acquired before the
    # latest such stamp overlapped a hold (mutual exclusion broken)
    ends = itertools.accumulate((e[2] for e in ordered), max)
    overlaps = sum(cur[1] < end for cur, end in zip(ordered[1:], ends, strict=False))

    def ms(values: list[float], pick: Callable[[list[float]], float]) -> float:
        return pick(values) * 1000 if values else float("nan")

    return {
        "cs_per_s": len(events) / seconds,
        "handoff_share": len(handoff_gaps) / max(1, len(events) - 1),
        "gap_median_ms": ms(gaps, statistics.median),
        "gap_p90_ms": cuts[89] * 1000,
        "gap_p99_ms": cuts[98] * 1000,
        "handoff_gap_median_ms": ms(handoff_gaps, statistics.median),
        "worst_wait_ms": ms(waits, max),
        "count": len(events),
        "overlapping_holds": overlaps,
    }


def version(dist: str) -> str | None:
    with contextlib.suppress(importlib.metadata.PackageNotFoundError):
        return importlib.metadata.version(dist)
    return None


#: what a reader must know of an installed peer's figures
CAVEATS = {
    PT: ". Runs outside Lambda through idempotent_function (no Lambda context): it then sets "
    "no in-progress expiry, so a key whose worker died stays blocked until the record's whole "
    "expiry (1 h by default) instead of a lease; it issues no fencing token and its "
    "completion is an unconditional SET",
    IK: "" if HAVE_ASYNCPG else ". Its PostgreSQL backend needs asyncpg, which is not installed",
}


def peer_status(res: Results) -> dict[str, dict[str, Any]]:
    """Each peer's version, status, stores it ran on, failures and notes."""
    out = {}
    for name, (dist, _, what) in PEERS.items():
        ran = sorted({r["store"] for r in res.rows if r["subject"] == name}, key=STORES.index)
        failed = [n for n in res.not_run if n["subject"] == name and n["status"] == "failed"]
        out[name] = {
            "distribution": dist,
            "version": version(dist),
            "status": "ran" if ran else "could not run" if HAVE[name] else "not installed",
            "stores": ran,
            "failures": [f"{f['store']}, {f['scenario']}: {f['why']}" for f in failed],
            "notes": what + (CAVEATS.get(name, "") if HAVE[name] else ""),
        }
    return out


#: the tests' throwaway servers: kind -> (module of tests.servers, start function, stop method)
SERVERS = {
    "redis": ("redis", "start_redis", "stop"),
    "redis-cluster": ("redis", "start_cluster", "stop"),
    "redis-sentinel": ("sentinel", "start_sentinel_group", "stop"),
    "postgres": ("postgres", "start_postgres", "destroy"),
    "etcd": ("etcd", "start_etcd", "destroy"),
}


class Servers(contextlib.ExitStack):
    """A command's temporary directory (``tmp``) and the servers it starts there, each
    stopped on exit (also when a later one fails to start), before the directory goes."""

    def __init__(self, prefix: str = "idemlock-bench-") -> None:
        super().__init__()
        tmp = tempfile.TemporaryDirectory(prefix=prefix, ignore_cleanup_errors=True)
        self.tmp = Path(self.enter_context(tmp))

    def start(self, kind: str, *args: Any, **kw: Any) -> Any:
        """A server of ``kind``; a Redis one in a directory of its own under ``tmp``."""
        module, start, stop = SERVERS[kind]
        args = (self.tmp / kind, *args) if kind.startswith("redis") else args
        server = getattr(importlib.import_module(f"tests.servers.{module}"), start)(*args, **kw)
        self.callback(getattr(server, stop))
        return server


#: the goals section of docs/benchmarks.md (written by goals.py, kept by report.py)
GOALS_START, GOALS_END = "<!-- goals.py -->", "<!-- /goals.py -->"
#: the scale section of docs/benchmarks.md (written by scale.py, kept by report.py)
SCALE_START, SCALE_END = "<!-- scale.py -->", "<!-- /scale.py -->"
