"""The scenarios, each written once, run on every store's subjects.

* uncontended, asyncio and the crash-safe job (``run_store``): every subject interleaved
  round by round, then its round trips counted;
* contention (``Contenders``): processes (threads for the in-process store) taking turns
  on one lock: critical sections/s, hand-offs, gap, worst wait, overlapping holds
  (``summarize``); the same machinery with 2 processes is the single-waiter scenario;
* Redis memory per key (``redis_memory``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from functools import partial
from typing import Any

import common as c
import redis
from common import ainterleave, fan_out, guarded, installed, interleave, new_prefix, role, summarize
from subjects.base import Ctx, ours_contender
from subjects.memory import MemoryBench
from subjects.postgres import PgBench
from subjects.redis import RedisBench
from subjects.sqlite import SqliteBench

import idemlock
from idemlock import Claimed, IdempotencySpec
from idemlock.stores.redis import _common as C

ADAPTERS: dict[str, Any] = {"memory": MemoryBench, "sqlite": SqliteBench, "postgres": PgBench}


def contender(store: str, kind: str, t: dict[str, Any], stack: contextlib.ExitStack) -> Any:
    """(acquire(key) -> handle, release(handle)) of one contender; it closes on ``stack``."""
    adapter = ADAPTERS.get(store, RedisBench)  # both Redis stores: RedisBench
    if kind in (c.OURS, c.OURS_AIO):
        return ours_contender(Ctx(t, stack), aio=kind == c.OURS_AIO)
    if kind == c.BASE:
        return adapter.contender(Ctx(t, stack))
    return adapter.peers[kind][c.HAND_OP](Ctx(t, stack))


_W: dict[str, Any] = {}


def _worker_init(ready: Any, go: Any, start_at: Any) -> None:
    _W.update(ready=ready, go=go, start_at=start_at)
    ready.put(("started", os.getpid()))


def critical_sections(
    acquire: Callable[[str], Any], release: Callable[[Any], Any], start: float, seconds: float,
    hold: float, pause: float = 0.0,
) -> list[tuple[float, float, float]]:  # fmt: skip
    """Take the lock, hold it, release, again, from ``start`` for ``seconds``:
    (called, acquired, released) of each, on the machine's monotonic clock."""
    while time.monotonic() < start:
        time.sleep(0.0005)
    end, events = start + seconds, []
    while time.monotonic() < end:
        called = time.monotonic()
        held = acquire("hot")
        acquired = time.monotonic()
        time.sleep(hold)
        released = time.monotonic()
        release(held)
        events.append((called, acquired, released))
        if pause:  # off the lock for a moment: the other contender is then always waiting
            time.sleep(pause)
    return events


def _contend(
    store: str, kind: str, t: dict[str, Any], seconds: float, hold: float, pause: float = 0.0
) -> list[tuple[float, float, float]]:
    with contextlib.ExitStack() as stack:
        try:
            acquire, release = contender(store, kind, t, stack)
            release(acquire(f"warm-{os.getpid()}"))  # connections, scripts, subscriptions
        except BaseException as exc:
            _W["ready"].put(("error", c._why(exc)))
            raise
        _W["ready"].put(("ready", os.getpid()))
        if not _W["go"].wait(180):
            raise RuntimeError("no start signal")
        return critical_sections(acquire, release, _W["start_at"].value, seconds, hold, pause)


class Contenders:
    """Four worker processes, started once and reused for every contention run."""

    PROCS = 4

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.ready, self.go, self.start_at = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0)
        self.pool = ctx.Pool(
            self.PROCS, initializer=_worker_init, initargs=(self.ready, self.go, self.start_at)
        )
        # Wait until every worker has imported everything: starting 4 interpreters
        # takes both cores for a few seconds, which must not fall on a measurement.
        for _ in range(self.PROCS):
            self.ready.get(timeout=120)

    def run(
        self, store: str, kind: str, t: dict[str, Any], seconds: float, hold: float = 0.001,
        procs: int = PROCS, pause: float = 0.0,
    ) -> dict[str, float]:  # fmt: skip
        self.go.clear()
        job = self.pool.starmap_async(
            _contend, [(store, kind, t, seconds, hold, pause)] * procs, chunksize=1
        )
        errors = []
        for _ in range(procs):
            what, detail = self.ready.get(timeout=150)
            if what == "error":
                errors.append(detail)
        self.start_at.value = time.monotonic() + 0.05
        self.go.set()  # also when one failed: the others then finish their run
        per_proc = job.get(timeout=seconds + 150)
        if errors:
            raise RuntimeError(errors[0])
        events = [(c, a, r, i) for i, evs in enumerate(per_proc) for c, a, r in evs]
        return summarize(events, seconds)

    def contend(
        self, bench: Any, kind: str, seconds: float, tag: str = "ct", **kw: Any
    ) -> dict[str, float]:
        """``run`` on a fresh contention target of ``bench``; the memory store's
        contenders are 4 threads (``contend_threads``, its default hold)."""
        if bench.name == "memory":
            return contend_threads(kind, seconds)
        t = {**bench.contention_target(), "prefix": new_prefix(tag)}
        return self.run(bench.name, kind, t, seconds, **kw)

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


def contend_threads(kind: str, seconds: float, hold: float = 0.001) -> dict[str, float]:
    """The memory store lives in one process: its contenders are 4 threads."""
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(4) as pool:
        acquire, release = contender("memory", kind, {"url": "memory://", "prefix": ""}, stack)
        start = time.monotonic() + 0.05
        runs = pool.map(
            lambda _: critical_sections(acquire, release, start, seconds, hold), range(4)
        )
        out = list(runs)
    return summarize([(c, a, r, i) for i, evs in enumerate(out) for c, a, r in evs], seconds)


# ---- running one store -------------------------------------------------------------------------


def run_store(bench: Any, cfg: c.Config, res: c.Results, contenders: Contenders) -> None:
    name, scale = bench.name, bench.scale if cfg.scaled else 1
    n, job_n = cfg.n * scale, cfg.job_n * scale

    def measured(where: tuple[str, str, str], fns: dict[str, Any], run: Any, cpu: c.Rates) -> Any:
        """``run(fns, cpu)``; a peer that fails is dropped (and why, in ``res``), the rest
        rerun. Its rates, and each subject's ``cpu_us`` column."""
        fns = guarded(fns)
        while True:
            try:
                cpu.clear()  # a rerun's rounds only
                return run(fns, cpu), c.cpu_us(cpu)
            except c.PeerFailed as exc:
                res.skip(where, exc.name, "failed", c._why(exc.cause))
                del fns[exc.name]

    def timed(scenario: str, op: str, build: Any, count: int, unit: str) -> None:
        """Every subject of ``build`` interleaved, then its round trips per operation,
        counted on fresh clients (a store without ``counting`` has none)."""
        with contextlib.ExitStack() as stack:
            fns = build(bench.target(), stack, res)
            rates, extra = measured(
                (scenario, op, name), fns, lambda f, cpu: interleave(f, count, cfg.rounds, cpu), {}
            )
        with contextlib.ExitStack() as stack:
            counted, t = stack.enter_context(bench.counting()) if bench.counting else (None, {})
            for subject, fn in build(t, stack, c.Results()).items() if counted else ():
                try:
                    fn(cfg.count)  # connections, scripts, prepared statements, a Cluster's nodes
                    before = counted()
                    fn(cfg.count)
                except Exception:
                    if role(subject) != "peer":
                        raise
                    continue  # measured (or reported as failed) by the timed run
                trips = round((counted() - before) / cfg.count, 2)
                extra.setdefault(subject, {})["round_trips"] = trips
        res.rates(scenario, op, name, rates, unit, extra)

    async def fanned(makes: dict[str, c.Make], tasks: int, cpu: c.Rates) -> c.Rates:
        for make in makes.values():
            # One task first: connections, scripts, a Cluster client's slot map (redis-py's
            # asyncio RedisCluster drops connections in use if many tasks trigger its
            # first discovery at once).
            await make(0, 1)
        fns = {k: fan_out(m, tasks) for k, m in makes.items()}
        return await ainterleave(fns, n, cfg.rounds, cpu)

    for op in (c.LOCK_OP, c.CLAIM_OP):
        timed(c.UNC, op, partial(bench.sync_fns, op), n, "pairs/s")
    with asyncio.Runner() as runner:  # one loop: the clients live across its runs
        for (tasks, scenario), op in itertools.product(
            ((1, c.AIO1), (100, c.AIO100)), (c.LOCK_OP, c.CLAIM_OP)
        ):
            where, stack = (scenario, op, name), contextlib.AsyncExitStack()
            try:
                makes = runner.run(bench.async_fns(op, tasks, stack, res, where))
                rates, extra = measured(
                    where, makes, lambda m, cpu, k=tasks: runner.run(fanned(m, k, cpu)), {}
                )
            finally:
                runner.run(stack.aclose())
            res.rates(scenario, op, name, rates, "pairs/s", extra)
    timed(c.JOB, c.JOB_OP, bench.job_fns, job_n, "jobs/s")

    where, runs = (c.HAND, c.HAND_OP, name), {}
    # idemlock.aio contends where each contender is a process, with an event loop of its own
    aio = [c.OURS_AIO] if name != "memory" else []
    for kind in (c.BASE, c.OURS, *aio, *bench.builds(c.HAND_OP)):
        if not installed(res, where, kind):
            continue
        try:
            runs[kind] = m = contenders.contend(bench, kind, cfg.seconds)
        except Exception as exc:
            if c.role(kind) != "peer":
                raise
            res.skip(where, kind, "failed", c._why(exc))
            continue
        print(
            f"  {c.HAND} {kind}: {m['cs_per_s']:.0f} cs/s, hand-offs {m['handoff_share']:.0%}, "
            f"gap median {m['gap_median_ms']:.2f} ms, worst wait {m['worst_wait_ms']:.1f} ms, "
            f"overlapping holds {m['overlapping_holds']}"
        )
    # one round each: its rate is the row's value, its ratio the one to the baseline's
    figures = {k: {f: v for f, v in m.items() if f != "cs_per_s"} for k, m in runs.items()}
    rates = {k: [m["cs_per_s"]] for k, m in runs.items()}
    res.rates(c.HAND, c.HAND_OP, name, rates, "critical sections/s", figures)


def start_benches(servers: c.Servers, stores: list[str]) -> dict[str, Any]:
    """Each of ``stores``' adapter, its server (Redis, PostgreSQL) started on ``servers``."""
    benches: dict[str, Any] = {"memory": MemoryBench(), "sqlite": SqliteBench(str(servers.tmp))}
    for store in stores:
        if store == "postgres":
            pg = servers.start(store)
            benches[store] = PgBench(pg.dsn, pg.port)
            benches[store].server = pg  # scale.py's connections start a PgBouncer on it
        elif store.startswith("redis"):
            r, cluster = servers.start(store), store == "redis-cluster"
            benches[store] = RedisBench(r.url, r.ports if cluster else [r.port], cluster=cluster)
    return {store: benches[store] for store in stores}


def single_waiter(
    bench: Any, cfg: c.Config, contenders: Contenders, kind: str = c.OURS
) -> dict[str, float]:
    """One holder, one waiter (2 processes; each holds 2 ms, then stays off the lock for
    0.5 ms, so the other is always already waiting): the release -> acquire gap of
    ``kind``'s lock (a contention kind: idemlock, the baseline, a lock peer)."""
    seconds = min(cfg.seconds, 3.0)
    return contenders.contend(bench, kind, seconds, "sw", hold=0.002, procs=2, pause=0.0005)


def single_waiters(
    bench: Any, cfg: c.Config, res: c.Results, contenders: Contenders
) -> dict[str, dict[str, float]]:
    """``single_waiter`` of every kind that ran the store's contended hand-off
    (idemlock's failure raises; a peer's, or the baseline's, is recorded in ``res``)."""
    out, where = {}, ("single waiter", "1 holder, 1 waiter", bench.name)
    for r in res.rows:
        if (r["scenario"], r["store"]) == (c.HAND, bench.name):
            try:
                out[r["subject"]] = single_waiter(bench, cfg, contenders, r["subject"])
            except Exception as exc:
                if r["subject"] == c.OURS:
                    raise
                res.skip(where, r["subject"], "failed", c._why(exc))
    return out


def redis_memory(url: str, port: int) -> list[tuple[str, str]]:
    """MEMORY USAGE of idemlock's records and locks, and of the peers' (Redis)."""
    r = redis.Redis(port=port, **c.CLIENT)
    rows = []

    def size(key: str | bytes) -> str:
        return f"{r.memory_usage(key, samples=0)} B (key name {len(key)} B)"

    def total(pattern: str) -> tuple[int, int]:
        """The bytes and the number of the keys matching ``pattern`` (a peer's record)."""
        keys = r.keys(pattern)
        return sum(r.memory_usage(k, samples=0) or 0 for k in keys), len(keys)

    coord = idemlock.connect(url, key_prefix="mem")
    port_ = coord.idempotency(c.SPEC)
    ns = port_._ns
    claim = port_.claim("order-000001")
    assert isinstance(claim, Claimed)
    k = C.names(ns, "order-000001").claim
    rows.append(("idemlock claim in flight", size(k)))
    port_.complete(claim.token, "x" * 98)  # 100 bytes of JSON
    rows.append(("idemlock completed record, 100-byte result", size(k)))
    locks = coord.lock(c.LOCK)
    lease = locks.acquire("job-000001")
    assert lease is not None
    lk = C.names(locks._ns, "job-000001").lock
    rows.append(("idemlock held lock", size(lk)))
    locks.release(lease)
    rows.append(("idemlock after release", f"{r.memory_usage(lk, samples=0)} B for "
                 f"counter_ttl ({r.pttl(lk) / 1000:.0f} s), then nothing"))  # fmt: skip
    c2 = port_.claim("order-000002")
    assert isinstance(c2, Claimed)
    port_.abandon(c2.token)
    k2 = C.names(ns, "order-000002").claim
    rows.append(("idemlock after abandon", f"{r.memory_usage(k2, samples=0)} B for counter_ttl, "
                 "then nothing"))  # fmt: skip
    short = coord.idempotency(IdempotencySpec("short", ttl=timedelta(seconds=0.2)))
    c3 = short.claim("order-000003")
    assert isinstance(c3, Claimed)
    short.complete(c3.token, "x" * 90)
    time.sleep(0.3)
    k3 = C.names(short._ns, "order-000003").claim
    rows.append(("idemlock completed record after its ttl",
                 f"{r.memory_usage(k3) if r.exists(k3) else 0} B"))  # fmt: skip
    coord.close()
    lock = r.lock("peer:mem-redis-py-000001", timeout=30)
    lock.acquire(blocking=False)
    rows.append(("redis-py Lock held", size("peer:mem-redis-py-000001")))
    lock.release()
    if c.HAVE[c.PRL]:
        import redis_lock

        pl = redis_lock.Lock(r, "mem-000001", expire=30)
        pl.acquire(blocking=False)
        rows.append(("python-redis-lock held", size("lock:mem-000001")))
        pl.release()
        left = total("lock*:mem-000001")[0]
        rows.append(("python-redis-lock after release", f"{left} B (signal list, expires in 1 s)"))
    if c.HAVE[c.FK]:
        import fencekit

        dl = fencekit.DistributedLock(r, prefix="fkm")
        h = dl.acquire("job-000001", ttl=timedelta(seconds=30))
        rows.append(("fencekit lock held", "{} B ({} keys)".format(*total("fkm*"))))
        dl.release(h)
        left = total("fkm*")[0]
        rows.append(("fencekit after release", f"{left} B (fence counter, never expires)"))
        guard = fencekit.IdempotencyGuard(r, prefix="fkg")
        guard.try_begin("order-000001", ttl=timedelta(hours=1))
        guard.mark_done("order-000001", result="x" * 98, ttl=timedelta(hours=1))  # 100 B JSON
        done = "{} B ({} keys)".format(*total("fkg*"))
        rows.append(("fencekit guard done, 100-byte result", done))
    r.close()
    return rows
