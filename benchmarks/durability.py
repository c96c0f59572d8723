"""The cost of ``durability=replicas:1`` on Redis (issue 26), and failover times.

    python benchmarks/durability.py [--calls 2000] [--failovers 3]

Starts a throwaway primary, a replica and three Sentinels (tests/servers/sentinel), then:

* per claim+complete, in one process, interleaved in rounds so the machine's load hits
  every subject alike: ``redis://`` straight to the primary (the store's own pipelined
  connections), ``redis+sentinel://`` with ``durability=none`` (redis-py's pooled
  connections) and with ``durability=replicas:1`` (each write and its ``WAIT`` in one
  pipeline);
* failover: SIGKILL of the primary, then calls until one succeeds on the new primary
  (the killed server comes back as a replica before the next round).

Prints medians and 95th percentiles in milliseconds, the ratio of medians, and the
failover times in seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.servers._proc import tempdir
from tests.servers.sentinel import SentinelGroup, start_sentinel_group

import idemlock

LONG = 60_000


def claim_complete(store: Any, ns: str, n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        token = f"aa{i:04x}"
        store.claim(ns, f"k{i}", None, token, LONG)
        store.complete(ns, f"k{i}", token, b"result", LONG)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def q95(xs: list[float]) -> float:
    return sorted(xs)[int(len(xs) * 0.95)]


def failover(group: SentinelGroup, url: str) -> float:
    coord = idemlock.connect(url)
    store: Any = coord._store
    ns = "f" + uuid.uuid4().hex[:8]
    try:
        store.acquire(ns, "k", "me", LONG)
        group.wait_in_sync()
        t0 = time.monotonic()
        old = group.kill_primary()
        while time.monotonic() - t0 < 60:
            try:
                store.acquire(ns, "k", "me", LONG)
                took = time.monotonic() - t0
                break
            except idemlock.StoreUnavailable:
                time.sleep(0.01)
        else:
            raise RuntimeError("no failover within 60 s")
        group.wait_failover(old)
        group.rejoin(old)
        return took
    finally:
        coord.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--failovers", type=int, default=3)
    args = ap.parse_args()
    with tempdir("il-durability-") as tmp:
        group = start_sentinel_group(Path(tmp))
        try:
            subjects = {
                "redis:// none": idemlock.connect(f"redis://127.0.0.1:{group.primary_port}/0"),
                "sentinel none": idemlock.connect(group.url()),
                "sentinel replicas:1": idemlock.connect(group.url("durability=replicas:1")),
            }
            times: dict[str, list[float]] = {name: [] for name in subjects}
            rounds = 10
            for _ in range(rounds):
                for name, coord in subjects.items():
                    ns = "b" + uuid.uuid4().hex[:8]
                    times[name] += claim_complete(coord._store, ns, args.calls // rounds)
            for coord in subjects.values():
                coord.close()
            med = {n: statistics.median(t) for n, t in times.items()}
            print("claim+complete, ms (median / p95):")
            for name, t in times.items():
                print(f"  {name:22} {med[name]:.3f} / {q95(t):.3f}")
            base = med["sentinel none"]
            print(f"  replicas:1 / sentinel none: {med['sentinel replicas:1'] / base:.2f}x")
            direct = med["sentinel replicas:1"] / med["redis:// none"]
            print(f"  replicas:1 / redis:// none: {direct:.2f}x")
            took = [failover(group, group.url("timeout=2")) for _ in range(args.failovers)]
            print(
                "failover, SIGKILL to the first call on the new primary, s:",
                [round(t, 2) for t in took],
            )
        finally:
            group.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
