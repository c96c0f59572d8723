"""Issue 28's scale figures: how cost grows with the work, each with its goal.

    python benchmarks/scale.py [--quick | --smoke] [--sizes 10000,100000] [--only live]
                               [--arrival uniform] [--json PATH] [--doc PATH]

Starts its own throwaway servers (SQLite files, Redis, PostgreSQL) and prints one
Markdown table per figure:

* **Records**: claim+complete throughput and p99 latency with N live records (completed,
  within their ttl) in the store, for each N; one store per N, measured in interleaved
  rounds (N1 N2 N3, N2 N3 N1, N3 N1 N2, ...), so the growth factor (the median of the
  per-round ratios of the time per pair, largest N over smallest) is a same-round ratio.
  The pairs measured add their records too (rounds x pairs, a few thousand) to each
  store. Bytes per record: SQLite's file, PostgreSQL's claims table with its indexes,
  Redis's used_memory.
* **Purge**: ``purge()`` of N expired records in a process of its own (total time, its
  peak RSS growth) while this process claims and completes meanwhile (the worst call).
* **Live claims**: K claims held under ``port.run()`` in one coordinator, renewed by its
  heartbeat: store round trips per second (counted on the wire, as costs.py counts them)
  and this process's CPU per second, once every claim is held; the Python heap they hold.
  ``--arrival burst`` (the default) takes the claims one after the other as fast as the
  store answers; ``uniform`` spreads them evenly over one renewal interval, so each keeps
  a phase of its own (the pattern of claims that arrive steadily).

How the stores are filled: idemlock's public API writes one record (claim + complete),
then it is copied N times under fresh random UUID keys in the store's own layout: one
``INSERT`` from ``generate_series`` (PostgreSQL), ``executemany`` in one transaction
(SQLite), pipelined ``SET ... PX`` of the same value (Redis). Writing a million records
through the API would take longer than measuring them; the copies are byte for byte
what the API writes, but for the key.
``--quick`` is the CI configuration: tiny sizes, noisy figures; ``--smoke`` the smallest
(tests/test_scale.py): every figure of every store, the figures meaningless.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the tests' servers, then common and subjects

import common as c  # noqa: E402
import psycopg  # noqa: E402
import redis  # noqa: E402
from render import goals_section, table  # noqa: E402
from scale_fleet import (  # noqa: E402
    POOL_IDLE,
    Fleet,
    connections_table,
    measure_connections,
    measure_waiters,
    verdict,
    waiters_table,
)
from scenarios import start_benches  # noqa: E402

import idemlock  # noqa: E402
from idemlock import Claimed, IdempotencySpec  # noqa: E402
from idemlock.stores.redis import _common as RC  # noqa: E402


@dataclass(frozen=True)
class Config:
    sizes: tuple[int, ...]  # live records in the store, one store each
    n: int  # claim+complete pairs per store and round
    rounds: int  # interleaved rounds
    purge: int  # expired records purged
    live: int  # heartbeated claims held at once
    lease: float  # their lease (s): renewed every third of it


FULL = Config((10_000, 100_000, 1_000_000), 1000, 9, 1_000_000, 10_000, 30.0)
QUICK = Config((1_000, 10_000), 100, 2, 10_000, 200, 3.0)
#: two sizes still, one round; the live claims' lease keeps a renewal every 2/3 s
SMOKE = Config((500, 2_000), 100, 1, 2_000, 100, 2.0)
FLEET = {False: Fleet(10, 100, 5.0, 200, 5.0), True: Fleet(2, 5, 1.0, 4, 1.0)}  # by --quick
PARTS = "records,purge,live,waiters,connections"
STORES = ("sqlite", "postgres", "redis")
SPEC = IdempotencySpec("orders", ttl=timedelta(hours=1))
RESULT: Any = c.RESULT  # what every pair records
FLAT, WORST_MS, CORE, TRIPS = 1.15, 100.0, 0.1, 10.0  # the goals


def size(n: int) -> str:
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n // 1000}k" if n >= 1000 else str(n)


def proxy_cpu() -> float:
    """CPU seconds of this process's counting proxies (PostgreSQL's round trips are
    counted by a proxy thread in this process: not the client's work)."""
    total = 0
    for t in threading.enumerate():
        if t.name.startswith("tcp-proxy-") and t.native_id is not None:
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/self/task/{t.native_id}/stat").read_text()
                total += sum(int(v) for v in stat.rsplit(")", 1)[1].split()[11:13])
    return total / os.sysconf("SC_CLK_TCK")


# ---- a store per N: one record written by the API, copied N times ---------------------


class Store:
    """One store instance (a SQLite file, a PostgreSQL database, a Redis database) with
    a coordinator on it and the record its API wrote, to copy."""

    def __init__(self, kind: str, url: str, tag: str) -> None:
        self.kind, self.url = kind, url
        self.coord = idemlock.connect(url, key_prefix=tag)
        self.port = self.coord.idempotency(SPEC)
        claim = self.port.claim("sample", payload={"n": 1})
        assert isinstance(claim, Claimed)
        self.port.complete(claim.token, RESULT)
        self.ns = self.port._ns

    def close(self) -> None:
        self.coord.close()

    def fill(self, count: int, expired: bool = False) -> float:
        """Copy the sample record ``count`` times (``expired``: with its ttl past)."""
        start = time.perf_counter()
        getattr(self, "_fill_" + self.kind)(count, expired)
        return time.perf_counter() - start

    def _row(self, cur: Any, sql: str) -> tuple[Any, ...]:
        row = cur.execute(sql, (self.ns, "sample")).fetchone()
        assert row is not None, "the sample record is missing"
        return tuple(row)

    def _fill_sqlite(self, count: int, expired: bool) -> None:
        conn = sqlite3.connect(self.url.removeprefix("sqlite:///"), isolation_level=None)
        cols = "state, token, fence, fp, expires_ms, result"
        row = self._row(conn, f"SELECT {cols} FROM claims WHERE ns = ? AND key = ?")
        at = int(time.time() * 1000) - 60_000 if expired else row[4]
        rows = ((self.ns, str(uuid.uuid4()), *row[:4], at, row[5]) for _ in range(count))
        conn.execute("PRAGMA cache_size = -1048576")  # 1 GiB: random keys spill less
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(f"INSERT INTO claims (ns, key, {cols}) VALUES (?,?,?,?,?,?,?,?)", rows)
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.close()

    def _fill_postgres(self, count: int, expired: bool) -> None:
        cols = "state, token, fence, fp, expires_ms, result"
        with psycopg.connect(self.url, autocommit=True) as conn:
            sql = f"SELECT {cols} FROM idemlock.claims WHERE ns = %s AND key = %s"
            row = self._row(conn, sql)
            at = int(time.time() * 1000) - 60_000 if expired else row[4]
            conn.execute(
                f"INSERT INTO idemlock.claims (ns, key, {cols}) SELECT %s, gen_random_uuid()::text,"
                " %s, %s, %s, %s, %s, %s FROM generate_series(1, %s)",
                (self.ns, *row[:4], at, row[5], count),
            )
            conn.execute("VACUUM ANALYZE idemlock.claims")

    def _fill_redis(self, count: int, expired: bool) -> None:
        assert not expired, "Redis drops an expired key itself: nothing to purge"
        r = redis.Redis.from_url(self.url)
        name = RC.names(self.ns, "sample").claim
        value, ttl = r.get(name), r.pttl(name)
        assert value is not None and ttl > 0
        for start in range(0, count, 10_000):
            pipe = r.pipeline(transaction=False)
            for _ in range(min(10_000, count - start)):
                pipe.set(RC.names.__wrapped__(self.ns, str(uuid.uuid4())).claim, value, px=ttl)
            pipe.execute()
        r.close()

    def bytes_used(self) -> int:
        """The store's size: SQLite's file, PostgreSQL's claims table and indexes, Redis's
        used_memory."""
        if self.kind == "sqlite":
            path = self.url.removeprefix("sqlite:///")
            with contextlib.closing(sqlite3.connect(path)) as conn:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            return os.path.getsize(path)
        if self.kind == "postgres":
            with psycopg.connect(self.url, autocommit=True) as conn:
                row = conn.execute("SELECT pg_total_relation_size('idemlock.claims')").fetchone()
                return int(row[0]) if row else 0
        with redis.Redis.from_url(self.url) as r:
            return int(r.info("memory")["used_memory"])


def instances(kind: str, bench: Any, servers: c.Servers, count: int) -> list[Store]:
    """``count`` stores of ``kind``, empty but for the API's sample record."""
    out = []
    for i in range(count):
        if kind == "sqlite":
            url = bench.target()["url"]
        elif kind == "redis":
            url = bench.target()["url"].removesuffix("/0") + f"/{i + 1}"
        else:
            db = f"scale_{uuid.uuid4().hex[:8]}"
            with psycopg.connect(bench.dsn.rsplit("/", 1)[0] + "/postgres", autocommit=True) as a:
                a.execute(f"CREATE DATABASE {db}")
            url = bench.dsn.rsplit("/", 1)[0] + "/" + db
        store = Store(kind, url, c.new_prefix("s"))
        servers.callback(store.close)
        out.append(store)
    return out


# ---- records -------------------------------------------------------------------------


def pairs(port: Any, latencies: list[float]) -> c.SyncFn:
    """claim+complete on fresh keys, each pair's latency appended to ``latencies``."""

    def run(count: int) -> None:
        for _ in range(count):
            start = time.perf_counter()
            claim = port.claim(str(uuid.uuid4()))
            assert isinstance(claim, Claimed)
            port.complete(claim.token, RESULT)
            latencies.append(time.perf_counter() - start)

    return run


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) > 1 else math.nan


def measure_records(kind: str, bench: Any, servers: c.Servers, cfg: Config) -> dict[str, Any]:
    stores = instances(kind, bench, servers, len(cfg.sizes))
    out: dict[str, Any] = {"store": kind, "sizes": list(cfg.sizes), "fill_s": [], "bytes": []}
    for store, n in zip(stores, cfg.sizes, strict=True):
        before = store.bytes_used()
        out["fill_s"].append(store.fill(n))
        out["bytes"].append((store.bytes_used() - before) / n)
        print(f"  {c.TITLE[kind]}: {size(n)} records in {out['fill_s'][-1]:.1f} s", flush=True)
    lat: dict[str, list[float]] = {size(n): [] for n in cfg.sizes}
    fns = {size(n): pairs(s.port, lat[size(n)]) for s, n in zip(stores, cfg.sizes, strict=True)}
    rates = c.interleave(fns, cfg.n, cfg.rounds, rotate=True)
    warm = max(50, cfg.n // 20)  # interleave's warm-up pairs, not counted
    small, large = size(cfg.sizes[0]), size(cfg.sizes[-1])
    out["pairs_per_s"] = [statistics.median(rates[size(n)]) for n in cfg.sizes]
    out["p99_ms"] = [p99(lat[size(n)][warm:]) * 1000 for n in cfg.sizes]
    out["pairs"] = [len(lat[size(n)]) - warm for n in cfg.sizes]
    out["growth_time"] = c.ratio(rates, small, large)  # time per pair, largest / smallest
    out["growth_p99"] = out["p99_ms"][-1] / out["p99_ms"][0]
    out["growth_bytes"] = out["bytes"][-1] / out["bytes"][0]
    return out


def records_table(rows: list[dict[str, Any]]) -> str:
    sizes = rows[0]["sizes"]
    cells = []
    for r in rows:
        title = c.TITLE[r["store"]]
        for what, key, fmt, growth, goal in (
            ("claim+complete throughput", "pairs_per_s", "{:.0f}/s", "growth_time", True),
            ("p99 claim+complete", "p99_ms", "{:.2f} ms", "growth_p99", True),
            ("bytes per record", "bytes", "{:.0f} B", "growth_bytes", False),
        ):
            g = r[growth]
            cells.append([
                title, what, *(fmt.format(v) for v in r[key]), f"{g:.2f}{c.X}",
                f"≤ {FLAT:.2f}{c.X}" if goal else "—",
                verdict(g, FLAT, c.X) if goal else "reference",
            ])  # fmt: skip
    head = f"store|figure|{'|'.join(size(n) for n in sizes)}|growth|goal|verdict"
    return table(head, cells, right=2)


# ---- purge ---------------------------------------------------------------------------

PURGER = """
import json, sys, time
from pathlib import Path
import idemlock
def rss(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
coord = idemlock.connect(sys.argv[1], key_prefix="purger")
coord.idempotency("warm").status("warm")  # connections open, schema checked
try:
    Path("/proc/self/clear_refs").write_text("5")  # the peak RSS starts again from here
except OSError:
    pass
before, start = rss("VmRSS"), time.perf_counter()
removed = coord.purge()
took = time.perf_counter() - start
print(json.dumps({"removed": removed, "seconds": took, "peak_kib": rss("VmHWM") - before}))
"""


def measure_purge(kind: str, bench: Any, servers: c.Servers, cfg: Config) -> dict[str, Any]:
    """Purge ``cfg.purge`` expired records in a process of its own while a caller here
    claims and completes on the same store: its worst call (claim or complete) meanwhile."""
    (store,) = instances(kind, bench, servers, 1)
    fill = store.fill(cfg.purge, expired=True)
    print(f"  {c.TITLE[kind]}: {size(cfg.purge)} expired records in {fill:.1f} s", flush=True)
    worst, errors, calls, stop = [0.0], [], [0], threading.Event()

    def timed(call: Callable[..., Any], *args: Any) -> Any:
        """One call, its time kept if the worst; a store error counts as its wait."""
        start = time.perf_counter()
        try:
            return call(*args)
        except idemlock.IdemlockError as exc:
            errors.append(c._why(exc))
            return None
        finally:
            worst[0] = max(worst[0], time.perf_counter() - start)
            calls[0] += 1

    def caller() -> None:  # both calls timed: the purge may block either
        while not stop.is_set():
            claim = timed(store.port.claim, str(uuid.uuid4()))
            if isinstance(claim, Claimed):
                timed(store.port.complete, claim.token, RESULT)

    thread = threading.Thread(target=caller, name="scale-caller")
    thread.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", PURGER, store.url],
            capture_output=True, text=True, check=True, timeout=1800,
        )  # fmt: skip
    finally:
        stop.set()
        thread.join()
    got = json.loads(proc.stdout)
    return {"store": kind, "records": cfg.purge, "removed": got["removed"],
            "seconds": got["seconds"], "peak_rss_mib": got["peak_kib"] / 1024,
            "worst_call_ms": worst[0] * 1000, "calls": calls[0], "errors": errors[:3],
            "error_count": len(errors)}  # fmt: skip


def purge_table(rows: list[dict[str, Any]]) -> str:
    cells = [
        [c.TITLE[r["store"]], f"{r['removed']:,}", f"{r['seconds']:.2f} s",
         f"{r['removed'] / r['seconds']:,.0f}/s", f"{r['peak_rss_mib']:.1f} MiB",
         f"{r['worst_call_ms']:.1f} ms ({r['calls']} calls"
         + (f", {r['error_count']} failed" if r["error_count"] else "") + ")",
         f"≤ {WORST_MS:.0f} ms", verdict(r["worst_call_ms"], WORST_MS, " ms")]
        for r in rows
    ]  # fmt: skip
    head = "store|purged|time|rate|peak RSS growth|worst call meanwhile|goal|verdict"
    return table(head, cells, right=1)


# ---- live claims ---------------------------------------------------------------------


@contextlib.contextmanager
def held(port: Any, count: int, spread: float = 0.0) -> Iterator[list[Any]]:
    """``count`` claims held under ``port.run()`` (heartbeated), left in reverse order;
    with ``spread``, the i-th is taken no sooner than ``i * spread / count`` s after the
    first."""
    blocks, attempts = [], []
    start = time.perf_counter()
    try:
        for i in range(count):
            if spread:
                ahead = start + i * spread / count - time.perf_counter()
                if ahead > 0:
                    time.sleep(ahead)
            block = port.run(f"live-{i}", payload={})
            attempts.append(block.__enter__())
            blocks.append(block)
        yield attempts
    finally:
        for block in reversed(blocks):
            block.__exit__(None, None, None)


def measure_live(kind: str, bench: Any, cfg: Config, arrival: str = "burst") -> dict[str, Any]:
    spec = IdempotencySpec("live", lease=timedelta(seconds=cfg.lease))
    interval = cfg.lease / 3  # the default renew_every
    spread = interval if arrival == "uniform" else 0.0
    with bench.counting() as (count, target):
        coord = idemlock.connect(target["url"], key_prefix=c.new_prefix("live"))
        try:
            port = coord.idempotency(spec)
            port.claim("warm")  # connections open, schema made
            tracemalloc.start()  # while the claims are taken only: it slows every allocation
            start = time.perf_counter()
            with held(port, cfg.live, spread) as attempts:
                entered = time.perf_counter() - start
                per_claim = tracemalloc.get_traced_memory()[0] / cfg.live
                tracemalloc.stop()
                time.sleep(interval)  # every claim renewed at least once from here
                trips, wall = count(), time.perf_counter()
                cpu = time.process_time() - proxy_cpu()
                time.sleep(2 * interval)
                wall = time.perf_counter() - wall
                trips, cpu = count() - trips, time.process_time() - proxy_cpu() - cpu
                # the proxy's CPU comes off this process's: when ours is near nil the
                # two clocks' ticks can leave it a hair below zero
                cpu = max(cpu, 0.0)
                lost = sum(bool(a.lost) for a in attempts)
        finally:
            coord.close()
    return {"store": kind, "claims": cfg.live, "lease_s": cfg.lease, "arrival": arrival,
            "enter_s": entered,
            "window_s": wall, "round_trips_per_s": trips / wall, "cpu_cores": cpu / wall,
            "heap_bytes_per_claim": per_claim, "lost": lost}  # fmt: skip


def live_table(rows: list[dict[str, Any]]) -> str:
    cells = []
    for r in rows:
        judged = r["store"] in ("redis", "postgres")
        trips, cores = r["round_trips_per_s"], r["cpu_cores"]
        short = [
            v for v in (verdict(trips, TRIPS, "/s"), verdict(cores, CORE, " core")) if v != "MEETS"
        ]
        cells.append([
            c.TITLE[r["store"]], f"{r['claims']:,}", f"{r['enter_s']:.1f} s",
            f"{r['lease_s']:g} s", f"{trips:.2f}",
            f"{cores:.3f}", f"{r['heap_bytes_per_claim']:.0f} B", str(r["lost"]),
            f"≤ {TRIPS:g}/s, ≤ {CORE:g} core" if judged else "—",
            ("; ".join(short) or "MEETS") if judged else "reference",
        ])  # fmt: skip
    head = "store|live claims|taken in|lease|round trips/s|client CPU (cores)|heap per claim|lost"
    return table(head + "|goal|verdict", cells, right=1)


# ---- connections ---------------------------------------------------------------------


def connections(pg: Any, servers: c.Servers, fleet: Fleet) -> list[dict[str, Any]]:
    """The connections figure straight to PostgreSQL and through a PgBouncer (transaction
    mode, its default pool of 20 server connections per database and user), each on a
    database of its own."""
    from tests.servers.pgbouncer import start_pgbouncer

    bouncer = start_pgbouncer(pg)  # max_client_conn 500: 200 x 2
    servers.callback(bouncer.destroy)
    admin, out = pg.dsn_at(database="postgres"), []
    for how, port in (("straight", None), ("through PgBouncer", bouncer.port)):
        db = f"conn_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {db}")
        out.append(measure_connections(pg.dsn_at(port, db), admin, db, how, fleet))
    return out


# ---- the command ---------------------------------------------------------------------


def markdown(report: dict[str, Any], cfg: Config) -> str:
    return (
        (
            f"### Records: {cfg.rounds} interleaved rounds of {cfg.n} claim+complete pairs\n\n"
            f"{records_table(report['records'])}\n\n"
            if report["records"]
            else ""
        )
        + (
            "### Purge (Redis expires records itself: its purge() does nothing)\n\n"
            f"{purge_table(report['purge'])}\n\n"
            if report["purge"]
            else ""
        )
        + (
            f"### Live claims: held under port.run(), renewed every {cfg.lease / 3:g} s, "
            f"{report['arrival']} arrivals\n\n{live_table(report['live'])}\n\n"
            if report["live"]
            else ""
        )
        + (
            "### Waiters: every task waits once on one lock (acquire(wait=...)), holds ~1 ms"
            "\n\nStore work is counted from the first release to the last; waiters woken per "
            "release cannot be seen from outside the store, but each woken waiter makes at "
            "least one attempt, so the work per hand-off less the release bounds it.\n\n"
            f"{waiters_table(report['waiters'])}\n\n"
            if report["waiters"]
            else ""
        )
        + (
            "### Connections: one coordinator per process, 2 threads claiming at once, on "
            f"one PostgreSQL database; pool idle timeout: {POOL_IDLE}\n\n"
            f"{connections_table(report['connections'])}"
            if report["connections"]
            else ""
        )
    ).rstrip()


def write_doc(path: Path, how: str, tables: str) -> None:
    """Replace (or add, at the end) the scale section of ``path``."""
    section = (
        f"{c.SCALE_START}\n## Scale: how cost grows\n\nGenerated by {how}. Records: one "
        "store per size, filled by copying a record the API wrote under fresh UUID keys; "
        "growth is the time per claim+complete pair (the median of per-round ratios, the "
        "order of the stores turning each round) and the p99, at the largest size over the "
        "smallest. Purge: `purge()` in a process of its own (peak RSS growth: its VmHWM "
        "over its RSS before) while this one claims and completes on the same store; the "
        "worst of those calls is judged. Live claims: held under `port.run()` in one "
        "coordinator; round trips counted on the wire (Redis: requests written; PostgreSQL: "
        "request/response turns through a counting proxy; SQLite: transactions) and this "
        "process's CPU, over two renewal intervals once every claim is held.\n\n"
        f"{tables}\n{c.SCALE_END}"
    )
    text = path.read_text() if path.exists() else ""
    old = goals_section(text, c.SCALE_START, c.SCALE_END)
    path.write_text(text.replace(old, section) if old else f"{text.rstrip()}\n\n{section}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    configs = parser.add_mutually_exclusive_group()
    configs.add_argument("--quick", action="store_true", help="tiny sizes (CI)")
    configs.add_argument("--smoke", action="store_true", help="smallest sizes (tests)")
    parser.add_argument("--sizes", help="live records, comma-separated (default 10k,100k,1M)")
    parser.add_argument("--only", default=PARTS, help=f"parts to run, comma-separated (of {PARTS})")
    parser.add_argument(
        "--fleet", help="waiters: processes,tasks; connections: processes (e.g. 10,100,200)"
    )
    parser.add_argument(
        "--arrival", choices=("burst", "uniform"), default="burst",
        help="live claims: taken back to back, or spread evenly over one renewal interval",
    )  # fmt: skip
    parser.add_argument("--stores", default=",".join(STORES), help="stores, comma-separated")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--doc", type=Path, help="write the tables into this file's scale section")
    args = parser.parse_args(argv)
    if args.doc and (args.only != PARTS or args.fleet or args.stores != ",".join(STORES)):
        parser.error("--doc writes the whole section: run every part on every store")
    cfg = SMOKE if args.smoke else QUICK if args.quick else FULL
    if args.sizes:
        sizes = tuple(sorted(int(s) for s in args.sizes.split(",")))
        cfg = Config(sizes, cfg.n, cfg.rounds, sizes[-1], cfg.live, cfg.lease)
    fleet = FLEET[args.quick or args.smoke]
    if args.fleet:
        procs, tasks, conns = (int(v) for v in args.fleet.split(","))
        fleet = Fleet(procs, tasks, fleet.settle, conns, fleet.idle)
    started, load = time.monotonic(), os.getloadavg()[0]
    print(f"idemlock scale: {cfg}; {fleet}; load average {load:.2f}", flush=True)
    report: dict[str, Any] = {
        "config": cfg.__dict__, "fleet": fleet.__dict__, "arrival": args.arrival,
        "records": [], "purge": [], "live": [], "waiters": [], "connections": [],
    }  # fmt: skip
    parts = set(args.only.split(","))
    stores = [s for s in STORES if s in args.stores.split(",")]
    with c.Servers("idemlock-scale-") as servers:
        benches = start_benches(servers, stores)
        for kind in stores if "records" in parts else ():
            print(f"records: {c.TITLE[kind]} ({time.monotonic() - started:.0f} s)", flush=True)
            report["records"].append(measure_records(kind, benches[kind], servers, cfg))
        for kind in stores if "purge" in parts else ():
            if kind == "redis":  # Redis expires records itself: no purge
                continue
            print(f"purge: {c.TITLE[kind]} ({time.monotonic() - started:.0f} s)", flush=True)
            report["purge"].append(measure_purge(kind, benches[kind], servers, cfg))
        for kind in stores if "live" in parts else ():
            print(f"live claims: {c.TITLE[kind]} ({time.monotonic() - started:.0f} s)", flush=True)
            report["live"].append(measure_live(kind, benches[kind], cfg, args.arrival))
        for kind in stores if "waiters" in parts else ():
            print(f"waiters: {c.TITLE[kind]} ({time.monotonic() - started:.0f} s)", flush=True)
            report["waiters"].append(measure_waiters(kind, benches[kind], fleet))
        if "connections" in parts and "postgres" in stores:
            print(f"connections ({time.monotonic() - started:.0f} s)", flush=True)
            report["connections"] = connections(benches["postgres"].server, servers, fleet)
    took, load_end = time.monotonic() - started, os.getloadavg()[0]
    how = (
        f"`python benchmarks/scale.py{''.join(' ' + a for a in sys.argv[1:] if argv is None)}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in {took:.0f} s (load average "
        f"{load:.2f} at start, {load_end:.2f} at end, {os.cpu_count()} CPUs)"
    )
    report["how"] = how
    tables = markdown(report, cfg)
    print(f"\nmeasured {how}\n\n{tables}")
    if args.doc:
        write_doc(args.doc, how, tables)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
