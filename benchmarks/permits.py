"""Issue 24's figures: what a permit costs, how fast it is handed off, how fast a new
leader is elected after the old one is killed.

    python benchmarks/permits.py [--quick] [--stores sqlite,redis,postgres,etcd]
                                 [--json PATH]

Starts its own throwaway servers and prints one Markdown table per figure:

* **Pairs**: acquire + release per second of a permit (limit 3), of a lock (the
  one-permit case of the same rows) and of the nearest hand-written semaphore on the
  same store (Redis: one Lua script over a sorted set and a counter, as the usual
  recipes write it; SQLite: one ``BEGIN IMMEDIATE`` transaction that deletes expired
  rows, counts and inserts; PostgreSQL: a transaction under an advisory lock doing the
  same), measured in interleaved rounds; the ratios are same-round medians. The
  hand-written ones give no fencing token per permit, no fair hand-off and no owner
  re-acquire: they are the floor, not an equal.
* **Hand-off**: a key with all permits held and one waiter blocked in
  ``acquire(wait=30)`` in another thread: the time from the release returning to the
  waiter's acquire returning (median and worst of the rounds).
* **Failover**: a leader in another process campaigns with ttl ``--ttl`` and is killed
  with SIGKILL; a candidate already waiting in ``campaign()`` here is elected: the time
  from the kill to the election (bounded by the ttl, as nobody releases).
* **Observe**: an observer (``observe()`` on a coordinator of its own, ttl 30 s, so it
  re-reads once a second) and a leader on another coordinator of the same store: the
  time from ``campaign()`` entering its block to the observer yielding that term, and
  from ``proclaim()`` returning to the new value; then 20 terms of 0.1 s each, one after
  the other, and how many of them the observer saw.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the tests' servers, then common

import common as c  # noqa: E402

import idemlock  # noqa: E402

LIMIT = 3
TTL_MS = 30_000

# A semaphore as Redis recipes write it: expired members dropped, count, add, and a
# counter for a token. One script, one round trip, as idemlock's.
_REDIS_ACQUIRE = """
local now = redis.call('TIME')
local ms = now[1] * 1000 + math.floor(now[2] / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ms)
if redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 1 end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ms + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return redis.call('INCR', KEYS[2])
"""


def ours(url: str, limit: int) -> Callable[[int], None]:
    coord = idemlock.connect(url, key_prefix=c.new_prefix())
    port: Any = (
        coord.lock(idemlock.LockSpec("bench", ttl=30))
        if limit == 1
        else coord.semaphore(idemlock.SemaphoreSpec("bench", limit=limit, ttl=30))
    )

    def run(count: int) -> None:
        for _ in range(count):
            permit = port.acquire("k")
            assert permit is not None
            port.release(permit)

    return run


def raw_redis(url: str) -> Callable[[int], None]:
    import redis

    client = redis.Redis.from_url(url)
    acquire = client.register_script(_REDIS_ACQUIRE)
    prefix = c.new_prefix()

    def run(count: int) -> None:
        for i in range(count):
            owner = f"o{i}"
            assert acquire(keys=[f"{{{prefix}}}:s", f"{{{prefix}}}:n"], args=[owner, LIMIT, TTL_MS])
            client.zrem(f"{{{prefix}}}:s", owner)

    return run


def raw_sqlite(path: Path) -> Callable[[int], None]:
    conn = sqlite3.connect(path, isolation_level=None, timeout=5)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(
        "CREATE TABLE IF NOT EXISTS sem (key TEXT, owner TEXT, exp INTEGER, "
        "PRIMARY KEY (key, owner))"
    )

    def run(count: int) -> None:
        for i in range(count):
            now = int(time.time() * 1000)
            conn.execute("BEGIN IMMEDIATE")
            conn.execute("DELETE FROM sem WHERE key = ? AND exp <= ?", ("k", now))
            (held,) = conn.execute("SELECT count(*) FROM sem WHERE key = ?", ("k",)).fetchone()
            assert held < LIMIT
            conn.execute("INSERT INTO sem VALUES (?, ?, ?)", ("k", f"o{i}", now + TTL_MS))
            conn.execute("COMMIT")
            conn.execute("DELETE FROM sem WHERE key = ? AND owner = ?", ("k", f"o{i}"))

    return run


def raw_postgres(dsn: str) -> Callable[[int], None]:
    import psycopg

    conn = psycopg.connect(dsn, autocommit=True)
    table = c.new_prefix("sem")
    conn.execute(
        f"CREATE TABLE {table} (key text, owner text, exp timestamptz, PRIMARY KEY (key, owner))"
    )

    def run(count: int) -> None:
        for i in range(count):
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", ("k",))
                conn.execute(f"DELETE FROM {table} WHERE key = %s AND exp <= now()", ("k",))
                got = conn.execute(
                    f"INSERT INTO {table} SELECT %s, %s, now() + interval '30 seconds' "
                    f"WHERE (SELECT count(*) FROM {table} WHERE key = %s) < %s RETURNING 1",
                    ("k", f"o{i}", "k", LIMIT),
                ).fetchone()
                assert got is not None
            conn.execute(f"DELETE FROM {table} WHERE key = %s AND owner = %s", ("k", f"o{i}"))

    return run


def handoff(url: str, rounds: int) -> list[float]:
    """Seconds from a release returning to the waiter's acquire returning."""
    return [_one_handoff(url) for _ in range(rounds)]


def _one_handoff(url: str) -> float:
    coord = idemlock.connect(url, key_prefix=c.new_prefix())
    sem = coord.semaphore(idemlock.SemaphoreSpec("bench", limit=2, ttl=30))
    held = [sem.acquire("k"), sem.acquire("k")]
    got: list[float] = []
    waiting = threading.Event()

    def waiter() -> None:
        waiting.set()
        assert sem.acquire("k", wait=30) is not None
        got.append(time.perf_counter())

    t = threading.Thread(target=waiter)
    t.start()
    waiting.wait()
    time.sleep(0.2)  # the waiter is blocked in its wait (a benchmark may sleep)
    assert held[0] is not None and sem.release(held[0])
    released = time.perf_counter()
    t.join(60)
    coord.close()
    return got[0] - released


_LEADER = """
import sys, time, idemlock
coord = idemlock.connect(sys.argv[1], key_prefix=sys.argv[2])
el = coord.election(idemlock.ElectionSpec("bench", ttl=float(sys.argv[3])))
with el.campaign("region", value="doomed"):
    print("leading", flush=True)
    time.sleep(3600)
"""


def failover(url: str, ttl: float, rounds: int) -> list[float]:
    """Seconds from a SIGKILL of the leader to a waiting candidate's election."""
    return [_one_failover(url, ttl) for _ in range(rounds)]


def _one_failover(url: str, ttl: float) -> float:
    prefix = c.new_prefix()
    leader = subprocess.Popen(
        [sys.executable, "-c", _LEADER, url, prefix, str(ttl)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(HERE.parent / "src")},
    )
    try:
        assert leader.stdout is not None and leader.stdout.readline().strip() == "leading"
        coord = idemlock.connect(url, key_prefix=prefix)
        el = coord.election(idemlock.ElectionSpec("bench", ttl=ttl))
        elected: list[float] = []

        def candidate() -> None:
            with el.campaign("region", value="next", wait=ttl * 10):
                elected.append(time.perf_counter())

        t = threading.Thread(target=candidate)
        t.start()
        time.sleep(0.3)  # the candidate waits in campaign()
        killed = time.perf_counter()
        leader.send_signal(signal.SIGKILL)
        t.join(ttl * 20)
        coord.close()
        return elected[0] - killed
    finally:
        leader.kill()
        leader.wait(30)


def observe(url: str, rounds: int, short: int = 20) -> dict[str, Any]:
    spec = idemlock.ElectionSpec("bench-observe", ttl=30)
    prefix = c.new_prefix()
    watcher = idemlock.connect(url, key_prefix=prefix)
    leader = idemlock.connect(url, key_prefix=prefix)
    seen: list[tuple[float, int, str | None]] = []  # (when, term, value); 0: no leader
    lock = threading.Lock()

    def watch() -> None:
        for now in watcher.election(spec).observe("k", timeout=600):
            with lock:
                term, value = (now.term, now.value) if now else (0, None)
                seen.append((time.perf_counter(), term, value))
            if now is not None and now.value == "end":
                return

    def seen_at(term: int, value: str, bound: float = 10.0) -> float:
        deadline = time.perf_counter() + bound
        while time.perf_counter() < deadline:
            with lock:
                hit = [t for t, n, v in seen if n == term and v == value]
            if hit:
                return hit[0]
            time.sleep(0.001)
        return float("inf")

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    while not seen:
        time.sleep(0.01)
    el = leader.election(spec)
    grants, values = [], []
    try:
        for i in range(rounds):
            with el.campaign("k", value=f"a{i}") as term:
                t0 = time.perf_counter()
                grants.append(seen_at(term.number, f"a{i}") - t0)
                term.proclaim(f"b{i}")
                t0 = time.perf_counter()
                values.append(seen_at(term.number, f"b{i}") - t0)
        numbers = []
        for i in range(short):
            with el.campaign("k", value=f"s{i}") as term:
                numbers.append(term.number)
                time.sleep(0.1)
        with el.campaign("k", value="end"):
            thread.join(30)
        with lock:
            got = {n for _, n, _ in seen}
        return {
            "grant_ms": [x * 1e3 for x in grants],
            "value_ms": [x * 1e3 for x in values],
            "short_seen": sum(n in got for n in numbers),
            "short": short,
        }
    finally:
        watcher.close()
        leader.close()


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="tiny rounds (CI)")
    ap.add_argument("--stores", default="sqlite,redis,postgres,etcd")
    ap.add_argument("--ttl", type=float, default=2.0, help="the leader's ttl, seconds (2)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--observe-only", action="store_true", help="only the Observe figure")
    opts = ap.parse_args()
    n, rounds, gap_rounds, fail_rounds = (100, 3, 3, 1) if opts.quick else (2000, 7, 20, 5)
    stores = opts.stores.split(",")
    out: dict[str, Any] = {"pairs": {}, "handoff": {}, "failover": {}, "observe": {}}
    with c.Servers("idemlock-permits-") as servers:
        for store in stores:
            if store == "sqlite":
                url, raw = (
                    f"sqlite:///{servers.tmp / 'ours.db'}",
                    raw_sqlite(servers.tmp / "raw.db"),
                )
            elif store == "redis":
                url = servers.start("redis").url
                raw = raw_redis(url)
            elif store == "postgres":
                url = servers.start("postgres").dsn
                raw = raw_postgres(url)
            elif store == "etcd":
                server = servers.start("etcd")
                url, raw = server.url, None
            else:
                raise SystemExit(f"unknown store {store!r}")
            if opts.observe_only:
                out["observe"][store] = observe(url, 20)
                continue
            fns = {"permit": ours(url, LIMIT), "lock": ours(url, 1)}
            if raw is not None:
                fns["hand-written"] = raw
            rates = c.interleave(fns, n, rounds, rotate=True)
            med = {k: statistics.median(v) for k, v in rates.items()}
            ratio = {
                k: statistics.median(a / b for a, b in zip(rates["permit"], rates[k], strict=True))
                for k in rates
                if k != "permit"
            }
            out["pairs"][store] = {"per_s": med, "permit_over": ratio}
            gaps = handoff(url, gap_rounds)
            out["handoff"][store] = {
                "median_ms": statistics.median(gaps) * 1e3,
                "max_ms": max(gaps) * 1e3,
            }
            fo = failover(url, opts.ttl, fail_rounds)
            out["failover"][store] = {
                "median_s": statistics.median(fo),
                "max_s": max(fo),
                "ttl_s": opts.ttl,
            }
            out["observe"][store] = observe(url, gap_rounds)
    _print_tables(out)
    if opts.json is not None:
        opts.json.write_text(json.dumps(out, indent=2) + "\n")


def _print_tables(out: dict[str, Any]) -> None:
    if out["pairs"]:
        _print_pairs(out)
    print(
        "| store | new term seen after, median ms | worst ms | new value, median ms |"
        " worst ms | 0.1 s terms seen |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for store, o in out["observe"].items():
        g, v = o["grant_ms"], o["value_ms"]
        cells = [f"{statistics.median(g):.1f}", f"{max(g):.1f}", f"{statistics.median(v):.1f}"]
        seen = f"{o['short_seen']} of {o['short']}"
        print("| " + " | ".join([store, *cells, f"{max(v):.1f}", seen]) + " |")


def _print_pairs(out: dict[str, Any]) -> None:
    head = "| store | permit pairs/s | lock pairs/s | hand-written pairs/s | permit/lock |"
    print(head + " permit/hand-written |")
    print("| --- | --- | --- | --- | --- | --- |")
    for store, row in out["pairs"].items():
        per, over = row["per_s"], row["permit_over"]
        hand = f"{per['hand-written']:.0f}" if "hand-written" in per else "-"
        hand_ratio = f"{over['hand-written']:.2f}" if "hand-written" in over else "-"
        cells = [store, f"{per['permit']:.0f}", f"{per['lock']:.0f}", hand]
        print("| " + " | ".join([*cells, f"{over['lock']:.2f}", hand_ratio]) + " |")
    print()
    print("| store | hand-off gap, median ms | worst ms | failover, median s | worst s | ttl s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for store in out["pairs"]:
        h, f = out["handoff"][store], out["failover"][store]
        cells = [f"{h['median_ms']:.1f}", f"{h['max_ms']:.1f}", f"{f['median_s']:.2f}"]
        print("| " + " | ".join([store, *cells, f"{f['max_s']:.2f}", f"{f['ttl_s']:g}"]) + " |")
    print()


if __name__ == "__main__":
    main()
