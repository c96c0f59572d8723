"""scale.py's figures that need many processes: waiters on one lock, and the PostgreSQL
connections of a fleet of processes (issue 28).

* **Waiters**: P processes x T asyncio tasks each wait once on one lock with
  ``acquire(wait=...)`` while this process holds it; once every task is waiting (a settle
  time after the last process started them), this process releases and the lock passes
  from waiter to waiter (each holds ~1 ms). Store work is counted from that moment to
  the last release: Redis requests written and SQLite transactions in each waiter
  process (benchmarks/subjects' counters, run there), PostgreSQL request/response
  turns through the counting proxy every waiter connects through. The hand-off gap is
  release (stamped before ``release`` is called) -> the next holder's ``acquire``
  returned, on the machine's monotonic clock.
* **Connections**: N processes, each with one coordinator on one PostgreSQL database,
  make a few claims from 2 threads at once; ``pg_stat_activity`` counts the database's
  server connections while every process is alive and after they sit idle.

Processes are forked by a ``forkserver`` (never from this process, which has connected
already) that imported this module and the command first, so each starts in
milliseconds rather than importing everything again.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import common as c
import psycopg
from render import table

import idemlock
import idemlock.aio

LOCK = idemlock.LockSpec("fleet", ttl=timedelta(seconds=30))
HANDOFF_TRIPS, HANDOFF_MS, WOKEN = 3.0, 5.0, 2.0  # the goals
HOLD = 0.001  # each waiter's hold (s)


@dataclass(frozen=True)
class Fleet:
    procs: int  # waiter processes
    tasks: int  # asyncio tasks per waiter process
    settle: float  # s given to every task to be waiting before the first release
    conn_procs: int  # processes of the connections figure
    idle: float  # s the processes sit idle before connections are counted again


def context() -> Any:
    """The forkserver context, the server preloaded with the command and this module."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["__main__", "scale_fleet"])
    return ctx


def _counter(kind: str) -> Any:
    """This process's counter of store work (PostgreSQL's is the proxy's, elsewhere)."""
    if kind == "redis":
        from subjects.redis import count_redis_requests

        return count_redis_requests()
    if kind == "sqlite":
        from subjects.sqlite import count_sqlite_transactions

        return count_sqlite_transactions()
    return contextlib.nullcontext(lambda: 0)


def waiter(kind: str, url: str, prefix: str, tasks: int, ready: Any, mark: Any, out: Any) -> None:
    """One waiter process: ``tasks`` tasks each waiting once for the lock, holding it ~1 ms.
    Puts (events, store work counted after ``mark``, failures) on ``out``."""
    with _counter(kind) as count:
        base = [0]

        def marked() -> None:
            mark.wait()
            base[0] = count()

        threading.Thread(target=marked, daemon=True).start()

        async def main() -> tuple[list[tuple[float, float, float, int]], int]:
            coord = idemlock.aio.connect(url, key_prefix=prefix)
            port = coord.lock(LOCK)
            warm = await port.acquire(f"warm-{uuid.uuid4().hex}")  # connections open
            assert warm is not None
            await port.release(warm)
            events: list[tuple[float, float, float, int]] = []
            errors: list[str] = []

            async def task() -> None:
                called = time.monotonic()
                try:
                    lease = await port.acquire("one", wait=600)
                except idemlock.IdemlockError as exc:  # counted, the others go on
                    errors.append(c._why(exc))
                    return
                if lease is None:
                    errors.append("still held after wait=600 s")
                    return
                acquired = time.monotonic()
                await asyncio.sleep(HOLD)
                events.append((called, acquired, time.monotonic(), 0))
                await port.release(lease)

            waiting = [asyncio.ensure_future(task()) for _ in range(tasks)]
            await asyncio.sleep(0)
            ready.put(1)
            await asyncio.gather(*waiting)
            work = count() - base[0]
            await coord.close()
            return events, work, errors

        try:
            got = asyncio.run(main())
        except BaseException as exc:  # the parent must hear back, whatever happened
            ready.put(1)
            got = ([], 0, [f"waiter process: {c._why(exc)}"] * tasks)
    out.put(got)


def measure_waiters(kind: str, bench: Any, fleet: Fleet) -> dict[str, Any]:
    ctx = context()
    ready, out, mark = ctx.Queue(), ctx.Queue(), ctx.Event()
    prefix = c.new_prefix("w")
    direct = bench.target()["url"]  # (SQLite: a new file each call)
    counted = bench.counting() if kind == "postgres" else None
    with counted or contextlib.nullcontext((lambda: 0, {"url": direct})) as (proxy_turns, t):
        url = t["url"]
        coord = idemlock.connect(direct, key_prefix=prefix)  # not counted
        try:
            first = coord.lock(LOCK).acquire("one")
            assert first is not None
            procs = [
                ctx.Process(target=waiter, args=(kind, url, prefix, fleet.tasks, ready, mark, out))
                for _ in range(fleet.procs)
            ]
            for p in procs:
                p.start()
            for _ in procs:
                ready.get(timeout=300)
            time.sleep(fleet.settle)  # every task's first attempt made, all waiting
            mark.set()
            turns = proxy_turns()
            time.sleep(0.05)  # the waiter processes' counters read their base
            released = time.monotonic()
            coord.lock(LOCK).release(first)
            got = [out.get(timeout=900) for _ in procs]
            turns = proxy_turns() - turns
            for p in procs:
                p.join(60)
        finally:
            coord.close()
    events = [e for ev, _, _ in got for e in ev]
    errors = [e for _, _, errs in got for e in errs]
    work = turns + sum(w for _, w, _ in got)
    events.append((released - 1.0, released - 1.0, released, -1))  # this process's hold
    m = c.summarize(events, 1.0)
    handoffs = len(events) - 1
    return {
        "store": kind, "waiters": fleet.procs * fleet.tasks, "procs": fleet.procs,
        "tasks": fleet.tasks, "handoffs": handoffs, "failed": len(errors),
        "errors": sorted(set(errors))[:3], "work": work,
        "work_per_handoff": work / max(1, handoffs),
        "gap_median_ms": m["gap_median_ms"], "gap_p99_ms": m["gap_p99_ms"],
        "overlapping_holds": m["overlapping_holds"],
    }  # fmt: skip


WORK = {"redis": "requests", "postgres": "round trips", "sqlite": "transactions"}


def waiters_table(rows: list[dict[str, Any]]) -> str:
    cells = []
    for r in rows:
        per, med = r["work_per_handoff"], r["gap_median_ms"]
        judged = (verdict(per, HANDOFF_TRIPS, ""), verdict(med, HANDOFF_MS, " ms"))
        short = [f"{r['failed']} waiters failed"] * bool(r["failed"])
        short += [v for v in judged if v != "MEETS"]
        cells.append([
            c.TITLE[r["store"]], f"{r['procs']} {c.X} {r['tasks']}",
            f"{r['handoffs']:,}" + (f" ({r['failed']} waiters failed)" if r["failed"] else ""),
            f"{per:.2f} {WORK[r['store']]}", f"≤ {max(0.0, per - 1):.2f}",
            f"{med:.2f} ms", f"{r['gap_p99_ms']:.2f} ms",
            str(r["overlapping_holds"]),
            f"≤ {HANDOFF_TRIPS:g}/hand-off, median ≤ {HANDOFF_MS:g} ms",
            "; ".join(short) or "MEETS",
        ])  # fmt: skip
    head = (
        f"store|waiters (processes {c.X} tasks)|hand-offs|store work per hand-off|"
        "woken per release (bound)|gap median|"
        "gap p99|overlapping holds|goal|verdict"
    )
    return table(head, cells, right=2)


def verdict(value: float, limit: float, unit: str = "") -> str:
    """MEETS, or SHORT by how much, of a goal ``value ≤ limit`` (NaN is short)."""
    if value <= limit:
        return "MEETS"
    by = value - limit
    return f"SHORT by {by:.0f}{unit}" if by >= 100 else f"SHORT by {by:.2g}{unit}"


# ---- connections ---------------------------------------------------------------------


def claimer(url: str, prefix: str, ready: Any, leave: Any) -> None:
    """One process: a coordinator, 2 threads making 3 claims each at once, then idle.
    Puts its failures (a store error's text) on ``ready`` once its claims are done."""
    errors: list[str] = []
    coord = idemlock.connect(url, key_prefix=prefix)
    try:
        port = coord.idempotency(c.SPEC)

        def claims() -> None:
            try:
                for _ in range(3):
                    claim = port.claim(uuid.uuid4().hex)
                    assert isinstance(claim, idemlock.Claimed)
                    port.complete(claim.token, c.RESULT)
            except idemlock.IdemlockError as exc:
                errors.append(c._why(exc))

        threads = [threading.Thread(target=claims) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        ready.put(errors)
    leave.wait(600)
    coord.close()


def server_connections(admin: Any, db: str) -> int:
    """The server connections to ``db`` but ``admin``'s own (one connection, opened
    first: the server may have none left to give once the processes took them)."""
    row = admin.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
        (db,),
    ).fetchone()
    return int(row[0]) if row else 0


def measure_connections(
    url: str, admin_dsn: str, db: str, how: str, fleet: Fleet
) -> dict[str, Any]:
    """``fleet.conn_procs`` processes on ``url`` (database ``db``); server connections
    counted through ``admin`` (straight to the server)."""
    ctx = context()
    ready, leave = ctx.Queue(), ctx.Event()
    prefix = c.new_prefix("n")
    idemlock.connect(url, key_prefix=prefix).close()  # the schema, made once
    admin = psycopg.connect(admin_dsn, autocommit=True)
    before = server_connections(admin, db)
    procs = [ctx.Process(target=claimer, args=(url, prefix, ready, leave))
             for _ in range(fleet.conn_procs)]  # fmt: skip
    peak = 0
    try:
        for p in procs:
            p.start()
        errors: list[str] = []
        for _ in procs:
            errors += ready.get(timeout=600)
            peak = max(peak, server_connections(admin, db) - before)
        busy = server_connections(admin, db) - before
        peak = max(peak, busy)
        time.sleep(fleet.idle)
        idle = server_connections(admin, db) - before
    finally:
        leave.set()
        for p in procs:
            p.join(120)
    after_exit = server_connections(admin, db) - before
    admin.close()
    return {"how": how, "procs": fleet.conn_procs, "peak": peak, "failed": len(errors),
            "errors": sorted(set(errors))[:3],
            "per_proc": peak / fleet.conn_procs, "idle": idle, "idle_s": fleet.idle,
            "after_exit": after_exit}  # fmt: skip


#: what bounds a process's connections: psycopg_pool's max_size (the store's default 10)
#: plus the waiters' LISTEN connection (1, only while something waits)
BOUND = 11
POOL_IDLE = (
    "psycopg_pool's max_idle, 600 s by default (idemlock does not set it): idle "
    "connections above min_size (1) close after it"
)


def connections_table(rows: list[dict[str, Any]]) -> str:
    cells = [
        [r["how"], str(r["procs"]) + (f" ({r['failed']} claims failed)" if r["failed"] else ""),
         str(r["peak"]), f"{r['per_proc']:.2f}",
         f"{r['idle']} (after {r['idle_s']:g} s)", str(r["after_exit"]),
         f"≤ {BOUND} per process",
         f"{r['failed']} claims failed" if r["failed"]
         else verdict(r["per_proc"], BOUND, " per process")]
        for r in rows
    ]  # fmt: skip
    head = "route|processes|server connections at peak|per process|idle|after exit|goal|verdict"
    return table(head, cells, right=1)
