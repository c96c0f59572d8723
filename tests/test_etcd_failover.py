"""The etcd store through a leader failover of a 3-member cluster.

While locks are held and claims are in flight, and worker threads contend for locks
and run claim+complete jobs, the leader is SIGKILLed, the cluster elects another,
and the old leader is started again. Checks:

* held leases survive with the same token (the holder renews them and still owns
  them), in-flight claims can still be completed with their fences;
* tokens and fences keep increasing (per key, and after the restart above all before);
* no two holders of one lock overlap (each holder's fenced write goes through a gate
  and its interval of holding is recorded);
* no call stalls longer than about the election time (bounded well under the store's
  ``timeout``), and every call either succeeds or raises ``StoreUnavailable``.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

import idemlock
from idemlock import Claimed, IdempotencySpec, LockSpec, StoreUnavailable

from .servers.etcd import EtcdCluster, start_etcd

LOCK = LockSpec("fo", ttl=timedelta(seconds=10))
SPEC = IdempotencySpec("fo", lease=timedelta(seconds=10))
#: the bound on one stalled call during the failover: the election takes ~0.2-0.3 s
#: here (election timeout 200 ms), and a call on a member that lost its leader or is
#: rejoining is given up after one short attempt (1 s) and asked of another member;
#: the store's own timeout is 5 s
STALL_BOUND = 2.0


@pytest.fixture
def cluster() -> Iterator[EtcdCluster]:
    c = start_etcd(3)
    try:
        yield c
    finally:
        c.destroy()


class Workload:
    def __init__(self, url: str, prefix: str) -> None:
        self.url = url
        self.prefix = prefix
        self.stop = threading.Event()
        self.lock = threading.Lock()
        #: (key, token, start, end) of every lock holding, monotonic times
        self.holdings: list[tuple[str, int, float, float]] = []
        #: (key, fence) of every granted claim, in grant order per thread
        self.fences: list[tuple[str, int]] = []
        self.errors: list[BaseException] = []
        self.unavailable = 0
        self.max_call = 0.0
        self.threads: list[threading.Thread] = []

    def timed(self, fn, *args, allowance: float = 0.0, **kwargs):  # type: ignore[no-untyped-def]
        """Call and record how long it took past ``allowance`` (a wait it asked for)."""
        t0 = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            took = time.monotonic() - t0 - allowance
            with self.lock:
                self.max_call = max(self.max_call, took)

    def locker(self, n: int) -> None:
        coord = idemlock.connect(self.url, key_prefix=self.prefix)
        locks = coord.lock(LOCK)
        try:
            while not self.stop.is_set():
                key = f"contended-{n % 2}"
                try:
                    lease = self.timed(locks.acquire, key, wait=1, allowance=1)
                    if lease is None:
                        continue
                    start = time.monotonic()
                    assert lease.token is not None
                    # A fenced write: a stale holder would be refused (FencedOut).
                    self.timed(coord.fence(f"gate-{key}").check_and_advance, lease.token)
                    time.sleep(0.005)
                    end = time.monotonic()
                    self.timed(locks.release, lease)
                    with self.lock:
                        self.holdings.append((key, lease.token, start, end))
                except StoreUnavailable:
                    with self.lock:
                        self.unavailable += 1
                except BaseException as exc:
                    with self.lock:
                        self.errors.append(exc)
                    return
        finally:
            coord.close()

    def claimer(self, n: int) -> None:
        coord = idemlock.connect(self.url, key_prefix=self.prefix)
        port = coord.idempotency(SPEC)
        i = 0
        try:
            while not self.stop.is_set():
                key = f"job-{n}-{i % 3}"
                i += 1
                try:
                    got = self.timed(port.claim, key)
                    if isinstance(got, Claimed):
                        with self.lock:
                            self.fences.append((key, got.token.fence))
                        if i % 2:
                            self.timed(port.abandon, got.token)
                        else:
                            self.timed(port.complete, got.token, {"n": i})
                            self.timed(port.forget, key)
                except StoreUnavailable:
                    with self.lock:
                        self.unavailable += 1
                except BaseException as exc:
                    with self.lock:
                        self.errors.append(exc)
                    return
        finally:
            coord.close()

    def start(self) -> None:
        for n in range(3):
            self.threads.append(threading.Thread(target=self.locker, args=(n,), daemon=True))
        for n in range(2):
            self.threads.append(threading.Thread(target=self.claimer, args=(n,), daemon=True))
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def _no_overlap(holdings: list[tuple[str, int, float, float]]) -> None:
    by_key: dict[str, list[tuple[int, float, float]]] = {}
    for key, token, start, end in holdings:
        by_key.setdefault(key, []).append((token, start, end))
    for key, rows in by_key.items():
        rows.sort()
        for (t1, _, e1), (t2, s2, _) in itertools.pairwise(rows):
            assert t2 > t1, f"{key}: token {t2} issued twice"
            # A later token's holding starts after the earlier one ended.
            assert s2 >= e1, f"{key}: holders {t1} and {t2} overlapped"


def test_leader_kill_keeps_leases_tokens_and_exclusion(cluster: EtcdCluster) -> None:
    prefix = "failover"
    coord = idemlock.connect(cluster.url, key_prefix=prefix)
    locks, port = coord.lock(LOCK), coord.idempotency(SPEC)
    held = [locks.acquire(f"held-{i}") for i in range(3)]
    assert all(h is not None for h in held)
    claims = [port.claim(f"inflight-{i}") for i in range(3)]
    assert all(isinstance(c, Claimed) for c in claims)
    work = Workload(cluster.url, prefix)
    work.start()
    try:
        time.sleep(1.0)
        leader = cluster.leader()
        before_kill = max(h.token for h in held if h is not None and h.token is not None)
        cluster.kill(leader)
        killed_at = time.monotonic()
        new_leader = cluster.leader()
        elected_in = time.monotonic() - killed_at
        assert new_leader != leader
        time.sleep(1.5)  # the workload runs on against the new leader
        cluster.start_member(leader)
        cluster.wait_ready()
        time.sleep(1.0)
    finally:
        work.join()  # bounded: 30 s a thread
    assert not work.errors, work.errors
    print(
        f"\nelection took {elected_in:.2f}s; longest call {work.max_call:.2f}s; "
        f"{len(work.holdings)} holdings, {len(work.fences)} claims, "
        f"{work.unavailable} StoreUnavailable"
    )
    assert work.max_call <= STALL_BOUND, f"a call stalled {work.max_call:.2f}s"
    assert len(work.holdings) > 10 and len(work.fences) > 10  # the workload ran throughout
    # Held leases survived, with the same token: still ours, renewable, releasable.
    for lease in held:
        assert lease is not None
        token = lease.token
        assert locks.owner(lease.key) == lease.owner
        assert locks.renew(lease) is True and lease.token == token
    # In-flight claims kept their fences and can still be completed.
    for c in claims:
        assert isinstance(c, Claimed)
        status = port.status(c.token.key)
        assert status is not None and status.fence == c.token.fence
        port.complete(c.token, "done")
    # Tokens keep increasing after the failover and the restart.
    after = locks.acquire("after-restart")
    assert after is not None and after.token is not None and after.token > before_kill
    assert after.token > max(t for _, t, _, _ in work.holdings)
    # Fences per key strictly increase in grant order.
    last: dict[str, int] = {}
    for key, fence in work.fences:
        assert fence > last.get(key, 0), f"fence {fence} of {key} not above {last.get(key)}"
        last[key] = fence
    _no_overlap(work.holdings)
    for lease in held:
        assert lease is not None
        assert locks.release(lease) is True
    coord.close()


def test_leader_kill_asyncio(cluster: EtcdCluster) -> None:
    """The same through grpc.aio: tasks contend for locks and run claim+complete jobs
    on one asyncio coordinator while the leader is SIGKILLed and restarted."""
    import asyncio

    import idemlock.aio

    holdings: list[tuple[str, int, float, float]] = []
    fences: list[tuple[str, int]] = []
    errors: list[BaseException] = []
    worst = [0.0]

    async def timed(aw, allowance: float = 0.0):  # type: ignore[no-untyped-def]
        t0 = time.monotonic()
        try:
            return await aw
        finally:
            worst[0] = max(worst[0], time.monotonic() - t0 - allowance)

    async def main() -> None:
        coord = idemlock.aio.connect(cluster.url, key_prefix="afailover")
        locks, port = coord.lock(LOCK), coord.idempotency(SPEC)
        held = await locks.acquire("held")
        assert held is not None
        stop = asyncio.Event()

        async def locker(n: int) -> None:
            key = f"c-{n % 2}"
            while not stop.is_set():
                try:
                    lease = await timed(locks.acquire(key, wait=1), allowance=1)
                    if lease is None:
                        continue
                    start = time.monotonic()
                    await timed(coord.fence(f"g-{key}").check_and_advance(lease.token))
                    await asyncio.sleep(0.005)
                    end = time.monotonic()
                    await timed(locks.release(lease))
                    holdings.append((key, lease.token, start, end))
                except StoreUnavailable:
                    pass
                except BaseException as exc:
                    errors.append(exc)
                    return

        async def claimer(n: int) -> None:
            i = 0
            while not stop.is_set():
                key = f"j-{n}-{i % 3}"
                i += 1
                try:
                    got = await timed(port.claim(key))
                    if isinstance(got, Claimed):
                        fences.append((key, got.token.fence))
                        await timed(port.abandon(got.token))
                except StoreUnavailable:
                    pass
                except BaseException as exc:
                    errors.append(exc)
                    return

        tasks = [asyncio.ensure_future(locker(n)) for n in range(3)]
        tasks += [asyncio.ensure_future(claimer(n)) for n in range(2)]
        await asyncio.sleep(1.0)
        leader = await asyncio.to_thread(cluster.leader)
        before = held.token
        await asyncio.to_thread(cluster.kill, leader)
        await asyncio.sleep(1.5)
        await asyncio.to_thread(cluster.start_member, leader)
        await asyncio.to_thread(cluster.wait_ready)
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*tasks)
        assert await locks.owner("held") == held.owner
        assert await locks.renew(held) is True and held.token == before
        after = await locks.acquire("after")
        assert after is not None and after.token > max(t for _, t, _, _ in holdings)
        assert await locks.release(held) is True
        await coord.close()

    asyncio.run(main())
    assert not errors, errors
    print(
        f"\nasyncio: longest call {worst[0]:.2f}s; {len(holdings)} holdings, {len(fences)} claims"
    )
    assert worst[0] <= STALL_BOUND, f"a call stalled {worst[0]:.2f}s"
    assert len(holdings) > 10 and len(fences) > 10
    last: dict[str, int] = {}
    for key, fence in fences:
        assert fence > last.get(key, 0)
        last[key] = fence
    _no_overlap(holdings)
