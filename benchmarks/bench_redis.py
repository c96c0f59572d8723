"""Redis store benchmark: one command, one throwaway redis-server.

    python benchmarks/bench_redis.py [--n 3000] [--rounds 5] [--seconds 5] [--quick]

Measures, in one run against one server started for it (tests/servers/redis.py):

* acquire+release and claim+complete per second through idemlock's public API, sync
  (one thread) and asyncio (1 task, 100 tasks), next to the baseline: raw redis-py
  (hiredis) calling EVALSHA on idemlock's own scripts with the same arguments, the
  same number of round trips. The ratio is idemlock / baseline: what idemlock's
  Python costs on top of the round trips it cannot avoid;
* the same operations with the peers that install from PyPI: redis-py's ``Lock``,
  ``python-redis-lock``, ``fencekit`` (lock, idempotency guard) and ``idemkit`` (its
  Redis backend's claim and complete; asyncio only);
* the crash-safe job end to end: claim, a fenced write to a Redis key, complete -
  next to the same job from fencekit's pieces (guard, lock, fenced set, mark done,
  release);
* contention: 4 processes on one lock, each holding it ~1 ms, for ``--seconds``:
  critical sections per second, the share of acquisitions that go to a process that
  was already waiting when the lock was released (hand-offs), the gap from a
  holder's release call to the next acquisition, and the worst wait of any process;
* a single waiter behind a single holder: the release -> acquire gap;
* ``MEMORY USAGE`` of a held lock and of a completed record with a 100-byte result,
  and what is left per key after a release, an abandon and an expiry.

Throughput runs are interleaved round by round (A, B, A, B, ...) and the median round
is reported, so a noisy machine moves both sides alike.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
import redis.asyncio  # noqa: E402

import idemlock  # noqa: E402
import idemlock.aio  # noqa: E402
from idemlock import Claimed, IdempotencySpec, LockSpec  # noqa: E402
from idemlock.stores.redis import _common as C  # noqa: E402

SPEC = IdempotencySpec("orders", ttl=timedelta(hours=1))
LOCK = LockSpec("jobs", ttl=timedelta(seconds=30))
RESULT = {"charge": "ch_" + "x" * 20, "amount": 1200}
KEEP = 60_000
#: Every raw and peer client is configured like idemlock's own (bounded waits): with a
#: socket_timeout, redis-py's asyncio client wraps each send and read in a timeout,
#: which costs a few microseconds a call that the baseline must pay too.
CLIENT = {"socket_timeout": 5.0, "socket_connect_timeout": 5.0}

HAVE = {
    name: importlib.util.find_spec(mod) is not None
    for name, mod in (
        ("python-redis-lock", "redis_lock"),
        ("fencekit", "fencekit"),
        ("idemkit", "idemkit"),
    )
}


def median_rate(fn: Callable[[int], float], n: int) -> float:
    start = time.perf_counter()
    fn(n)
    return n / (time.perf_counter() - start)


Rates = dict[str, list[float]]


def interleave(fns: dict[str, Callable[[int], Any]], n: int, rounds: int) -> Rates:
    """Pairs per second of each function in every round; rounds run A, B, A, B, ..."""
    rates: Rates = {k: [] for k in fns}
    for fn in fns.values():  # warm up: connections, script cache, imports
        fn(max(50, n // 20))
    for _ in range(rounds):
        for name, fn in fns.items():
            rates[name].append(median_rate(fn, n))
    return rates


async def ainterleave(
    fns: dict[str, Callable[[int], Awaitable[Any]]], n: int, rounds: int
) -> Rates:
    rates: Rates = {k: [] for k in fns}
    for fn in fns.values():
        await fn(max(100, n // 20))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            await fn(n)
            rates[name].append(n / (time.perf_counter() - start))
    return rates


# ---- the baseline: raw redis-py on idemlock's own scripts ------------------------------


class Raw:
    """EVALSHA of idemlock's scripts with the arguments the store would send."""

    def __init__(self, client: Any) -> None:
        self.r = client
        self.ns = "raw" + uuid.uuid4().hex[:6] + ":jobs"

    def lock_args(self, key: str) -> tuple[C.Names, tuple[Any, ...]]:
        n = C.names(self.ns, key)
        return n, ("owner-" + key, 30_000, KEEP, b"", b"", C.REGISTER_MS)

    def sync_lock_pairs(self, count: int, key: str = "k") -> None:
        n, args = self.lock_args(key)
        r = self.r
        for _ in range(count):
            reply = r.evalsha(C.ACQUIRE.sha, 2, n.lock, n.waiters, *args)
            r.evalsha(
                C.RELEASE.sha, 2, n.lock, n.waiters, args[0], reply[1], KEEP, 10,
                n.lock_channel, C.nonce(),
            )  # fmt: skip

    def sync_claim_pairs(self, count: int) -> None:
        r = self.r
        fp = C.pack_id("ab" * 32)
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            n = C.names(self.ns, f"{tag}-{i}")
            tok = C.pack_id(uuid.uuid4().hex)
            r.evalsha(C.CLAIM.sha, 1, n.claim, fp, tok, 300_000, KEEP)
            r.evalsha(C.COMPLETE.sha, 1, n.claim, tok, b"J" + b"x" * 40, 3_600_000,
                      n.claim_channel, C.nonce())  # fmt: skip

    async def async_lock_pairs(self, count: int, key: str = "k") -> None:
        n, args = self.lock_args(key)
        r = self.r
        for _ in range(count):
            reply = await r.evalsha(C.ACQUIRE.sha, 2, n.lock, n.waiters, *args)
            await r.evalsha(
                C.RELEASE.sha, 2, n.lock, n.waiters, args[0], reply[1], KEEP, 10,
                n.lock_channel, C.nonce(),
            )  # fmt: skip

    async def async_claim_pairs(self, count: int, tag: str = "") -> None:
        r = self.r
        fp = C.pack_id("ab" * 32)
        tag = tag or uuid.uuid4().hex[:6]
        for i in range(count):
            n = C.names(self.ns, f"{tag}-{i}")
            tok = C.pack_id(uuid.uuid4().hex)
            await r.evalsha(C.CLAIM.sha, 1, n.claim, fp, tok, 300_000, KEEP)
            await r.evalsha(C.COMPLETE.sha, 1, n.claim, tok, b"J" + b"x" * 40, 3_600_000,
                            n.claim_channel, C.nonce())  # fmt: skip


def load_scripts(r: redis.Redis) -> None:
    for s in (C.ACQUIRE, C.RELEASE, C.CLAIM, C.COMPLETE):
        assert r.script_load(s.text) == s.sha


# ---- idemlock through its public API ----------------------------------------------------


def ours_lock_pairs(coord: idemlock.Coordinator) -> Callable[[int], None]:
    locks = coord.lock(LOCK)

    def run(count: int) -> None:
        for _ in range(count):
            lease = locks.acquire("k")
            assert lease is not None
            locks.release(lease)

    return run


def ours_claim_pairs(coord: idemlock.Coordinator) -> Callable[[int], None]:
    port = coord.idempotency(SPEC)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            claim = port.claim(f"{tag}-{i}")
            assert isinstance(claim, Claimed)
            port.complete(claim.token, RESULT)

    return run


def ours_job(coord: idemlock.Coordinator) -> Callable[[int], None]:
    port = coord.idempotency(SPEC)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            claim = port.claim(key)
            assert isinstance(claim, Claimed)
            coord.fence(f"out:{key}").set_if_fresh(claim.fence, f"out:{key}", b"done")
            port.complete(claim.token, RESULT)

    return run


def ours_job_together(coord: idemlock.Coordinator) -> Callable[[int], None]:
    """The same job with its effect written by the completing script: the effect and
    the record commit together (2 round trips), and no late write can land after it."""
    port = coord.idempotency(SPEC)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            claim = port.claim(key)
            assert isinstance(claim, Claimed)
            port.complete(claim.token, RESULT, writes={f"out:{key}": b"done"})

    return run


# ---- peers ---------------------------------------------------------------------------


def redispy_lock_pairs(r: redis.Redis, name: str = "peer:redis-py") -> Callable[[int], None]:
    def run(count: int) -> None:
        for _ in range(count):
            lock = r.lock(name, timeout=30)
            assert lock.acquire(blocking=False)
            lock.release()

    return run


def prl_lock_pairs(
    r: redis.Redis, name: str = "peer:prl", strict: bool = True
) -> Callable[[int], None]:
    """``strict=False`` lets python-redis-lock take a RedisCluster client (then ``name``
    needs a hash tag, e.g. ``{peer:prl}``, for its lock and signal keys to share a slot)."""
    import redis_lock

    def run(count: int) -> None:
        for _ in range(count):
            lock = redis_lock.Lock(r, name, expire=30, strict=strict)
            assert lock.acquire(blocking=False)
            lock.release()

    return run


def fencekit_lock_pairs(r: redis.Redis, prefix: str = "fk") -> Callable[[int], None]:
    import fencekit

    dl = fencekit.DistributedLock(r, prefix=prefix)
    ttl = timedelta(seconds=30)

    def run(count: int) -> None:
        for _ in range(count):
            dl.release(dl.acquire("peer", ttl=ttl))

    return run


def fencekit_guard_pairs(r: redis.Redis, prefix: str = "fk") -> Callable[[int], None]:
    import fencekit

    guard = fencekit.IdempotencyGuard(r, prefix=prefix)
    ttl = timedelta(hours=1)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            assert guard.try_begin(key, ttl=ttl)
            guard.mark_done(key, result=RESULT, ttl=ttl)

    return run


def fencekit_job(r: redis.Redis, prefix: str = "fkj") -> Callable[[int], None]:
    """On a Cluster, give ``prefix`` a hash tag (``{fkj}``): the fenced write's key and
    fencekit's gate keys must share a slot."""
    import fencekit

    guard = fencekit.IdempotencyGuard(r, prefix=prefix)
    lock = fencekit.DistributedLock(r, prefix=prefix)
    gate = fencekit.FenceGate(r, prefix=prefix)
    ttl = timedelta(seconds=300)

    def run(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{i}"
            assert guard.try_begin(key, ttl=ttl)
            handle = lock.acquire(key, ttl=ttl, owner_id=guard.owner_id)
            gate.set_if_fresh(handle.token, f"{prefix}out:{key}", "done")
            guard.mark_done(key, result=RESULT, ttl=timedelta(hours=1))
            lock.release(handle)

    return run


# ---- asyncio -------------------------------------------------------------------------


def fan_out(
    make: Callable[[int, int], Awaitable[None]], tasks: int
) -> Callable[[int], Awaitable[None]]:
    """Split ``count`` pairs over ``tasks`` concurrent tasks (task index, share)."""

    async def run(count: int) -> None:
        share = max(1, count // tasks)
        await asyncio.gather(*(make(t, share) for t in range(tasks)))

    return run


async def async_section(
    url: str, port: int, n: int, rounds: int
) -> list[tuple[str, dict[str, float]]]:
    out = []
    araw = redis.asyncio.Redis(port=port, **CLIENT)
    raw = Raw(araw)
    coord = idemlock.aio.connect(url, key_prefix="ab" + uuid.uuid4().hex[:6])
    locks = coord.lock(LOCK)
    port_ = coord.idempotency(SPEC)
    backend = None
    if HAVE["idemkit"]:
        from idemkit.backends.redis import RedisBackend

        backend = RedisBackend(redis.asyncio.Redis(port=port, **CLIENT), namespace="ik")

    async def ours_lock(t: int, count: int) -> None:
        for _ in range(count):
            lease = await locks.acquire(f"k{t}")
            assert lease is not None
            await locks.release(lease)

    async def ours_claim(t: int, count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            claim = await port_.claim(f"{tag}-{t}-{i}")
            assert isinstance(claim, Claimed)
            await port_.complete(claim.token, RESULT)

    async def raw_lock(t: int, count: int) -> None:
        await raw.async_lock_pairs(count, key=f"k{t}")

    async def raw_claim(t: int, count: int) -> None:
        await raw.async_claim_pairs(count, tag=f"{uuid.uuid4().hex[:6]}-{t}")

    async def idemkit_claim(t: int, count: int) -> None:
        assert backend is not None
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key = f"{tag}-{t}-{i}"
            res = await backend.claim(key, "f" * 64, 1, 300.0)
            await backend.complete(key, res.our_claim_token, 200, {}, b"x" * 40, 3600.0)

    for tasks in (1, 100):
        fns: dict[str, Callable[[int], Awaitable[Any]]] = {
            "baseline acquire+release": fan_out(raw_lock, tasks),
            "idemlock acquire+release": fan_out(ours_lock, tasks),
            "baseline claim+complete": fan_out(raw_claim, tasks),
            "idemlock claim+complete": fan_out(ours_claim, tasks),
        }
        if backend is not None:
            fns["idemkit claim+complete"] = fan_out(idemkit_claim, tasks)
        out.append(
            (f"asyncio, {tasks} task{'s' if tasks > 1 else ''}", await ainterleave(fns, n, rounds))
        )
    await coord.close()
    await araw.aclose()
    if backend is not None:
        await backend.aclose()
    return out


# ---- contention ------------------------------------------------------------------------


def _contender(
    kind: str, url: str, port: int, prefix: str, start_at: float, seconds: float,
    hold: float, pause: float, out: Any,
) -> None:  # fmt: skip
    """One process: take the lock, hold it, release, again, until the time is up.
    Records (called, acquired, released) on the shared monotonic clock."""
    r = redis.Redis(port=port, **CLIENT)
    events: list[tuple[float, float, float]] = []
    if kind == "idemlock":
        coord = idemlock.connect(url, key_prefix=prefix)
        locks = coord.lock(LOCK)

        def acquire() -> Any:
            return locks.acquire("hot", wait=30)

        def release(lease: Any) -> None:
            locks.release(lease)
    elif kind == "redis-py Lock":

        def acquire() -> Any:
            lock = r.lock(prefix + ":hot", timeout=30)
            assert lock.acquire(blocking=True, blocking_timeout=30)
            return lock

        def release(lock: Any) -> None:
            lock.release()
    elif kind == "python-redis-lock":
        import redis_lock

        def acquire() -> Any:
            lock = redis_lock.Lock(r, prefix + ":hot", expire=30)
            assert lock.acquire(blocking=True, timeout=30)
            return lock

        def release(lock: Any) -> None:
            lock.release()
    else:
        import fencekit

        dl = fencekit.DistributedLock(r, prefix=prefix)

        def acquire() -> Any:
            return dl.acquire("hot", ttl=timedelta(seconds=30), blocking=True,
                              wait=timedelta(seconds=30))  # fmt: skip

        def release(handle: Any) -> None:
            dl.release(handle)

    release(acquire())  # warm up: connections, scripts, subscriptions
    while time.monotonic() < start_at:
        time.sleep(0.001)
    end = start_at + seconds
    while time.monotonic() < end:
        called = time.monotonic()
        held = acquire()
        acquired = time.monotonic()
        time.sleep(hold)
        released = time.monotonic()
        release(held)
        events.append((called, acquired, released))
        if pause:
            time.sleep(pause)
    out.put(events)


def contention(
    kind: str, url: str, port: int, procs: int, seconds: float, hold: float, pause: float
) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    prefix = "ct" + uuid.uuid4().hex[:6]
    start_at = time.monotonic() + 2.5  # every process imports, connects, warms up
    ps = [
        ctx.Process(target=_contender,
                    args=(kind, url, port, prefix, start_at, seconds, hold, pause, out))
        for _ in range(procs)
    ]  # fmt: skip
    for p in ps:
        p.start()
    events: list[tuple[float, float, float, int]] = []
    for i in range(procs):
        events += [(c, a, r, i) for c, a, r in out.get(timeout=seconds + 120)]
    for p in ps:
        p.join(timeout=30)
    return summarize(events, seconds)


def summarize(events: list[tuple[float, float, float, int]], seconds: float) -> dict[str, float]:
    """Contention figures from (called, acquired, released, process) of every critical
    section on one shared monotonic clock."""
    events = sorted(events, key=lambda e: e[1])
    gaps, handoff_gaps, handoffs = [], [], 0
    for prev, cur in itertools.pairwise(events):
        gap = cur[1] - prev[2]
        gaps.append(gap)
        if cur[0] < prev[2]:  # it was already waiting when the lock was released
            handoffs += 1
            handoff_gaps.append(gap)
    waits = [a - c for c, a, _, _ in events]
    return {
        "cs_per_s": len(events) / seconds,
        "handoff_share": handoffs / max(1, len(events) - 1),
        "gap_median_ms": statistics.median(gaps) * 1000 if gaps else float("nan"),
        "handoff_gap_median_ms": (
            statistics.median(handoff_gaps) * 1000 if handoff_gaps else float("nan")
        ),
        "worst_wait_ms": max(waits) * 1000 if waits else float("nan"),
        "count": len(events),
    }


# ---- memory ----------------------------------------------------------------------------


def memory(url: str, r: redis.Redis) -> list[tuple[str, str]]:
    rows = []
    coord = idemlock.connect(url, key_prefix="mem")
    store = coord.store
    port = coord.idempotency(SPEC)
    ns = port._ns
    claim = port.claim("order-000001")
    assert isinstance(claim, Claimed)
    k = C.names(ns, "order-000001").claim
    rows.append(
        ("idemlock claim in flight", f"{r.memory_usage(k, samples=0)} B (key name {len(k)} B)")
    )
    store.complete(ns, "order-000001", claim.token.token, b"x" * 100, 3_600_000)
    rows.append(("idemlock completed record, 100-byte result",
                 f"{r.memory_usage(k, samples=0)} B (key name {len(k)} B)"))  # fmt: skip
    locks = coord.lock(LOCK)
    lease = locks.acquire("job-000001")
    assert lease is not None
    lk = C.names(locks._ns, "job-000001").lock
    rows.append(("idemlock held lock", f"{r.memory_usage(lk, samples=0)} B (key name {len(lk)} B)"))
    locks.release(lease)
    rows.append(("idemlock after release", f"{r.memory_usage(lk, samples=0)} B for counter_ttl "
                 f"({r.pttl(lk) / 1000:.0f} s), then nothing"))  # fmt: skip
    c2 = port.claim("order-000002")
    assert isinstance(c2, Claimed)
    port.abandon(c2.token)
    k2 = C.names(ns, "order-000002").claim
    rows.append(("idemlock after abandon", f"{r.memory_usage(k2, samples=0)} B for counter_ttl, "
                 "then nothing"))  # fmt: skip
    short = coord.idempotency(IdempotencySpec("short", ttl=timedelta(seconds=0.2)))
    c3 = short.claim("order-000003")
    assert isinstance(c3, Claimed)
    short.complete(c3.token, "x" * 90)
    time.sleep(0.3)
    k3 = C.names(short._ns, "order-000003").claim
    gone = r.memory_usage(k3) if r.exists(k3) else 0
    rows.append(("idemlock completed record after its ttl", f"{gone} B"))
    coord.close()
    # peers
    lock = r.lock("peer:mem-redis-py-000001", timeout=30)
    lock.acquire(blocking=False)
    rows.append(
        ("redis-py Lock held", f"{r.memory_usage('peer:mem-redis-py-000001', samples=0)} B")
    )
    lock.release()
    if HAVE["python-redis-lock"]:
        import redis_lock

        pl = redis_lock.Lock(r, "mem-000001", expire=30)
        pl.acquire(blocking=False)
        rows.append(("python-redis-lock held", f"{r.memory_usage('lock:mem-000001', samples=0)} B"))
        pl.release()
        left = sum(r.memory_usage(k, samples=0) or 0 for k in r.keys("lock*:mem-000001"))
        rows.append(("python-redis-lock after release", f"{left} B (signal list, expires in 1 s)"))
    if HAVE["fencekit"]:
        import fencekit

        dl = fencekit.DistributedLock(r, prefix="fkm")
        h = dl.acquire("job-000001", ttl=timedelta(seconds=30))
        keys = r.keys("fkm*")
        rows.append(("fencekit lock held", f"{sum(r.memory_usage(k, samples=0) for k in keys)} B "
                     f"({len(keys)} keys)"))  # fmt: skip
        dl.release(h)
        left = sum(r.memory_usage(k, samples=0) for k in r.keys("fkm*"))
        rows.append(("fencekit after release", f"{left} B (fence counter, never expires)"))
        g = fencekit.IdempotencyGuard(r, prefix="fkg")
        g.try_begin("order-000001", ttl=timedelta(hours=1))
        g.mark_done("order-000001", result="x" * 98, ttl=timedelta(hours=1))  # 100 B of JSON
        keys = r.keys("fkg*")
        size = sum(r.memory_usage(k, samples=0) for k in keys)
        rows.append(("fencekit guard done, 100-byte result", f"{size} B ({len(keys)} keys)"))
    return rows


# ---- main ------------------------------------------------------------------------------


def fmt_rates(title: str, rates: Rates, base: dict[str, str]) -> list[str]:
    """Median rate of each, and the median of its per-round ratios to the baseline run
    next to it (pairing rounds cancels the machine's drift)."""
    lines = [f"  {title}"]
    for name, series in rates.items():
        ratio = ""
        for suffix, bname in base.items():
            if name.endswith(suffix) and name != bname and bname in rates:
                r = statistics.median(a / b for a, b in zip(series, rates[bname], strict=True))
                ratio = f"  ({r:.2f}x baseline)"
        lines.append(f"    {name:<38} {statistics.median(series):>9.0f} /s{ratio}")
    return lines


SECTIONS = ("throughput", "job", "contention", "single", "memory")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--n", type=int, default=1000, help="pairs per round")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=5.0, help="contention run length")
    parser.add_argument("--quick", action="store_true", help="small n, 2 s contention")
    parser.add_argument(
        "--only", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.rounds, args.seconds = 300, 5, 2.0
    only = set(args.only.split(","))
    from tests.servers.redis import start_redis

    print(f"python {sys.version.split()[0]}, redis-py {redis.__version__}, "
          f"hiredis {'yes' if importlib.util.find_spec('hiredis') else 'no'}, "
          f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    for name, ok in HAVE.items():
        print(f"peer {name}: {'installed' if ok else 'not installed (pip install ' + name + ')'}")
    with tempfile.TemporaryDirectory(prefix="idemlock-bench-") as tmp:
        server = start_redis(Path(tmp))
        try:
            url = server.url
            r = redis.Redis(port=server.port, **CLIENT)
            print(f"redis-server {r.info('server')['redis_version']} on 127.0.0.1:{server.port}")
            load_scripts(r)
            if "throughput" in only:
                throughput(url, server.port, r, args.n, args.rounds)
            if "job" in only:
                job(url, r, args.n, args.rounds)
            kinds = ["idemlock", "redis-py Lock"]
            kinds += [k for k in ("python-redis-lock", "fencekit") if HAVE[k]]
            if "contention" in only:
                print(f"\nContention: 4 processes, one lock, hold ~1 ms, {args.seconds:g} s each")
                print(f"    {'':<20} {'cs/s':>7} {'hand-offs':>10} {'gap med':>9} "
                      f"{'h-o gap med':>12} {'worst wait':>11}")  # fmt: skip
                for kind in kinds:
                    m = contention(kind, url, server.port, 4, args.seconds, 0.001, 0.0)
                    print(f"    {kind:<20} {m['cs_per_s']:>7.0f} {m['handoff_share']:>9.0%} "
                          f"{m['gap_median_ms']:>7.2f}ms {m['handoff_gap_median_ms']:>10.2f}ms "
                          f"{m['worst_wait_ms']:>9.1f}ms")  # fmt: skip
            if "single" in only:
                # Each holds 2 ms and pauses 0.5 ms after its release, so the other one is
                # always already waiting when the lock is released.
                print("\nSingle waiter behind a single holder (2 processes, hold 2 ms)")
                for kind in kinds:
                    m = contention(kind, url, server.port, 2, min(args.seconds, 3.0), 0.002, 0.0005)
                    gap, count, share = m["handoff_gap_median_ms"], m["count"], m["handoff_share"]
                    print(f"    {kind:<20} release -> acquire gap median {gap:6.2f} ms "
                          f"({count:.0f} acquisitions, {share:.0%} hand-offs)")  # fmt: skip
            if "memory" in only:
                print("\nMemory (MEMORY USAGE)")
                for name, value in memory(url, r):
                    print(f"    {name:<46} {value}")
            r.close()
        finally:
            server.stop()


def throughput(url: str, port: int, r: redis.Redis, n: int, rounds: int) -> None:
    raw = Raw(r)
    coord = idemlock.connect(url, key_prefix="b" + uuid.uuid4().hex[:6])
    base = {"acquire+release": "baseline acquire+release",
            "claim+complete": "baseline claim+complete"}  # fmt: skip
    print("\nThroughput (pairs per second, median of interleaved rounds)")
    fns: dict[str, Callable[[int], Any]] = {
        "baseline acquire+release": raw.sync_lock_pairs,
        "idemlock acquire+release": ours_lock_pairs(coord),
        "redis-py Lock acquire+release": redispy_lock_pairs(r),
    }
    if HAVE["python-redis-lock"]:
        fns["python-redis-lock acquire+release"] = prl_lock_pairs(r)
    if HAVE["fencekit"]:
        fns["fencekit lock acquire+release"] = fencekit_lock_pairs(r)
    fns["baseline claim+complete"] = raw.sync_claim_pairs
    fns["idemlock claim+complete"] = ours_claim_pairs(coord)
    if HAVE["fencekit"]:
        fns["fencekit guard claim+complete"] = fencekit_guard_pairs(r)
    rates = interleave(fns, n, rounds)
    for line in fmt_rates("sync, one thread", rates, base):
        print(line)
    for title, arates in asyncio.run(async_section(url, port, n, rounds)):
        for line in fmt_rates(title, arates, base):
            print(line)
    coord.close()


def job(url: str, r: redis.Redis, n: int, rounds: int) -> None:
    coord = idemlock.connect(url, key_prefix="j" + uuid.uuid4().hex[:6])
    print("\nCrash-safe job (claim, fenced write, complete), jobs per second")
    jobs = {
        "idemlock job (3 round trips)": ours_job(coord),
        "idemlock job, effect with complete (2)": ours_job_together(coord),
    }
    if HAVE["fencekit"]:
        jobs["fencekit job (5 pieces, 6 trips)"] = fencekit_job(r)
    jrates = interleave(jobs, max(200, n // 2), rounds)
    for name, series in jrates.items():
        print(f"    {name:<38} {statistics.median(series):>9.0f} /s")
    if HAVE["fencekit"]:
        peer = jrates["fencekit job (5 pieces, 6 trips)"]
        for name in list(jobs)[:2]:
            ratio = statistics.median(x / y for x, y in zip(jrates[name], peer, strict=True))
            print(f"    {name} / fencekit: {ratio:.2f}x (median of per-round ratios)")
    coord.close()


if __name__ == "__main__":
    main()
