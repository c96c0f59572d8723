"""One command, one run: every benchmark scenario on every store, next to the peers.

    python benchmarks/report.py [--quick | --smoke] [--stores redis,postgres,...]
                                [--out docs/benchmarks.md] [--json docs/benchmarks.json]
                                [--png docs/benchmarks.png]

Starts its own throwaway servers (tests/servers/), runs each scenario of scenarios.py on
each store's subjects (subjects/), every figure a ratio against a baseline of the same
run (common.BASELINES), writes the JSON, then render.py's Markdown and PNG chart.
``--quick`` is the CI configuration; ``--smoke`` the smallest one, for the tests (every
scenario, figure and table, the figures meaningless); ``--stores`` runs a subset.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sqlite3
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(HERE.parent), str(HERE)) if p not in sys.path]

import common as c  # noqa: E402
import psycopg  # noqa: E402
import redis  # noqa: E402
from render import add_paths, write  # noqa: E402
from scenarios import Contenders, redis_memory, run_store, single_waiters, start_benches  # noqa: E402

import idemlock  # noqa: E402

FULL = c.Config(n=1000, rounds=7, job_n=500, seconds=5.0, count=50, scaled=True)
QUICK = c.Config(n=100, rounds=2, job_n=50, seconds=0.6, count=10, scaled=False)
#: one round of the fewest pairs the 100-task runs take; contention runs long enough for
#: every process to hold the lock on a loaded machine; round trips counted as in QUICK
SMOKE = c.Config(n=100, rounds=1, job_n=20, seconds=0.4, count=10, scaled=False)
DISTS = ("redis", "hiredis", "psycopg", "psycopg-pool", "asyncpg", "matplotlib")


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    configs = parser.add_mutually_exclusive_group()
    configs.add_argument("--quick", action="store_true", help="reduced configuration (CI)")
    configs.add_argument("--smoke", action="store_true", help="smallest configuration (tests)")
    add_paths(parser, "out", "json", "png")
    parser.add_argument(
        "--stores", default=",".join(c.STORES), help=f"comma-separated subset of {c.STORES}"
    )
    args = parser.parse_args(argv)
    stores = [s for s in c.STORES if s in args.stores.split(",")]
    cfg = SMOKE if args.smoke else QUICK if args.quick else FULL
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    import matplotlib  # noqa: F401  (the chart is part of the report: fail before the run)

    started, load_start = time.monotonic(), os.getloadavg()
    print(f"idemlock benchmark report ({mode}): {asdict(cfg)}; "
          f"{os.cpu_count()} cpus, load average {load_start[0]:.2f}")  # fmt: skip
    res = c.Results()
    versions = {"idemlock": idemlock.__version__, "sqlite": sqlite3.sqlite_version}
    versions |= {"redis-py" if d == "redis" else d: c.version(d) for d in DISTS}
    with c.Servers("idemlock-report-") as servers:
        benches = start_benches(servers, stores)
        # the standalone Redis, whose memory per key is measured too
        rt = benches["redis"].target() if "redis" in benches else None
        if rt is not None:
            with redis.Redis(port=rt["ports"][0]) as r:
                versions["redis-server"] = r.info("server")["redis_version"]
        if "postgres" in benches:
            with psycopg.connect(benches["postgres"].dsn) as conn:
                versions["postgresql"] = conn.execute("SHOW server_version").fetchone()[0]
        contenders = Contenders()
        servers.callback(contenders.close)
        single: dict[str, dict[str, float]] = {}
        single_peers: dict[str, dict[str, dict[str, float]]] = {}
        for name, bench in benches.items():
            print(f"{c.TITLE[name]}:")
            run_store(bench, cfg, res, contenders)
            if name != "memory":
                waits = single_waiters(bench, cfg, res, contenders)
                gap = ", ".join(
                    f"{k} {m['handoff_gap_median_ms']:.2f} ms" for k, m in waits.items()
                )
                print(f"  single waiter, gap median: {gap}")
                single[name] = waits.pop(c.OURS)
                single_peers[name] = waits
        memory = redis_memory(rt["url"], rt["ports"][0]) if rt is not None else []
    load_end = os.getloadavg()
    data = {
        "meta": {
            "command": "python benchmarks/report.py"
            + ("" if mode == "full" else f" --{mode}")
            + (f" --stores {','.join(stores)}" if stores != list(c.STORES) else ""),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "quick": mode != "full",
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
        "stores": stores,
        "scenarios": [{"scenario": s, "operation": o} for s, o in c.SCENARIOS],
        "baselines": c.BASELINES,
        "peers": c.peer_status(res),
        "results": res.rows,
        "not_run": res.not_run,
        "single_waiter": single,  # idemlock's; the other locks' beside it
        "single_waiter_peers": single_peers,
        "redis_memory": memory,
    }
    write(data, args.json, args.out, args.png)
    print(f"wrote {args.json}, {args.out}, {args.png} in {data['meta']['wall_seconds']:.0f} s; "
          f"load average {load_end[0]:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
