"""Harnesses for the fault contract (tests/contract/test_faults_*.py): every store of
STORES with a way to stall it, to take it down and to restart it.

``fault_harness`` is parametrized over the names in ``stores.STORES``; each name needs
a factory in :data:`FAULT_STORES` below (a store without one fails the fault tests,
it is never skipped). How each store is stalled (``harness.stall()``: calls hang
without an error) and taken down (``harness.outage()`` / ``harness.restart()``):

* memory: a thread holds the store's internal lock (``MemoryStore._lock``) for the
  block. Outage and restart: the same (an in-process store has no server to stop).
* sqlite: another connection holds ``BEGIN IMMEDIATE`` on the file (writers wait
  the busy timeout; readers of a WAL file go on). Outage: the same; restart: a short
  one.
* redis, postgres: the URL goes through a per-test :class:`TcpProxy` to a server of
  the fault contract's own (tests/servers/faults.py); stall = blackhole the proxy,
  outage/restart = stop/start that server.
* postgres-pgbouncer: the same proxy, in front of a PgBouncer (transaction pooling)
  in front of that server; outage/restart stop/start the server, PgBouncer stays up.
* redis_cluster: SIGSTOP/SIGCONT of every node; outage/restart = kill and start every
  node (tests/servers/faults.py explains why no proxy).

Coordinators of the fault contract are opened with a short store ``timeout``
(agreement A1) so that a silent store costs seconds, not minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import idemlock
import idemlock.aio

from ..servers.etcd import etcd_fault_harness
from ..servers.faults import STALL_SAFETY, cluster_faults, postgres_faults, redis_faults
from ..servers.pgbouncer import pgbouncer_faults
from .facade import Facade, async_facade, sync_facade
from .harness import Harness
from .stores import STORES, by_url

#: the store option ``timeout`` the fault contract opens coordinators with (seconds)
TIMEOUT = 1.0
#: how long one store call may take at most when the store is silent or down:
#: generous over the documented bound (one ``timeout``), so that only a real hang fails
BOUND = TIMEOUT * 2 + 1.0
#: past this a call is reported as a hang (and the test stops waiting for it); a
#: stall ends by itself after STALL_SAFETY, so a call blocking the test's event loop
#: returns then and fails its bound
HANG = BOUND + 5.0


async def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a thread of its own, awaited: unlike ``asyncio.to_thread``, never
    queued behind the default executor's few workers (min(32, cores + 4): 6 on a 2-core
    machine), which a test running many faces at once, each blocked at a barrier or in
    a sync call, would use up and deadlock on."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def run() -> None:
        value: Any = None
        error: BaseException | None = None
        try:
            value = fn(*args)
        except BaseException as exc:  # handed to the awaiting task
            error = exc
        with contextlib.suppress(RuntimeError):  # the awaiting loop is gone
            loop.call_soon_threadsafe(settle, value, error)

    threading.Thread(target=run, name="contract-face", daemon=True).start()
    return await future


@dataclass
class Outcome:
    """How one call ended: its value or its exception, and how long it took."""

    value: Any = None
    error: BaseException | None = None
    elapsed: float = 0.0

    def describe(self) -> str:
        what = f"raised {self.error!r}" if self.error is not None else f"returned {self.value!r}"
        return f"{what} after {self.elapsed:.2f}s"


async def _capture(make: Callable[[], Awaitable[Any]]) -> Outcome:
    try:
        return Outcome(value=await make())
    except BaseException as exc:  # the test judges it
        return Outcome(error=exc)


async def timed(api: Facade, make: Callable[[], Awaitable[Any]], limit: float = HANG) -> Outcome:
    """Run one call of ``api`` (a facade call, as ``lambda: port.claim("k")``) and
    return how it ended. A call still running after ``limit`` fails the test as a hang,
    without waiting for it any longer: a sync call runs in a thread of its own, an
    async one in a task, so a hanging call cannot hang the test."""
    t0 = time.monotonic()
    if api.mode == "sync":
        box: list[Outcome] = []
        thread = threading.Thread(
            target=lambda: box.append(asyncio.run(_capture(make))), daemon=True
        )
        thread.start()
        await in_thread(thread.join, limit)
        if not box:
            pytest.fail(f"hang: a sync call did not return within {limit:.1f}s")
        out = box[0]
    else:
        task = asyncio.ensure_future(_capture(make))
        done, _ = await asyncio.wait({task}, timeout=limit)
        if not done:
            task.cancel()
            pytest.fail(f"hang: an async call did not return within {limit:.1f}s")
        out = task.result()
    out.elapsed = time.monotonic() - t0
    return out


#: how long the same coordinator may take to work again once the store is back: its
#: first calls may fail (StoreUnavailable, each within BOUND) while it reconnects, and
#: on a loaded machine the faces of a test reconnecting at once (PostgreSQL forking a
#: backend and checking the schema for each) can take several of those; the window is
#: generous, it is not the subject (a call that hangs or fails otherwise still fails)
RECOVERY = 30.0


async def eventually(
    api: Facade,
    make: Callable[[], Awaitable[Any]],
    within: float = RECOVERY,
    accept: tuple[type[BaseException], ...] = (),
) -> Any:
    """Retry a call until it succeeds (the store just came back): every failure on
    the way must be StoreUnavailable and bounded; fails after ``within`` seconds. An
    error of a type in ``accept`` is an answer: it is returned, not raised."""
    deadline = time.monotonic() + within
    failures: list[str] = []
    while True:
        out = await timed(api, make)
        if out.error is None:
            return out.value
        if isinstance(out.error, accept):
            return out.error
        if not isinstance(out.error, idemlock.StoreUnavailable) or out.elapsed > BOUND:
            raise AssertionError(f"while the store came back, a call {out.describe()}")
        failures.append(out.describe())
        if time.monotonic() > deadline:
            raise AssertionError(
                f"the same coordinator did not work again within {within:.0f}s of the store "
                f"coming back; its calls: {failures[-5:]}"
            )
        await asyncio.sleep(0.05)


def assert_unavailable(out: Outcome, what: str, bound: float = BOUND) -> None:
    """The call raised StoreUnavailable within ``bound``."""
    assert isinstance(out.error, idemlock.StoreUnavailable), (
        f"{what} on a silent/down store {out.describe()}; expected StoreUnavailable "
        f"within {bound:.1f}s"
    )
    assert out.elapsed <= bound, (
        f"{what} on a silent/down store {out.describe()}: past the bound of {bound:.1f}s"
    )


class SharedFault:
    """One fault block of ``harness`` (``stall`` or ``outage``) shared by the faces of a
    test that run at the same time (:func:`each_face_in_one_fault`): ``async with``
    waits until every face is at its block, the last one in starts the fault, and the
    fault ends once every face has left its block. So each face makes its calls on a
    store that is silent (or down) from before the first of them to after the last,
    as when it runs alone, and the fault's real time is spent once for both faces."""

    def __init__(self, harness: Harness, kind: str, parties: int = 2) -> None:
        self._make = getattr(harness, kind)
        self._cm: contextlib.AbstractContextManager[None] | None = None
        self._lock = threading.Lock()
        #: time.monotonic() once the fault was in effect (set when it starts)
        self.started_at = float("inf")
        self._in = threading.Barrier(parties, action=self._start, timeout=HANG * 2)
        self._out = threading.Barrier(parties, action=self._end, timeout=HANG * 2)

    def _start(self) -> None:
        cm = self._make()
        cm.__enter__()
        with self._lock:
            self._cm = cm
            self.started_at = time.monotonic()

    def _end(self) -> None:
        with self._lock:
            cm, self._cm = self._cm, None
        if cm is not None:
            cm.__exit__(None, None, None)

    def abort(self) -> None:
        """A face failed: the others stop waiting for it, and the fault ends."""
        self._in.abort()
        self._out.abort()
        self._end()

    async def __aenter__(self) -> None:
        await in_thread(self._in.wait)

    async def __aexit__(self, *exc: object) -> None:
        await in_thread(self._out.wait)


class SharedRestart:
    """``harness.restart()`` made once for the faces of one test run at the same time:
    ``await restart()`` waits until every face calls it, then the store restarts
    (while the faces' other tasks, a stream of calls, go on) and every face goes on."""

    def __init__(self, harness: Harness, parties: int = 2) -> None:
        self._barrier = threading.Barrier(parties, action=harness.restart, timeout=HANG * 2)

    def abort(self) -> None:
        self._barrier.abort()

    async def __call__(self) -> None:
        await in_thread(self._barrier.wait)


_WARM = idemlock.IdempotencySpec("warm-up")


async def each_face_in_one_fault(
    harness: Harness,
    kind: str,
    *scenarios: Callable[[Facade, Any], Awaitable[None]],
) -> None:
    """Run each ``scenario(api, fault)`` on a sync and an async facade (``timeout=TIMEOUT``,
    each on a key prefix of its own) at the same time, each sync one in a thread with an
    event loop of its own; ``async with fault:`` in a scenario is the block during which
    the store is stalled (``kind="stall"``) or down (``"outage"``), shared by every face
    of every scenario (see :class:`SharedFault`); with ``kind="restart"`` the scenarios
    get a :class:`SharedRestart` instead, ``await restart()`` in place of a restart of
    their own. Several scenarios so share one fault (one stall, one outage, one server
    restart): each still makes its calls on a store that is silent or down from before
    the first of them to after the last, as when it runs alone. Every check of each
    face is made; a failure names its scenario and face (a face's failure stops the
    others, whose broken waits are not reported)."""
    parties = 2 * len(scenarios)
    fault: SharedFault | SharedRestart = (
        SharedRestart(harness, parties)
        if kind == "restart"
        else SharedFault(harness, kind, parties)
    )

    async def one(
        mode: str, index: int, scenario: Callable[[Facade, Any], Awaitable[None]]
    ) -> None:
        suffix = f"{mode[0]}{index}" if len(scenarios) > 1 else mode[0]
        h = dataclasses.replace(harness, prefix=f"{harness.prefix}{suffix}")
        facade = (sync_facade if mode == "sync" else async_facade)(h, timeout=TIMEOUT)
        try:
            # Set up (pool, schema check, scripts) before the fault, retried: on a loaded
            # machine the first call can pass TIMEOUT, which no scenario is about (one
            # about a first call during a fault makes another coordinator for it).
            await eventually(facade, lambda: facade.idem(_WARM).status("warm-up"))
            await scenario(facade, fault)
        except BaseException as exc:
            fault.abort()
            name = getattr(scenario, "__name__", repr(scenario))
            exc.add_note(f"(in {name}, on the {mode} face)")
            raise
        finally:
            await facade.close()

    runs = []
    for index, scenario in enumerate(scenarios):
        runs.append(in_thread(asyncio.run, one("sync", index, scenario)))
        runs.append(one("async", index, scenario))
    try:
        results = await asyncio.gather(*runs, return_exceptions=True)
    finally:
        fault.abort()  # ends the fault if a face never left its block
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:  # the face that failed first, not the others' broken waits
        raise min(errors, key=lambda e: isinstance(e, threading.BrokenBarrierError))


class LockHolder:
    """Holds ``threading`` locks from another thread for a block (memory stall)."""

    def __init__(self, locks: Callable[[], list[Any]]) -> None:
        self._locks = locks

    @contextlib.contextmanager
    def stall(self) -> Iterator[None]:
        held, release = threading.Event(), threading.Event()
        locks = self._locks()

        def hold() -> None:
            for lk in locks:
                lk.acquire()
            held.set()
            release.wait(STALL_SAFETY)
            for lk in reversed(locks):
                lk.release()

        thread = threading.Thread(target=hold, name="fault-lock-holder", daemon=True)
        thread.start()
        if not held.wait(10):
            raise RuntimeError("could not take the memory store's lock to stall it")
        try:
            yield
        finally:
            release.set()
            thread.join(10)

    def outage(self) -> contextlib.AbstractContextManager[None]:
        return self.stall()

    def restart(self) -> None:
        with self.stall():
            pass

    def close(self) -> None:
        return None


class SQLiteWriter:
    """Another connection holding ``BEGIN IMMEDIATE`` on the file for a block."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @contextlib.contextmanager
    def stall(self) -> Iterator[None]:
        held, release = threading.Event(), threading.Event()
        errors: list[BaseException] = []

        def hold() -> None:
            conn = sqlite3.connect(
                self.path, timeout=30, isolation_level=None, check_same_thread=False
            )
            try:
                conn.execute("BEGIN IMMEDIATE")
                held.set()
                release.wait(STALL_SAFETY)
                conn.execute("ROLLBACK")
            except BaseException as exc:
                errors.append(exc)
                held.set()
            finally:
                conn.close()

        thread = threading.Thread(target=hold, name="fault-sqlite-writer", daemon=True)
        thread.start()
        held.wait(30)
        if errors:
            raise RuntimeError(f"could not lock {self.path}: {errors[0]!r}")
        try:
            yield
        finally:
            release.set()
            thread.join(10)

    def outage(self) -> contextlib.AbstractContextManager[None]:
        return self.stall()

    def restart(self) -> None:
        with self.stall():
            pass

    def close(self) -> None:
        return None


def memory(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    # One store per mode, shared by every coordinator of the test (like one server);
    # on the system clock: the fault contract is about real time.
    stores: dict[str, Any] = {}

    def open_sync(prefix: str, **options: Any) -> idemlock.Coordinator:
        if "sync" not in stores:
            stores["sync"] = idemlock.connect("memory://", **options).store
        return idemlock.Coordinator(stores["sync"], key_prefix=prefix, url="memory://")

    def open_async(prefix: str, **options: Any) -> idemlock.aio.AsyncCoordinator:
        if "async" not in stores:
            stores["async"] = idemlock.aio.connect("memory://", **options).store
        return idemlock.aio.AsyncCoordinator(stores["async"], key_prefix=prefix, url="memory://")

    def locks() -> list[Any]:
        found = []
        for store in stores.values():
            inner = getattr(store, "sync", store)  # the async face wraps a MemoryStore
            found.append(inner._lock)
        return found

    harness = Harness("memory", None, open_sync, open_async)
    harness.faults = LockHolder(locks)
    return harness


def sqlite(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    path = tmp_path / "idemlock.db"
    harness = by_url("sqlite", f"sqlite:///{path}")
    harness.faults = SQLiteWriter(path)
    return harness


def redis(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    url, faults = redis_faults(request.getfixturevalue("fault_redis_server"))
    harness = by_url("redis", url)
    harness.faults = faults
    return harness


def postgres(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    url, faults = postgres_faults(request.getfixturevalue("fault_postgres_server"))
    harness = by_url("postgres", url)
    harness.faults = faults
    return harness


def postgres_pgbouncer(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    # A proxy in front of PgBouncer (stall: silent between the store and the pooler);
    # outage and restart stop the PostgreSQL behind it, PgBouncer stays up.
    url, faults = pgbouncer_faults(request.getfixturevalue("fault_pgbouncer_server"))
    harness = by_url("postgres-pgbouncer", url)
    harness.faults = faults
    return harness


def redis_cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Harness:
    url, faults = cluster_faults(request.getfixturevalue("fault_redis_cluster"))
    harness = by_url("redis_cluster", url)
    harness.faults = faults
    return harness


#: name (as in stores.STORES) -> fault harness factory. A new store needs a line here.
FAULT_STORES: dict[str, Callable[[pytest.FixtureRequest, Path], Harness]] = {
    "memory": memory,
    "sqlite": sqlite,
    "postgres": postgres,
    "postgres-pgbouncer": postgres_pgbouncer,
    "redis": redis,
    "redis_cluster": redis_cluster,
    # etcd: every member behind a proxy (tests/servers/etcd.py EtcdFaults)
    "etcd": lambda request, tmp_path: etcd_fault_harness(
        "etcd", request.getfixturevalue("fault_etcd_server")
    ),
    "etcd_cluster": lambda request, tmp_path: etcd_fault_harness(
        "etcd_cluster", request.getfixturevalue("fault_etcd_cluster")
    ),
}


@pytest.fixture(params=list(STORES))
def fault_harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """Every store of STORES, with ``stall()``, ``outage()`` and ``restart()``."""
    factory = FAULT_STORES.get(request.param)
    if factory is None:
        pytest.fail(
            f"store {request.param!r} has no fault harness: add one to FAULT_STORES in "
            "tests/contract/fault_stores.py"
        )
    harness = factory(request, tmp_path)
    try:
        yield harness
    finally:
        harness.faults.close()


@pytest.fixture(params=["sync", "async"])
async def fault_api(
    request: pytest.FixtureRequest, fault_harness: Harness
) -> AsyncIterator[Facade]:
    """A coordinator with ``timeout=TIMEOUT`` on a fault harness, sync or async."""
    make = sync_facade if request.param == "sync" else async_facade
    facade = make(fault_harness, timeout=TIMEOUT)
    try:
        yield facade
    finally:
        await facade.close()
