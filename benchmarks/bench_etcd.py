"""etcd store benchmark: one command, one throwaway etcd (tests/servers/etcd.py).

    python benchmarks/bench_etcd.py [--n 500] [--rounds 5] [--members 1]

Measures acquire+release and claim+complete per second through idemlock's public API
(sync, one thread; asyncio, 1 task and 50 tasks), next to the baseline: raw gRPC
calls on the same generated stubs sending the same requests idemlock sends, the same
number of round trips (a lease grant and a Txn per transition; the lease revokes that
idemlock sends in the background are sent the same way). The ratio is idemlock /
baseline: what idemlock's Python costs on top of the round trips it cannot avoid.

Runs are interleaved round by round (A, B, A, B, ...) and the median round is
reported, so a noisy machine moves both sides alike.
"""

from __future__ import annotations

import argparse
import asyncio
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

import grpc  # noqa: E402
import grpc.aio  # noqa: E402
from tests.servers.etcd import start_etcd  # noqa: E402

import idemlock  # noqa: E402
import idemlock.aio  # noqa: E402
from idemlock import Claimed, IdempotencySpec, LockSpec  # noqa: E402
from idemlock.stores.etcd import _codec as K  # noqa: E402
from idemlock.stores.etcd._pb.etcdserverpb import rpc_pb2 as pb  # noqa: E402
from idemlock.stores.etcd._pb.etcdserverpb import rpc_pb2_grpc as stubs  # noqa: E402

LOCK = LockSpec("bench", ttl=timedelta(seconds=30))
SPEC = IdempotencySpec("bench", ttl=timedelta(hours=1), lease=timedelta(seconds=30))


# ---- the baseline: the same requests on raw stubs ------------------------------------------


class Raw:
    def __init__(self, endpoint: str) -> None:
        self.ch = grpc.insecure_channel(endpoint)
        self.kv, self.lease = stubs.KVStub(self.ch), stubs.LeaseStub(self.ch)
        self.pending: list[Any] = []

    def acquire_release(self, key: bytes) -> None:
        g = self.lease.LeaseGrant(pb.LeaseGrantRequest(TTL=30), timeout=5)
        value = K.lock_value("owner", 30_000, 30, K.now_ms())
        r = self.kv.Txn(
            K.txn([K.cmp_create(key, 0)], [K.put(key, value, g.ID)], [K.get(key)]), timeout=5
        )
        token = r.header.revision
        self.kv.Txn(
            K.txn(
                [K.cmp_create(key, token), *K.cmp_starts(key, K.owner_prefix("owner"))],
                [K.delete(key, prev=True)],
                [],
            ),
            timeout=5,
        )
        self.pending.append(self.lease.LeaseRevoke.future(pb.LeaseRevokeRequest(ID=g.ID)))

    def claim_complete(self, base: bytes) -> None:
        rec, marker = base + b"r", base + b"t"
        g = self.lease.LeaseGrant(pb.LeaseGrantRequest(TTL=30), timeout=5)
        r = self.kv.Txn(
            K.txn(
                [K.cmp_create(rec, 0)],
                [
                    K.put(rec, K.inflight_value("tok", "fp")),
                    K.put(marker, K.marker_value(30_000, 30, K.now_ms()), g.ID),
                ],
                [K.get(rec), K.get(marker)],
            ),
            timeout=5,
        )
        fence = r.header.revision
        g2 = self.lease.LeaseGrant(pb.LeaseGrantRequest(TTL=3600), timeout=5)
        done = K.done_value("tok", fence, "fp", b'{"ok":1}', 3_600_000, 3600, K.now_ms())
        self.kv.Txn(
            K.txn(
                [K.cmp_mod(rec, fence), *K.cmp_starts(rec, K.token_prefix("tok"))],
                [K.put(rec, done, g2.ID), K.delete(marker, prev=True)],
                [K.get(rec)],
            ),
            timeout=5,
        )
        self.pending.append(self.lease.LeaseRevoke.future(pb.LeaseRevokeRequest(ID=g.ID)))

    def drain(self) -> None:
        for f in self.pending:
            f.result()
        self.pending.clear()


def run_sync(fn: Callable[[int], None], n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return n / (time.perf_counter() - t0)


async def run_async(fn: Callable[[int], Awaitable[None]], n: int, tasks: int) -> float:
    async def worker(w: int) -> None:
        for i in range(w, n, tasks):
            await fn(i)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(tasks)))
    return n / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--members", type=int, default=1, choices=(1, 3))
    args = ap.parse_args()
    cluster = start_etcd(args.members)
    try:
        url, endpoint = cluster.url, cluster.endpoints[0]
        coord = idemlock.connect(url, key_prefix="bench")
        locks, port = coord.lock(LOCK), coord.idempotency(SPEC)
        raw = Raw(endpoint)

        def ours_lock(i: int) -> None:
            lease = locks.acquire(f"l{i}")
            assert lease is not None
            locks.release(lease)

        def ours_job(i: int) -> None:
            claim = port.claim(f"{uuid.uuid4().hex}")
            assert isinstance(claim, Claimed)
            port.complete(claim.token, {"ok": 1})

        def raw_lock(i: int) -> None:
            raw.acquire_release(b"rawbench/l/" + str(i).encode())

        def raw_job(i: int) -> None:
            raw.claim_complete(b"rawbench/c/" + uuid.uuid4().hex.encode() + b"\0")

        results: dict[str, list[float]] = {}
        for _ in range(args.rounds):
            for name, fn in (
                ("acquire+release idemlock sync", ours_lock),
                ("acquire+release raw gRPC sync", raw_lock),
                ("claim+complete idemlock sync", ours_job),
                ("claim+complete raw gRPC sync", raw_job),
            ):
                results.setdefault(name, []).append(run_sync(fn, args.n))
                raw.drain()

        async def amain() -> None:
            acoord = idemlock.aio.connect(url, key_prefix="abench")
            alocks, aport = acoord.lock(LOCK), acoord.idempotency(SPEC)

            async def a_lock(i: int) -> None:
                lease = await alocks.acquire(f"al{i}-{uuid.uuid4().hex[:6]}")
                assert lease is not None
                await alocks.release(lease)

            async def a_job(i: int) -> None:
                claim = await aport.claim(uuid.uuid4().hex)
                assert isinstance(claim, Claimed)
                await aport.complete(claim.token, {"ok": 1})

            for _ in range(args.rounds):
                for tasks in (1, 50):
                    for name, fn in (("acquire+release", a_lock), ("claim+complete", a_job)):
                        key = f"{name} idemlock asyncio x{tasks}"
                        results.setdefault(key, []).append(await run_async(fn, args.n, tasks))
            await acoord.close()

        asyncio.run(amain())
        coord.close()
        print(f"etcd {args.members} member(s), n={args.n}, median of {args.rounds} rounds")
        med = {k: statistics.median(v) for k, v in results.items()}
        for k, v in med.items():
            print(f"  {k:<44} {v:8.0f} /s")
        for op in ("acquire+release", "claim+complete"):
            ratio = med[f"{op} idemlock sync"] / med[f"{op} raw gRPC sync"]
            print(f"  {op}: idemlock / raw gRPC (same round trips) = {ratio:.2f}")
    finally:
        cluster.destroy()


if __name__ == "__main__":
    main()
