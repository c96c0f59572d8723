"""Throughput of the embedded stores against raw sqlite3 measured in the same run.

    python benchmarks/bench_embedded.py [--n N] [--rounds R]

The baseline is what the SQLite store cannot avoid: the same number of transactions
(``BEGIN IMMEDIATE``, one comparable statement, ``COMMIT``) on a file with the same
schema, in WAL mode with ``synchronous=NORMAL``. claim+complete is two transactions
(insert a claim row; update it to completed with its result); acquire+release is two
(insert a lock row; delete it). Every workload runs ``N`` operations per round, the
rounds are interleaved so that disk and CPU drift hit every workload alike, each
subject has its own file (all files grow alike), and the fastest and the median round
are reported, plus the CPU time per operation (steadier on a busy machine).
"store's SQL" rows issue the store's own statements through raw sqlite3 (what the SQL
costs, without the Python layer); "port" rows call the store adapter directly; "API"
rows go through the public coordinator (key validation, tokens, codec, flows).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from itertools import count
from typing import Any

import idemlock
import idemlock.aio
from idemlock.stores import sqlite as S
from idemlock.stores.sqlite import _SCHEMA, SQLiteStore

NS = "bench:job"
RESULT = b'{"ok":true,"id":12345}'
LEASE_MS = 300_000
TTL_MS = 86_400_000

_keys = count()


def fresh_keys(n: int) -> list[str]:
    return [f"k{next(_keys)}" for _ in range(n)]


# ---- raw sqlite3 baseline ----------------------------------------------------------


def open_raw(path: str) -> sqlite3.Cursor:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    for stmt in _SCHEMA:  # the store's own schema, indexes included
        conn.execute(stmt)
    return conn.cursor()


RAW_INSERT_CLAIM = (
    "INSERT INTO claims (ns, key, state, token, fence, fp, expires_ms, result) "
    "VALUES (?, ?, 'in_flight', ?, ?, NULL, ?, NULL)"
)
RAW_COMPLETE = (
    "UPDATE claims SET state = 'completed', result = ?, expires_ms = ? WHERE ns = ? AND key = ?"
)
RAW_INSERT_LOCK = "INSERT INTO locks (ns, key, owner, token, expires_ms) VALUES (?, ?, ?, ?, ?)"
RAW_DELETE_LOCK = "DELETE FROM locks WHERE ns = ? AND key = ?"


def raw_claim_complete(cur: sqlite3.Cursor, n: int) -> float:
    keys = fresh_keys(n)
    start = time.perf_counter()
    for i, key in enumerate(keys):
        now = time.time_ns() // 1_000_000
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(RAW_INSERT_CLAIM, (NS, key, "token", i, now + LEASE_MS))
        cur.execute("COMMIT")
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(RAW_COMPLETE, (RESULT, now + TTL_MS, NS, key))
        cur.execute("COMMIT")
    return time.perf_counter() - start


def raw_acquire_release(cur: sqlite3.Cursor, n: int) -> float:
    start = time.perf_counter()
    for i in range(n):
        now = time.time_ns() // 1_000_000
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(RAW_INSERT_LOCK, (NS, "shared", "owner", i, now + 30_000))
        cur.execute("COMMIT")
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(RAW_DELETE_LOCK, (NS, "shared"))
        cur.execute("COMMIT")
    return time.perf_counter() - start


def sql_claim_complete(cur: sqlite3.Cursor, n: int) -> float:
    """The store's own statements issued raw: the SQL cost without the Python layer."""
    keys = fresh_keys(n)
    start = time.perf_counter()
    for key in keys:
        now = time.time_ns() // 1_000_000
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(S._CLAIM_NEW, (NS, key, "token", None, now + LEASE_MS, now)).fetchone()
        cur.execute("COMMIT")
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(S._COMPLETE, (RESULT, now + TTL_MS, NS, key, "token", now))
        cur.execute("COMMIT")
    return time.perf_counter() - start


def sql_acquire_release(cur: sqlite3.Cursor, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        now = time.time_ns() // 1_000_000
        cur.execute("BEGIN IMMEDIATE")
        token = cur.execute(S._ACQUIRE, (NS, "shared", "owner", now + 30_000, now)).fetchone()[0]
        cur.execute("COMMIT")
        cur.execute("BEGIN IMMEDIATE")
        cur.execute(S._RELEASE, (NS, "shared", "owner", token, now))
        cur.execute("COMMIT")
    return time.perf_counter() - start


# ---- idemlock -----------------------------------------------------------------------


def port_claim_complete(store: Any, n: int) -> float:
    keys = fresh_keys(n)
    start = time.perf_counter()
    for key in keys:
        store.claim(NS, key, None, "token", LEASE_MS)
        if not store.complete(NS, key, "token", RESULT, TTL_MS):
            raise AssertionError("complete failed")
    return time.perf_counter() - start


def port_acquire_release(store: Any, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        got = store.acquire(NS, "shared", "owner", 30_000)
        if not store.release(NS, "shared", "owner", got.token):
            raise AssertionError("release failed")
    return time.perf_counter() - start


def api_claim_complete(coord: idemlock.Coordinator, n: int) -> float:
    port = coord.idempotency("job")
    keys = fresh_keys(n)
    start = time.perf_counter()
    for key in keys:
        claim = port.claim(key)
        assert isinstance(claim, idemlock.Claimed)
        port.complete(claim.token, {"ok": True})
    return time.perf_counter() - start


def api_acquire_release(coord: idemlock.Coordinator, n: int) -> float:
    locks = coord.lock("job")
    start = time.perf_counter()
    for _ in range(n):
        lease = locks.acquire("shared")
        assert lease is not None
        locks.release(lease)
    return time.perf_counter() - start


async def _aio_claim_complete(coord: idemlock.aio.AsyncCoordinator, n: int) -> float:
    port = coord.idempotency("job")
    keys = fresh_keys(n)
    start = time.perf_counter()
    for key in keys:
        claim = await port.claim(key)
        assert isinstance(claim, idemlock.Claimed)
        await port.complete(claim.token, {"ok": True})
    return time.perf_counter() - start


async def _aio_acquire_release(coord: idemlock.aio.AsyncCoordinator, n: int) -> float:
    locks = coord.lock("job")
    start = time.perf_counter()
    for _ in range(n):
        lease = await locks.acquire("shared")
        assert lease is not None
        await locks.release(lease)
    return time.perf_counter() - start


# ---- driver -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=2000, help="operations per round (2000)")
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds (7)")
    args = parser.parse_args(argv)
    n, rounds = args.n, args.rounds
    if n < 1 or rounds < 1:
        parser.error("--n and --rounds must be positive")

    with tempfile.TemporaryDirectory(prefix="idemlock-bench-") as tmp:
        # One file per subject, so that every file grows by the same rows per round.
        def url(name: str) -> str:
            return f"sqlite:///{os.path.join(tmp, name)}"

        raw = open_raw(os.path.join(tmp, "raw.db"))
        raw_sql = open_raw(os.path.join(tmp, "raw-sql.db"))
        store: SQLiteStore = idemlock.connect(url("port.db")).store
        coord = idemlock.connect(url("api.db"), key_prefix="api")
        acoord = idemlock.aio.connect(url("aio.db"), key_prefix="aio")
        memory = idemlock.connect("memory://", key_prefix="api")
        loop = asyncio.new_event_loop()

        workloads: list[tuple[str, str, Callable[[int], float]]] = [
            ("claim+complete", "raw sqlite3 (baseline)", lambda k: raw_claim_complete(raw, k)),
            (
                "claim+complete",
                "raw sqlite3, store's SQL",
                lambda k: sql_claim_complete(raw_sql, k),
            ),
            ("claim+complete", "sqlite sync, port", lambda k: port_claim_complete(store, k)),
            ("claim+complete", "sqlite sync, API", lambda k: api_claim_complete(coord, k)),
            (
                "claim+complete",
                "sqlite async, API",
                lambda k: loop.run_until_complete(_aio_claim_complete(acoord, k)),
            ),
            ("claim+complete", "memory, API", lambda k: api_claim_complete(memory, k)),
            ("acquire+release", "raw sqlite3 (baseline)", lambda k: raw_acquire_release(raw, k)),
            (
                "acquire+release",
                "raw sqlite3, store's SQL",
                lambda k: sql_acquire_release(raw_sql, k),
            ),
            ("acquire+release", "sqlite sync, port", lambda k: port_acquire_release(store, k)),
            ("acquire+release", "sqlite sync, API", lambda k: api_acquire_release(coord, k)),
            (
                "acquire+release",
                "sqlite async, API",
                lambda k: loop.run_until_complete(_aio_acquire_release(acoord, k)),
            ),
            ("acquire+release", "memory, API", lambda k: api_acquire_release(memory, k)),
        ]
        for _, _, run in workloads:  # warm up: connections, statement caches, file growth
            run(max(50, n // 10))
        times: dict[tuple[str, str], list[float]] = {(w, s): [] for w, s, _ in workloads}
        cpu: dict[tuple[str, str], list[float]] = {(w, s): [] for w, s, _ in workloads}
        for _ in range(rounds):
            for workload, subject, run in workloads:
                # CPU time of this process (all threads) is barely moved by other load
                # on the machine, unlike wall time: it gives the steadier ratio.
                used = time.process_time()
                times[(workload, subject)].append(run(n))
                cpu[(workload, subject)].append(time.process_time() - used)

        loop.run_until_complete(acoord.close())
        loop.close()
        coord.close()
        store.close()
        memory.close()
        raw.connection.close()
        raw_sql.connection.close()

    print(
        f"idemlock embedded stores: {n} operations x {rounds} interleaved rounds, "
        f"SQLite {sqlite3.sqlite_version}, Python {sys.version.split()[0]}, "
        "WAL + synchronous=NORMAL, 2 transactions per operation"
    )
    print(
        "wall clock: best = fastest round, med = median round; cpu = CPU time of this "
        "process per operation (fastest round); each ratio is against the raw sqlite3 "
        "baseline of the same statistic"
    )
    header = (
        f"{'operation':<16} {'subject':<26} {'best ops/s':>10} {'txn/s':>8} {'vs raw':>7}"
        f" {'med ops/s':>10} {'vs raw':>7} {'cpu us/op':>10} {'vs raw':>7}"
    )
    print(header)
    print("-" * len(header))
    base: dict[str, tuple[float, float, float]] = {}
    for workload, subject, _ in workloads:
        best = n / min(times[(workload, subject)])
        med = n / statistics.median(times[(workload, subject)])
        cpu_us = min(cpu[(workload, subject)]) / n * 1e6
        if subject == "raw sqlite3 (baseline)":
            base[workload] = (best, med, cpu_us)
        b_best, b_med, b_cpu = base[workload]
        txn = f"{2 * best:8.0f}" if "memory" not in subject else f"{'-':>8}"
        print(
            f"{workload:<16} {subject:<26} {best:10.0f} {txn} {best / b_best:6.2f}x"
            f" {med:10.0f} {med / b_med:6.2f}x {cpu_us:10.1f} {b_cpu / cpu_us:6.2f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
