"""PostgreSQL store benchmark: one command, one throwaway server.

    python benchmarks/bench_postgres.py [--ops 2000] [--rounds 5] [--dsn postgresql://...]

Measures, one caller at a time (latency-bound, as a request handler sees it):

* claim+complete and acquire+release per second through idemlock's public API (and
  through the store port alone, which isolates what the PostgreSQL store costs from
  the core's per-call work), sync and async, next to raw psycopg running the same
  number of comparable statements
  (one INSERT ... ON CONFLICT and one UPDATE/DELETE per pair, prepared, autocommit,
  on tables with the same columns and indexes) - the ratio is idemlock / raw;
* idemkit's PostgreSQL backend (asyncpg) doing the same claim and complete, if it is
  installed (``pip install idemkit asyncpg``);
* the hand-off gap under contention: 4 processes take turns on one lock; the gap is
  from the moment the holder calls release to the moment the next process (a waiter
  woken by NOTIFY) has the lock.

Runs are interleaved in chunks of 50 pairs (A, B, A, B, ...), so a noisy machine
slows both sides alike. The server is started with
fsync off (see tests/servers/postgres.py): absolute numbers are optimistic, ratios
are what matters.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing as mp
import statistics
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

import idemlock  # noqa: E402
import idemlock.aio  # noqa: E402
from idemlock import IdempotencySpec, LockSpec  # noqa: E402

SPEC = IdempotencySpec("bench")
LOCK = LockSpec("bench", ttl=timedelta(seconds=30))

# ---- raw psycopg baseline ------------------------------------------------------------

RAW_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS raw;
CREATE SEQUENCE IF NOT EXISTS raw.seq;
CREATE TABLE IF NOT EXISTS raw.claims (
    ns text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL, state text NOT NULL,
    token text NOT NULL, fence bigint NOT NULL, fp text, expires_ms bigint NOT NULL,
    result bytea, PRIMARY KEY (ns, key));
CREATE INDEX IF NOT EXISTS claims_expires_idx ON raw.claims (expires_ms);
CREATE TABLE IF NOT EXISTS raw.locks (
    ns text COLLATE "C" NOT NULL, key text COLLATE "C" NOT NULL, owner text NOT NULL,
    token bigint NOT NULL, expires_ms bigint NOT NULL, PRIMARY KEY (ns, key));
CREATE INDEX IF NOT EXISTS locks_expires_idx ON raw.locks (expires_ms);
"""
RAW_CLAIM = (
    b"INSERT INTO raw.claims (ns, key, state, token, fence, fp, expires_ms) "
    b"VALUES (%s, %s, 'in_flight', %s, nextval('raw.seq'), %s, %s) "
    b"ON CONFLICT (ns, key) DO NOTHING RETURNING fence, expires_ms"
)
RAW_COMPLETE = (
    b"UPDATE raw.claims SET state = 'completed', result = %s, expires_ms = %s "
    b"WHERE ns = %s AND key = %s AND token = %s AND state = 'in_flight' RETURNING 1"
)
RAW_ACQUIRE = (
    b"INSERT INTO raw.locks AS l (ns, key, owner, token, expires_ms) "
    b"VALUES (%s, %s, %s, nextval('raw.seq'), %s) ON CONFLICT (ns, key) DO UPDATE "
    b"SET owner = excluded.owner, token = excluded.token, expires_ms = excluded.expires_ms "
    b"WHERE l.expires_ms <= %s RETURNING token"
)
RAW_RELEASE = (
    b"DELETE FROM raw.locks WHERE ns = %s AND key = %s AND owner = %s AND token = %s RETURNING 1"
)


def _now_ms() -> int:
    return int(time.time() * 1000)


# ---- the measured loops: each returns operations (pairs) per second ---------------------


def sync_idemlock_claims(coord: idemlock.Coordinator, n: int) -> float:
    port = coord.idempotency(SPEC)
    run = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    for i in range(n):
        claim = port.claim(f"{run}-{i}", payload={"i": i})
        port.complete(claim.token, i)  # type: ignore[union-attr]
    return n / (time.perf_counter() - t0)


def sync_store_claims(coord: idemlock.Coordinator, n: int) -> float:
    # The store port alone: what the PostgreSQL store costs, without the core's own
    # per-call work (key checks, payload fingerprint, result encoding, token objects).
    store, run = coord.store, uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    for i in range(n):
        key, token = f"{run}-{i}", uuid.uuid4().hex
        store.claim("ns", key, "fp", token, 300_000)
        store.complete("ns", key, token, b"j1", 86_400_000)
    return n / (time.perf_counter() - t0)


def sync_store_locks(coord: idemlock.Coordinator, n: int) -> float:
    store, owner = coord.store, uuid.uuid4().hex
    t0 = time.perf_counter()
    for i in range(n):
        reply = store.acquire("ns", f"k{i % 16}", owner, 30_000)
        store.release("ns", f"k{i % 16}", owner, reply.token)
    return n / (time.perf_counter() - t0)


def sync_raw_claims(conn: psycopg.Connection[Any], n: int) -> float:
    run = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    for i in range(n):
        key, token = f"{run}-{i}", uuid.uuid4().hex
        conn.execute(RAW_CLAIM, ("ns", key, token, "fp", _now_ms() + 300_000), prepare=True)
        conn.execute(
            RAW_COMPLETE, (b"j1", _now_ms() + 86_400_000, "ns", key, token), prepare=True
        ).fetchall()
    return n / (time.perf_counter() - t0)


def sync_idemlock_locks(coord: idemlock.Coordinator, n: int) -> float:
    locks = coord.lock(LOCK)
    t0 = time.perf_counter()
    for i in range(n):
        lease = locks.acquire(f"k{i % 16}")
        assert lease is not None
        locks.release(lease)
    return n / (time.perf_counter() - t0)


def sync_raw_locks(conn: psycopg.Connection[Any], n: int) -> float:
    owner = uuid.uuid4().hex
    t0 = time.perf_counter()
    for i in range(n):
        key, now = f"k{i % 16}", _now_ms()
        row = conn.execute(
            RAW_ACQUIRE, ("ns", key, owner, now + 30_000, now), prepare=True
        ).fetchone()
        assert row is not None
        conn.execute(RAW_RELEASE, ("ns", key, owner, row[0]), prepare=True).fetchall()
    return n / (time.perf_counter() - t0)


async def async_idemlock_claims(coord: idemlock.aio.AsyncCoordinator, n: int) -> float:
    port = coord.idempotency(SPEC)
    run = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    for i in range(n):
        claim = await port.claim(f"{run}-{i}", payload={"i": i})
        await port.complete(claim.token, i)  # type: ignore[union-attr]
    return n / (time.perf_counter() - t0)


async def async_store_claims(coord: idemlock.aio.AsyncCoordinator, n: int) -> float:
    store, run = coord.store, uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    for i in range(n):
        key, token = f"{run}-{i}", uuid.uuid4().hex
        await store.claim("ns", key, "fp", token, 300_000)
        await store.complete("ns", key, token, b"j1", 86_400_000)
    return n / (time.perf_counter() - t0)


async def async_store_locks(coord: idemlock.aio.AsyncCoordinator, n: int) -> float:
    store, owner = coord.store, uuid.uuid4().hex
    t0 = time.perf_counter()
    for i in range(n):
        reply = await store.acquire("ns", f"k{i % 16}", owner, 30_000)
        await store.release("ns", f"k{i % 16}", owner, reply.token)
    return n / (time.perf_counter() - t0)


async def async_raw_claims(conn: psycopg.AsyncConnection[Any], n: int) -> float:
    run = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    for i in range(n):
        key, token = f"{run}-{i}", uuid.uuid4().hex
        await conn.execute(RAW_CLAIM, ("ns", key, token, "fp", _now_ms() + 300_000), prepare=True)
        cur = await conn.execute(
            RAW_COMPLETE, (b"j1", _now_ms() + 86_400_000, "ns", key, token), prepare=True
        )
        await cur.fetchall()
    return n / (time.perf_counter() - t0)


async def async_idemlock_locks(coord: idemlock.aio.AsyncCoordinator, n: int) -> float:
    locks = coord.lock(LOCK)
    t0 = time.perf_counter()
    for i in range(n):
        lease = await locks.acquire(f"k{i % 16}")
        assert lease is not None
        await locks.release(lease)
    return n / (time.perf_counter() - t0)


async def async_raw_locks(conn: psycopg.AsyncConnection[Any], n: int) -> float:
    owner = uuid.uuid4().hex
    t0 = time.perf_counter()
    for i in range(n):
        key, now = f"k{i % 16}", _now_ms()
        cur = await conn.execute(RAW_ACQUIRE, ("ns", key, owner, now + 30_000, now), prepare=True)
        row = await cur.fetchone()
        assert row is not None
        cur = await conn.execute(RAW_RELEASE, ("ns", key, owner, row[0]), prepare=True)
        await cur.fetchall()
    return n / (time.perf_counter() - t0)


async def idemkit_claims(backend: Any, n: int) -> float:
    run = uuid.uuid4().hex[:8]
    t0 = time.perf_counter()
    for i in range(n):
        key = f"{run}-{i}"
        res = await backend.claim(key, "fp", 1, 300.0)
        await backend.complete(key, res.our_claim_token, 200, {}, b"j1", 86_400.0)
    return n / (time.perf_counter() - t0)


# ---- running rounds -------------------------------------------------------------------


# Each measured function runs ``chunk`` pairs at a time, all functions taking turns,
# until each has run ``ops * rounds`` pairs: a burst of load from elsewhere on the
# machine then hits every side alike. Reported: total pairs / total time per side.
CHUNK = 50


def rounds_sync(fns: dict[str, Callable[[int], float]], ops: int, rounds: int) -> dict[str, float]:
    for fn in fns.values():
        fn(max(50, ops // 10))  # warm up: connections, prepared statements
    spent = dict.fromkeys(fns, 0.0)
    for _ in range(max(1, ops * rounds // CHUNK)):
        for name, fn in fns.items():
            spent[name] += CHUNK / fn(CHUNK)
    return {name: ops * rounds / t for name, t in spent.items()}


async def rounds_async(
    fns: dict[str, Callable[[int], Awaitable[float]]], ops: int, rounds: int
) -> dict[str, float]:
    for fn in fns.values():
        await fn(max(50, ops // 10))
    spent = dict.fromkeys(fns, 0.0)
    for _ in range(max(1, ops * rounds // CHUNK)):
        for name, fn in fns.items():
            spent[name] += CHUNK / await fn(CHUNK)
    return {name: ops * rounds / t for name, t in spent.items()}


def throughput(dsn: str, ops: int, rounds: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(RAW_SCHEMA.encode())
    prefix = "b" + uuid.uuid4().hex[:8]

    coord = idemlock.connect(dsn, key_prefix=prefix)
    raw = psycopg.connect(dsn, autocommit=True)
    sync = rounds_sync(
        {
            "idemlock claim+complete": lambda n: sync_idemlock_claims(coord, n),
            "store claim+complete": lambda n: sync_store_claims(coord, n),
            "raw claim+complete": lambda n: sync_raw_claims(raw, n),
            "idemlock acquire+release": lambda n: sync_idemlock_locks(coord, n),
            "store acquire+release": lambda n: sync_store_locks(coord, n),
            "raw acquire+release": lambda n: sync_raw_locks(raw, n),
        },
        ops,
        rounds,
    )
    coord.close()
    raw.close()

    async def run_async() -> dict[str, float]:
        acoord = idemlock.aio.connect(dsn, key_prefix=prefix)
        araw = await psycopg.AsyncConnection.connect(dsn, autocommit=True)
        fns: dict[str, Callable[[int], Awaitable[float]]] = {
            "idemlock claim+complete": lambda n: async_idemlock_claims(acoord, n),
            "store claim+complete": lambda n: async_store_claims(acoord, n),
            "raw claim+complete": lambda n: async_raw_claims(araw, n),
            "idemlock acquire+release": lambda n: async_idemlock_locks(acoord, n),
            "store acquire+release": lambda n: async_store_locks(acoord, n),
            "raw acquire+release": lambda n: async_raw_locks(araw, n),
        }
        kit = await _idemkit(dsn)
        if kit is not None:
            fns["idemkit claim+complete"] = lambda n: idemkit_claims(kit, n)
        try:
            return await rounds_async(fns, ops, rounds)
        finally:
            await acoord.close()
            await araw.close()
            if kit is not None:
                await kit.aclose()

    aio = asyncio.run(run_async())

    print(f"\nthroughput, one caller, {ops * rounds} pairs each, interleaved {CHUNK} at a time:")
    print(f"  {'':40s} {'pairs/s':>8s} {'vs raw psycopg':>15s}")
    for mode, res in (("sync", sync), ("async", aio)):
        for what in ("claim+complete", "acquire+release"):
            base = res[f"raw {what}"]
            for label, key in (("idemlock API", "idemlock"), ("store port only", "store")):
                v = res[f"{key} {what}"]
                print(f"  {mode} {label} {what}".ljust(42) + f"{v:8.0f} {v / base:14.2f}x")
            print(f"  {mode} raw psycopg {what}".ljust(42) + f"{base:8.0f}")
    if "idemkit claim+complete" in aio:
        kit = aio["idemkit claim+complete"]
        ours = aio["idemlock claim+complete"]
        print(
            "  async idemkit claim+complete".ljust(42)
            + f"{kit:8.0f}   idemlock API / idemkit: {ours / kit:.2f}x"
        )
    else:
        print("  idemkit: not installed (pip install idemkit asyncpg) - not compared")


async def _idemkit(dsn: str, max_size: int = 4) -> Any:
    try:
        from idemkit.backends.postgres import PostgresBackend, init_pg
    except ImportError:
        return None
    try:
        await init_pg(dsn)
    except ImportError:  # idemkit without asyncpg
        return None
    return PostgresBackend.from_url(dsn, min_size=1, max_size=max_size)


# ---- hand-off under contention ------------------------------------------------------


def _contender(dsn: str, prefix: str, mode: str, seconds: float, start: Any, out: Any) -> None:
    import os

    from idemlock._core.port import Channel

    pid = os.getpid()
    log: list[tuple[float, float, int]] = []

    def sync_run() -> None:
        coord = idemlock.connect(dsn, key_prefix=prefix)
        locks = coord.lock(LOCK)
        # Connect the pool and the listener before timing anything.
        locks.release(locks.acquire(f"warm-{pid}") or _fail())
        coord.store.subscribe(Channel("lock", "warm", str(pid))).close()
        start.wait()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            lease = locks.acquire("hot", wait=10)
            acquired = time.monotonic()
            assert lease is not None
            time.sleep(0.001)  # the critical section
            releasing = time.monotonic()
            locks.release(lease)
            log.append((acquired, releasing, pid))
            time.sleep(0.001)  # other work, so a waiter gets its turn
        coord.close()

    async def async_run() -> None:
        coord = idemlock.aio.connect(dsn, key_prefix=prefix)
        locks = coord.lock(LOCK)
        await locks.release(await locks.acquire(f"warm-{pid}") or _fail())
        await (await coord.store.subscribe(Channel("lock", "warm", str(pid)))).aclose()
        await asyncio.to_thread(start.wait)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            lease = await locks.acquire("hot", wait=10)
            acquired = time.monotonic()
            assert lease is not None
            await asyncio.sleep(0.001)
            releasing = time.monotonic()
            await locks.release(lease)
            log.append((acquired, releasing, pid))
            await asyncio.sleep(0.001)
        await coord.close()

    if mode == "sync":
        sync_run()
    else:
        asyncio.run(async_run())
    out.put(log)


def _fail() -> Any:
    raise RuntimeError("warm-up lock not acquired")


def handoff(dsn: str, mode: str, procs: int = 4, seconds: float = 4.0) -> None:
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    prefix = "h" + uuid.uuid4().hex[:8]
    workers = [
        ctx.Process(target=_contender, args=(dsn, prefix, mode, seconds, start, out))
        for _ in range(procs)
    ]
    for w in workers:
        w.start()
    time.sleep(2.0)  # let every process import, connect and warm up
    start.set()
    log = sorted(entry for _ in workers for entry in out.get(timeout=60 + seconds))
    for w in workers:
        w.join(timeout=30)
    # (acquired, release called, pid) in acquisition order; a hand-off is a change of pid.
    pairs = list(itertools.pairwise(log))
    gaps = [(nxt[0] - cur[1]) * 1000 for cur, nxt in pairs if nxt[2] != cur[2]]
    held = sum(1 for cur, nxt in pairs if nxt[0] < cur[1])
    if not gaps:
        print(f"  {mode}: no hand-offs observed")
        return
    q = statistics.quantiles(gaps, n=100)
    print(
        f"  {mode:5s}: {len(log)} acquisitions, {len(gaps)} hand-offs between processes; "
        f"gap median {statistics.median(gaps):.2f} ms, p90 {q[89]:.2f} ms, "
        f"p99 {q[98]:.2f} ms, worst {max(gaps):.2f} ms; overlapping holds: {held}"
    )


# ---- main ------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=2000, help="pairs per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dsn", help="use this server instead of starting a throwaway one")
    parser.add_argument("--seconds", type=float, default=4.0, help="hand-off run length")
    parser.add_argument("--handoff-only", action="store_true", help="skip throughput")
    args = parser.parse_args()

    server = None
    dsn = args.dsn
    if dsn is None:
        from tests.servers.postgres import start_postgres

        server = start_postgres()
        dsn = server.dsn
    try:
        with psycopg.connect(dsn) as conn:
            version = conn.execute("SHOW server_version").fetchone()
        print(
            f"PostgreSQL {version[0] if version else '?'}, psycopg {psycopg.__version__}, "
            f"Python {sys.version.split()[0]}, idemlock {idemlock.__version__}"
        )
        if not args.handoff_only:
            throughput(dsn, args.ops, args.rounds)
        print("\nhand-off under contention (4 processes, one lock, release -> next holder):")
        handoff(dsn, "sync", seconds=args.seconds)
        handoff(dsn, "async", seconds=args.seconds)
    finally:
        if server is not None:
            server.destroy()


if __name__ == "__main__":
    main()
