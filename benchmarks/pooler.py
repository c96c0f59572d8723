"""PostgreSQL behind PgBouncer (issue 26): hand-off times and per-call cost.

    python benchmarks/pooler.py [--rounds 30] [--calls 2000]

Starts a throwaway PostgreSQL and a PgBouncer in transaction mode in front of it
(tests/servers/), then measures:

* hand-off: from a release to a waiter of another store (standing for another
  process) holding the lock: straight to PostgreSQL, through PgBouncer (no
  notifications: the listener pulses its waiters) and through PgBouncer with
  ``listen_url`` (notifications over a direct connection);
* per call: claim+complete round trips on one store, straight to PostgreSQL with
  prepared statements (what the store does there), straight without them
  (``prepare=False``: what never preparing would cost), and through PgBouncer.

Prints medians and 95th percentiles in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.servers.pgbouncer import start_pgbouncer
from tests.servers.postgres import start_postgres

import idemlock

LOCK = idemlock.LockSpec("bench", ttl=timedelta(seconds=30))
SPEC = idemlock.IdempotencySpec("bench", lease=timedelta(seconds=30))


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def handoffs(url: str, rounds: int, **options: Any) -> list[float]:
    prefix = "h" + uuid.uuid4().hex[:8]
    holder = idemlock.connect(url, key_prefix=prefix, **options)
    waiter = idemlock.connect(url, key_prefix=prefix, **options)
    out: list[float] = []
    try:
        for _ in range(rounds):
            lease = holder.lock(LOCK).acquire("k")
            assert lease is not None
            got: list[float] = []

            def wait(got: list[float] = got) -> None:
                took = waiter.lock(LOCK).acquire("k", wait=30)
                got.append(time.monotonic())
                assert took is not None
                waiter.lock(LOCK).release(took)

            thread = threading.Thread(target=wait)
            thread.start()
            listener = waiter.store.listener
            while not listener._core.has_waiters() or listener.notifies is None:
                time.sleep(0.005)
            time.sleep(0.05)  # the waiter is parked in its wait
            t0 = time.monotonic()
            holder.lock(LOCK).release(lease)
            thread.join()
            out.append((got[0] - t0) * 1000)
    finally:
        holder.close()
        waiter.close()
    return out


def calls(url: str, n: int, **options: Any) -> list[float]:
    coord = idemlock.connect(url, key_prefix="c" + uuid.uuid4().hex[:8], **options)
    port = coord.idempotency(SPEC)
    out: list[float] = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            claim = port.claim(f"k{i}")
            assert isinstance(claim, idemlock.Claimed)
            port.complete(claim.token, i)
            out.append((time.perf_counter() - t0) * 1000)
    finally:
        coord.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    server = start_postgres()
    bouncer = start_pgbouncer(server)
    try:
        listen = bouncer.dsn + "?listen_url=" + quote(server.dsn, safe="")
        print("hand-off (release -> waiter of another store holds the lock), ms")
        for name, url in (
            ("direct", server.dsn),
            ("pgbouncer", bouncer.dsn),
            ("pgbouncer + listen_url", listen),
        ):
            xs = handoffs(url, args.rounds)
            print(
                f"  {name:24} median {statistics.median(xs):7.1f}  p95 {_pct(xs, 0.95):7.1f}"
                f"  max {max(xs):7.1f}"
            )
        print("claim+complete on one store, ms per pair")
        runs: list[tuple[str, str, dict[str, Any]]] = [
            ("direct, prepared", server.dsn, {}),
            ("direct, prepare=False", server.dsn, {"prepare": False}),
            ("pgbouncer", bouncer.dsn, {}),
        ]
        results: dict[str, list[float]] = {name: [] for name, _, _ in runs}
        for _ in range(3):  # interleaved rounds: the machine's load hits all alike
            for name, url, options in runs:
                results[name] += calls(url, args.calls // 3, **options)
        for name, xs in results.items():
            print(f"  {name:24} median {statistics.median(xs):7.3f}  p95 {_pct(xs, 0.95):7.3f}")
    finally:
        bouncer.destroy()
        server.destroy()


if __name__ == "__main__":
    main()
