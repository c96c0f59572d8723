"""Heartbeat cost: 1,000 live claims kept alive by one coordinator's renewer, against
1,000 independent renew loops doing the same renewals (issue 11).

    python benchmarks/bench_heartbeats.py [--claims 1000] [--seconds 6] [--lease 3]
                                          [--rounds 2] [--stores redis,sqlite]

For each store (a throwaway redis-server from tests/servers, a SQLite file) and each
face (asyncio, threads), both sides hold ``--claims`` claims with ``--lease`` (renewed
every lease/3) for ``--seconds`` and count:

* client round trips per second (the renewer counts its batches; a loop makes one
  ``extend`` call per renewal),
* for Redis, the commands the server processed per second (``INFO stats``),
* client CPU (process time per wall second, so 1.0 = one core busy),
* claims lost: a renewal refused (the key was taken over) or, for the loops, none got
  through in time (1,000 threads share one connection pool).

``renewer`` is ``port.run()`` blocks (the renewer renews everything due in one
``renew_many``); ``loops`` is the baseline: per claim, a task or a thread sleeping
``lease/3`` and calling ``port.extend`` (what an application without a shared renewer
writes). Rounds are interleaved (renewer, loops, renewer, ...) and the median is
printed with the ratio loops / renewer measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.servers.redis import start_redis  # noqa: E402

import idemlock  # noqa: E402
import idemlock.aio  # noqa: E402
from idemlock import Claimed, IdempotencySpec, StaleClaim, StoreUnavailable  # noqa: E402


@dataclass
class Sample:
    trips: float  # client round trips per second
    server: float  # server commands per second (Redis only, else 0)
    cpu: float  # client CPU seconds per wall second
    lost: int = 0  # claims whose renewal failed or was refused (their key was at risk)


@dataclass
class Outcome:
    trips: int
    lost: int


class Counter:
    """Server-side command count (Redis INFO), or nothing."""

    def __init__(self, url: str) -> None:
        self.client: Any = None
        if url.startswith("redis"):
            import redis

            self.client = redis.Redis.from_url(url)

    def read(self) -> int:
        if self.client is None:
            return 0
        return int(self.client.info("stats")["total_commands_processed"])


def measure(run: Callable[[], Outcome], seconds: float, counter: Counter) -> Sample:
    c0, t0, p0 = counter.read(), time.monotonic(), time.process_time()
    out = run()
    wall = time.monotonic() - t0
    cpu = time.process_time() - p0
    return Sample(out.trips / wall, (counter.read() - c0) / wall, cpu / wall, out.lost)


def spec_for(lease: float) -> IdempotencySpec:
    return IdempotencySpec("bench-hb", ttl=timedelta(minutes=5), lease=timedelta(seconds=lease))


# ---- asyncio ----------------------------------------------------------------------------


def async_renewer(url: str, n: int, seconds: float, lease: float) -> Callable[[], Outcome]:
    def run() -> Outcome:
        async def main() -> Outcome:
            coord = idemlock.aio.connect(url, key_prefix="hb" + uuid.uuid4().hex[:8])
            port = coord.idempotency(spec_for(lease))
            lost = 0
            try:

                async def one(i: int) -> None:
                    nonlocal lost
                    async with port.run(f"k{i}", payload={}, cancel_on_lost=False) as attempt:
                        await asyncio.sleep(seconds)
                        lost += attempt.lost
                        attempt.result = i

                await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
                # claims and completes are the same on both sides: count renewals only
                return Outcome(coord._renewer.round_trips, lost)
            finally:
                await coord.close()

        return asyncio.run(main())

    return run


def async_loops(url: str, n: int, seconds: float, lease: float) -> Callable[[], Outcome]:
    def run() -> Outcome:
        async def main() -> Outcome:
            coord = idemlock.aio.connect(url, key_prefix="hb" + uuid.uuid4().hex[:8])
            port = coord.idempotency(spec_for(lease))
            every = lease / 3
            trips = 0
            lost = 0
            try:

                async def one(i: int) -> None:
                    nonlocal trips, lost
                    claim = await port.claim(f"k{i}", payload={})
                    assert isinstance(claim, Claimed)
                    token = claim.token
                    end = time.monotonic() + seconds
                    while True:
                        left = end - time.monotonic()
                        if left <= 0:
                            break
                        await asyncio.sleep(min(every, left))
                        if time.monotonic() < end:
                            trips += 1
                            try:
                                token = await port.extend(token)
                            except StoreUnavailable:
                                continue  # retried at the next interval
                            except StaleClaim:
                                lost += 1
                                return
                    with contextlib.suppress(StaleClaim, StoreUnavailable):
                        await port.complete(token, i)

                await asyncio.gather(*(one(i) for i in range(n)))
                return Outcome(trips, lost)
            finally:
                await coord.close()

        return asyncio.run(main())

    return run


# ---- threads ----------------------------------------------------------------------------


def sync_renewer(url: str, n: int, seconds: float, lease: float) -> Callable[[], Outcome]:
    def run() -> Outcome:
        coord = idemlock.connect(url, key_prefix="hb" + uuid.uuid4().hex[:8])
        port = coord.idempotency(spec_for(lease))
        lost = 0
        try:
            with ExitStack() as stack:
                attempts = [stack.enter_context(port.run(f"k{i}", payload={})) for i in range(n)]
                time.sleep(seconds)
                for i, attempt in enumerate(attempts):
                    lost += attempt.lost
                    attempt.result = i
            return Outcome(coord._renewer.round_trips, lost)
        finally:
            coord.close()

    return run


def sync_loops(url: str, n: int, seconds: float, lease: float) -> Callable[[], Outcome]:
    def run() -> Outcome:
        coord = idemlock.connect(url, key_prefix="hb" + uuid.uuid4().hex[:8])
        port = coord.idempotency(spec_for(lease))
        every = lease / 3
        trips = [0] * n
        lost = [0] * n
        try:
            claims = []
            for i in range(n):
                claim = port.claim(f"k{i}", payload={})
                assert isinstance(claim, Claimed)
                claims.append(claim.token)
            end = time.monotonic() + seconds
            stop = threading.Event()

            def loop(i: int) -> None:
                token = claims[i]
                while not stop.wait(min(every, max(0.0, end - time.monotonic()))):
                    if time.monotonic() >= end:
                        break
                    trips[i] += 1
                    try:
                        token = port.extend(token)
                    except StoreUnavailable:
                        continue  # (the pool ran out of connections) retried next interval
                    except StaleClaim:
                        lost[i] = 1
                        break
                claims[i] = token

            threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for i, token in enumerate(claims):
                with contextlib.suppress(StaleClaim, StoreUnavailable):
                    port.complete(token, i)
            return Outcome(sum(trips), sum(lost))
        finally:
            coord.close()

    return run


# ---- the report -------------------------------------------------------------------------


def median(samples: list[Sample]) -> Sample:
    return Sample(
        statistics.median(s.trips for s in samples),
        statistics.median(s.server for s in samples),
        statistics.median(s.cpu for s in samples),
        max(s.lost for s in samples),
    )


def ratio(a: float, b: float) -> str:
    return f"{a / b:8.1f}x" if b else "       -"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--claims", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--lease", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--stores", default="redis,sqlite")
    args = ap.parse_args()
    n, secs, lease = args.claims, args.seconds, args.lease
    with tempfile.TemporaryDirectory() as tmp:
        urls: dict[str, str] = {}
        server = None
        stores = args.stores.split(",")
        if "redis" in stores:
            server = start_redis(Path(tmp) / "redis")
            urls["redis"] = server.url
        if "sqlite" in stores:
            urls["sqlite"] = f"sqlite:///{Path(tmp) / 'hb.db'}"
        if "memory" in stores:
            urls["memory"] = "memory://"
        print(
            f"{n} live claims, lease {lease:g}s (renewed every {lease / 3:g}s), held "
            f"{secs:g}s, median of {args.rounds} interleaved rounds"
        )
        print(
            f"{'store':8} {'face':8} {'side':9} {'trips/s':>10} {'server cmd/s':>13} "
            f"{'client CPU':>11} {'lost':>5}"
        )
        try:
            for name, url in urls.items():
                counter = Counter(url)
                for face, ours, theirs in (
                    ("asyncio", async_renewer, async_loops),
                    ("threads", sync_renewer, sync_loops),
                ):
                    got: dict[str, list[Sample]] = {"renewer": [], "loops": []}
                    for _ in range(args.rounds):
                        got["renewer"].append(measure(ours(url, n, secs, lease), secs, counter))
                        got["loops"].append(measure(theirs(url, n, secs, lease), secs, counter))
                    r, b = median(got["renewer"]), median(got["loops"])
                    for side, s in (("renewer", r), ("loops", b)):
                        print(
                            f"{name:8} {face:8} {side:9} {s.trips:10.1f} {s.server:13.1f} "
                            f"{s.cpu:10.2f} {s.lost:5d}"
                        )
                    print(
                        f"{name:8} {face:8} {'loops/ours':9} {ratio(b.trips, r.trips):>10} "
                        f"{ratio(b.server, r.server):>13} {ratio(b.cpu, r.cpu):>11}"
                    )
        finally:
            if server is not None:
                server.stop()


if __name__ == "__main__":
    main()
