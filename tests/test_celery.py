"""The Celery integration, with real Celery workers on a real Redis broker.

This module is also the workers' app (``celery -A tests.test_celery worker``): the
worker processes import it and find the broker, the idemlock store (a SQLite file
shared with the test) and a scratch directory in the environment. The tasks write
what they do into an "application" SQLite database next to it, so the test counts
runs and fenced writes from outside the workers.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, current_task
from celery.exceptions import Retry
from celery.signals import task_postrun, worker_ready

import idemlock
from idemlock import ConfigurationError, FencedOut, IdempotencySpec, InFlightError
from idemlock.integrations.celery import IdempotentTask, current_fence, enqueue_once
from idemlock.integrations.jobs.sends import send_lock_spec

from .queue_jobs import most_at_once
from .servers._proc import popen
from .servers.redis import RedisServer, free_port, start_redis

ROOT = Path(__file__).resolve().parents[1]
ENV_BROKER = "IDEMLOCK_TEST_BROKER"
ENV_STORE = "IDEMLOCK_TEST_STORE"
ENV_DIR = "IDEMLOCK_TEST_DIR"

#: short so a killed worker's message comes back within seconds (a real deployment
#: keeps it longer than the lease; here the lease outlasts it on purpose, so the
#: redelivered task meets the dead attempt's claim in flight)
VISIBILITY_TIMEOUT = 2
#: the "ship" task's hard time limit (its claim's max_run is this plus the margin):
#: longer than a second worker takes to start on a loaded machine, since the first
#: attempt must still hold its claim when the redelivered message meets it
SHIP_TIME_LIMIT = 30.0
LEASE_MARGIN = 1.0
#: the "ship" spec's lease: how long after the kill the key frees itself
SHIP_LEASE = 3.0

BROKER_OPTIONS = {
    "visibility_timeout": VISIBILITY_TIMEOUT,
    # Sweep for unacknowledged messages every second instead of every 100 s.
    "unacked_restore_interval": 1,
    "unacked_restore_throttle": 1,
    # A worker killed inside a sweep must not block the next one for 5 minutes.
    "unacked_mutex_expire": 3,
}


def _broker() -> str:
    return os.environ.get(ENV_BROKER, "redis://127.0.0.1:1/0")


app = Celery("idemlock_celery_test")
app.conf.update(
    broker_url=_broker(),
    result_backend=_broker().rsplit("/", 1)[0] + "/1",
    broker_transport_options=BROKER_OPTIONS,
    broker_connection_retry_on_startup=True,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_default_queue="idemlock-test",
)


# ---- what the worker processes run ----------------------------------------------------


def _dir() -> Path:
    return Path(os.environ[ENV_DIR])


def _append(name: str, line: str) -> None:
    # One write per line with O_APPEND: lines from several processes never interleave.
    with open(_dir() / name, "a") as f:
        f.write(line + "\n")


def _event_log(event: idemlock.Event) -> None:
    _append("events.log", f"{event.spec} {event.name} {event.outcome}")


def _coordinator() -> idemlock.Coordinator:
    # Opened lazily in each worker (pool) process, after the fork.
    return idemlock.connect(os.environ[ENV_STORE], hooks=[_event_log])


@contextmanager
def _db() -> Iterator[sqlite3.Connection]:
    conn = sqlite3.connect(_dir() / "app.db", timeout=10, isolation_level=None)
    try:
        yield conn
    finally:
        conn.close()


def _make_app_db(path: Path) -> None:
    with sqlite3.connect(path / "app.db") as conn:
        conn.execute("CREATE TABLE runs (task TEXT, fence INT, retries INT, state TEXT)")
        conn.execute("CREATE TABLE effects (id TEXT PRIMARY KEY, value TEXT, fence INT)")
        conn.execute("CREATE TABLE starts (task TEXT, fence INT, at_ms INT)")


def fenced_write(conn: sqlite3.Connection, effect_id: str, value: str, fence: int) -> bool:
    """The application's fenced write: lands only if no higher fence wrote before."""
    cur = conn.execute(
        "INSERT INTO effects VALUES (?, ?, ?) ON CONFLICT(id) DO UPDATE "
        "SET value = excluded.value, fence = excluded.fence WHERE effects.fence <= excluded.fence",
        (effect_id, value, fence),
    )
    return cur.rowcount == 1


@app.task(
    bind=True,
    base=IdempotentTask,
    name="idemlock_test.pay",
    idemlock_coordinator=_coordinator,
    idemlock_spec="pay",
    idemlock_key=lambda order_id, amount: f"order-{order_id}",
    time_limit=20,
)
def pay(self: Any, order_id: str, amount: int) -> dict[str, Any]:
    fence = self.request.idemlock_fence
    with _db() as conn:
        conn.execute("INSERT INTO runs VALUES ('pay', ?, ?, 'finished')", (fence, 0))
        fenced_write(conn, f"pay-{order_id}", f"charged {amount}", fence)
    return {"order": order_id, "charged": amount, "fence": fence}


@app.task(
    bind=True,
    base=IdempotentTask,
    name="idemlock_test.ship",
    idemlock_coordinator=_coordinator,
    idemlock_spec=IdempotencySpec("ship", lease=timedelta(seconds=SHIP_LEASE)),
    idemlock_key=lambda order_id: f"ship-{order_id}",
    idemlock_lease_margin=LEASE_MARGIN,
    idemlock_retry_every=1.0,
    time_limit=SHIP_TIME_LIMIT,
)
def ship(self: Any, order_id: str) -> dict[str, Any]:
    fence = current_fence()
    with _db() as conn, _coordinator() as coord:
        conn.execute(
            "INSERT INTO runs VALUES ('ship', ?, ?, 'started')", (fence, self.request.retries)
        )
        # The store's clock (SQLite: wall-clock ms, floored), read after the claim.
        conn.execute("INSERT INTO starts VALUES ('ship', ?, ?)", (fence, time.time_ns() // 10**6))
        coord.fence(f"parcel-{order_id}").check_and_advance(fence)
        fenced_write(conn, f"ship-{order_id}", f"label by fence {fence}", fence)
        first = _dir() / "ship-first-attempt"
        if not first.exists():
            first.write_text(str(fence))
            time.sleep(60)  # the test kills the worker here, mid-body
        conn.execute(
            "UPDATE runs SET state = 'finished' WHERE task = 'ship' AND fence = ?", (fence,)
        )
    return {"order": order_id, "fence": fence}


@app.task(
    bind=True,
    base=IdempotentTask,
    name="idemlock_test.deposit",
    idemlock_coordinator=_coordinator,
    idemlock_spec="deposit",
    idemlock_key=lambda account, amount: f"deposit-{account}",
    idemlock_store_retry_backoff=0.5,
    idemlock_store_retry_max=1.0,
    time_limit=60,
)
def deposit(self: Any, account: str, amount: int) -> dict[str, Any]:
    fence = self.request.idemlock_fence
    with _db() as conn:
        conn.execute(
            "INSERT INTO runs VALUES ('deposit', ?, ?, 'finished')", (fence, self.request.retries)
        )
    if (_dir() / f"hold-{account}").exists():
        # The test stops the store while the body runs, then lets it finish.
        (_dir() / f"running-{account}").touch()
        wait_for((_dir() / f"go-{account}").exists, 60)
    return {"account": account, "amount": amount, "fence": fence}


#: the claim's lease of "deposit_short" (no time limit: the spec's lease)
SHORT_LEASE = 3.0


@app.task(
    bind=True,
    base=IdempotentTask,
    name="idemlock_test.deposit_short",
    idemlock_coordinator=_coordinator,
    idemlock_spec=IdempotencySpec("deposit-short", lease=timedelta(seconds=SHORT_LEASE)),
    idemlock_key=lambda account: f"short-{account}",
)
def deposit_short(self: Any, account: str) -> dict[str, Any]:
    (_dir() / f"running-{account}").touch()
    wait_for((_dir() / f"go-{account}").exists, 60)
    return {"account": account, "fence": self.request.idemlock_fence}


#: the "slow" spec's lease; its body runs several times as long
SLOW_LEASE = 1.0


@app.task(
    bind=True,
    base=IdempotentTask,
    name="idemlock_test.slow",
    idemlock_coordinator=_coordinator,
    idemlock_spec=IdempotencySpec("slow", lease=timedelta(seconds=SLOW_LEASE)),
    idemlock_key=lambda job: f"slow-{job}",
    idemlock_retry_every=0.5,
    time_limit=60,
)
def slow(self: Any, job: str) -> dict[str, Any]:
    fence = self.request.idemlock_fence
    with _db() as conn:
        conn.execute("INSERT INTO runs VALUES ('slow', ?, ?, 'started')", (fence, 0))
    (_dir() / f"slow-running-{job}").touch()
    time.sleep(4 * SLOW_LEASE)  # heartbeats keep the claim all along
    # ... and on until the test saw the duplicate meet it, however slow the machine.
    wait_for((_dir() / f"slow-go-{job}").exists, 50)
    with _db() as conn:
        conn.execute(
            "UPDATE runs SET state = 'finished' WHERE task = 'slow' AND fence = ?", (fence,)
        )
    return {"job": job, "fence": fence}


@app.task(
    bind=True,
    base=IdempotentTask,
    name="idemlock_test.flaky",
    idemlock_coordinator=_coordinator,
    idemlock_spec="flaky",
    idemlock_key=lambda job: f"flaky-{job}",
)
def flaky(self: Any, job: str) -> dict[str, Any]:
    first = _dir() / f"flaky-retried-{job}"
    if not first.exists():
        first.touch()
        raise self.retry(countdown=3)  # queued again: its send lease must stay
    return {"job": job, "retries": self.request.retries}


def _fulfil_effect(step: str, order_id: str, fence: int) -> str:
    # One step's side effect, a line the test counts.
    _append("fulfil.log", json.dumps({"step": step, "order": order_id, "fence": fence}))
    return f"{step} by fence {fence}"


@app.task(
    bind=True,
    base=IdempotentTask,
    name="idemlock_test.fulfil",
    idemlock_coordinator=_coordinator,
    idemlock_spec="fulfil",
    idemlock_key=lambda order_id: f"fulfil-{order_id}",
    autoretry_for=(ConnectionError,),
    retry_kwargs={"countdown": 0, "max_retries": 2},
    time_limit=20,
)
def fulfil(self: Any, order_id: str) -> dict[str, Any]:
    claim = idemlock.current_claim()
    assert claim is not None
    charge = claim.step("charge", _fulfil_effect, "charge", order_id, claim.fence)
    failed = _dir() / f"fulfil-failed-{order_id}"
    if not failed.exists():
        failed.touch()
        raise ConnectionError("the mail server went away")  # after step one: retried
    mail = claim.step("mail", _fulfil_effect, "mail", order_id, claim.fence)
    return {"order": order_id, "charge": charge, "mail": mail, "fence": claim.fence}


#: at most this many "export" bodies run at once (the test starts two workers)
EXPORT_LIMIT = 1
#: the tenant every export counts under
EXPORT_TENANT = "tenant-1"


def _export_tenant(report: str, seconds: float) -> str:
    # The concurrency key, asked by each delivery that holds its claim: the log shows
    # the deliveries that found no permit and came back.
    _append("export.log", json.dumps({"event": "attempt", "name": report, "t": time.time()}))
    return EXPORT_TENANT


@app.task(
    bind=True,
    base=IdempotentTask,
    name="idemlock_test.export",
    idemlock_coordinator=_coordinator,
    idemlock_spec=IdempotencySpec("export", lease=timedelta(seconds=2)),
    idemlock_key=lambda report, seconds: f"export-{report}",
    idemlock_retry_every=0.2,
    idemlock_concurrency=EXPORT_LIMIT,
    idemlock_concurrency_key=_export_tenant,
    idemlock_concurrency_wait=0.5,
    max_retries=0,
    time_limit=30,
)
def export(self: Any, report: str, seconds: float) -> dict[str, Any]:
    _append("export.log", json.dumps({"event": "start", "name": report, "t": time.time()}))
    time.sleep(seconds)
    _append("export.log", json.dumps({"event": "end", "name": report, "t": time.time()}))
    return {"report": report, "retries": self.request.retries}


@worker_ready.connect
def _announce_ready(sender: Any = None, **_: Any) -> None:
    _append("ready.log", str(os.getpid()))


@task_postrun.connect
def _after_task(task: Any = None, task_id: str = "", state: str = "", **_: Any) -> None:
    if not task.name.startswith("idemlock_test."):
        return
    replayed = getattr(task.request, "idemlock_replayed", None)
    _append("postrun.log", json.dumps([task.name, task_id, state, replayed]))
    marker = _dir() / "pay-completed"
    if task.name == "idemlock_test.pay" and replayed is False and not marker.exists():
        # The claim is completed and the result stored, but the worker acknowledges
        # the message only after this returns: the test kills the worker here.
        marker.write_text(task_id)
        time.sleep(60)


# ---- the harness --------------------------------------------------------------------


@dataclass
class Env:
    broker: RedisServer
    dir: Path
    store_url: str
    workers: list[Worker] = field(default_factory=list)

    def lines(self, name: str) -> list[str]:
        path = self.dir / name
        return path.read_text().splitlines() if path.exists() else []

    def runs(self, task: str) -> list[tuple[int, int, str]]:
        with sqlite3.connect(self.dir / "app.db") as conn:
            rows = conn.execute(
                "SELECT fence, retries, state FROM runs WHERE task = ? ORDER BY fence", (task,)
            )
            return [tuple(r) for r in rows]

    def started_ms(self, task: str, fence: int) -> int:
        """When the body of the run with this fence started (wall-clock ms)."""
        with sqlite3.connect(self.dir / "app.db") as conn:
            row = conn.execute(
                "SELECT at_ms FROM starts WHERE task = ? AND fence = ?", (task, fence)
            ).fetchone()
        assert row is not None, f"no {task} run with fence {fence}"
        return int(row[0])

    def unacked(self) -> int:
        client: Any = self.broker.client()
        with client:
            return int(client.hlen("unacked"))

    def redeliverable(self) -> bool:
        """Whether every unacknowledged message is past the visibility timeout, so a
        worker starting now puts it back in the queue at once: kombu < 5.6 sweeps only
        then and every 100 s after (it has no ``unacked_restore_interval``)."""
        client: Any = self.broker.client()
        with client:
            ceil = time.time() - VISIBILITY_TIMEOUT - 0.2
            return int(client.zcount("unacked_index", f"({ceil}", "+inf")) == 0


class Worker:
    """A ``celery worker`` process (prefork pool, one child) in its own process group,
    so SIGKILL takes the parent and its pool child at once, like a lost machine."""

    def __init__(self, env: Env, name: str) -> None:
        self.env = env
        self.log = env.dir / f"{name}.log"
        ready_before = len(env.lines("ready.log"))
        environ = {
            **os.environ,
            ENV_BROKER: env.broker.url,
            ENV_STORE: env.store_url,
            ENV_DIR: str(env.dir),
        }
        cmd = [
            sys.executable, "-m", "celery", "-A", "tests.test_celery", "worker",
            "--pool=prefork", "--concurrency=1", "--loglevel=INFO", f"--hostname={name}@test",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        with open(self.log, "wb") as out:
            self.proc = popen(
                cmd, cwd=ROOT, env=environ, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        wait_for(lambda: len(env.lines("ready.log")) > ready_before, 30, self.why)

    def why(self) -> str:
        return f"worker log:\n{self.log.read_text()}"

    def kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill()


def wait_for(
    cond: Callable[[], object], timeout: float, why: Callable[[], str] = lambda: ""
) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s\n{why()}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    # Its own server: the workers' keys never meet other tests' flushes.
    server = start_redis(tmp_path_factory.mktemp("celery-broker"))
    app.conf.update(broker_url=server.url, result_backend=server.url[:-1] + "1")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def env(broker: RedisServer, tmp_path: Path) -> Iterator[Env]:
    client: Any = broker.client()
    with client:
        client.flushall()
    _make_app_db(tmp_path)
    e = Env(broker, tmp_path, f"sqlite:///{tmp_path}/idemlock.db")
    yield e
    for w in e.workers:
        w.stop()


def start_worker(env: Env, name: str) -> Worker:
    worker = Worker(env, name)
    env.workers.append(worker)
    return worker


# ---- with workers -------------------------------------------------------------------


def test_killed_after_complete_before_ack_replays(env: Env) -> None:
    """SIGKILL between the recorded result and the broker's ack: the redelivered
    task returns the recorded result and the body does not run again."""
    coord = idemlock.connect(env.store_url)
    w1 = start_worker(env, "w1")
    sent = pay.apply_async(("A17", 1200))
    wait_for(lambda: (env.dir / "pay-completed").exists(), 20, w1.why)
    status = coord.idempotency("pay").status("order-A17")
    assert status is not None and status.state == "completed"
    # The broker still waits for the ack: the message is held by w1, or (past the
    # visibility timeout, on a loaded machine) already put back in the queue.
    assert env.unacked() + queued(env) == 1
    w1.kill()

    wait_for(env.redeliverable, 20, w1.why)
    w2 = start_worker(env, "w2")

    def replays() -> list[Any]:
        return [json.loads(x) for x in env.lines("postrun.log") if "true" in x]

    wait_for(replays, 20, w2.why)
    assert replays() == [["idemlock_test.pay", sent.id, "SUCCESS", True]]
    assert env.runs("pay") == [(status.fence, 0, "finished")]  # one run, ever
    assert sent.get(timeout=10) == {"order": "A17", "charged": 1200, "fence": status.fence}
    wait_for(lambda: env.unacked() == 0, 10, w2.why)  # acknowledged this time
    assert env.lines("events.log").count("pay claim claimed") == 1
    assert env.lines("events.log").count("pay claim replayed") == 1
    coord.close()


def test_killed_mid_body_one_finished_run_and_late_write_refused(env: Env) -> None:
    """SIGKILL in the middle of the body: after redelivery and the lease, exactly one
    run finishes, with a higher fence, and the dead attempt's late write is refused."""
    coord = idemlock.connect(env.store_url)
    w1 = start_worker(env, "w1")
    sent = ship.apply_async(("B5",))
    first = env.dir / "ship-first-attempt"
    wait_for(first.exists, 20, w1.why)
    old_fence = int(first.read_text())
    # The second worker is up before the kill, however slowly it starts, and the
    # message comes back to it (visibility timeout) while the first attempt holds the
    # claim: it meets the claim in flight and waits (in-flight retries).
    wait_for(env.redeliverable, 20, w1.why)
    w2 = start_worker(env, "w2")
    wait_for(lambda: "ship claim in_flight" in env.lines("events.log"), 20, w2.why)
    held = coord.idempotency("ship").status("ship-B5")
    assert held is not None and (held.state, held.fence) == ("in_flight", old_fence)
    w1.kill()

    result = sent.get(timeout=30)
    new_fence = result["fence"]
    assert new_fence > old_fence
    # The new run started only once the dead attempt's lease had ended (renewals
    # until the kill may have moved it past ``held``'s: this is a lower bound).
    lease_end_ms = round(held.expires_at.timestamp() * 1000)
    assert env.started_ms("ship", new_fence) >= lease_end_ms
    assert env.runs("ship") == [
        (old_fence, 0, "started"),  # the killed attempt never finished
        (new_fence, 0, "finished"),  # in-flight retries did not use up max_retries
    ]
    status = coord.idempotency("ship").status("ship-B5")
    assert status is not None and (status.state, status.fence) == ("completed", new_fence)

    # The killed attempt's late writes, carrying its old fence, cannot land.
    with sqlite3.connect(env.dir / "app.db") as conn:
        assert not fenced_write(conn, "ship-B5", "late label", old_fence)
        value = conn.execute("SELECT value, fence FROM effects WHERE id = 'ship-B5'").fetchone()
    assert value == (f"label by fence {new_fence}", new_fence)
    with pytest.raises(FencedOut):
        coord.fence("parcel-B5").check_and_advance(old_fence)

    # A duplicate send now replays without running.
    again = ship.apply_async(("B5",))
    assert again.get(timeout=10) == result
    assert len(env.runs("ship")) == 2
    wait_for(lambda: env.unacked() == 0, 10, w2.why)
    coord.close()


def test_task_slower_than_its_lease_with_a_duplicate_runs_once(env: Env) -> None:
    """Heartbeats (issue 11): a task running 4x its claim's lease keeps its key; a
    duplicate sent meanwhile to another worker waits (in-flight retries) and then
    replays the first run's result instead of running again."""
    w1 = start_worker(env, "w1")
    w2 = start_worker(env, "w2")
    first = slow.apply_async(("J1",))
    wait_for((env.dir / "slow-running-J1").exists, 20, w1.why)
    time.sleep(1.5 * SLOW_LEASE)  # past the lease: only heartbeats keep the key now
    duplicate = slow.apply_async(("J1",))
    wait_for(lambda: "slow claim in_flight" in env.lines("events.log"), 20, w2.why)
    (env.dir / "slow-go-J1").touch()
    result = first.get(timeout=30)
    assert duplicate.get(timeout=30) == result
    assert env.runs("slow") == [(result["fence"], 0, "finished")]  # one run, ever
    assert "slow claim replayed" in env.lines("events.log")
    assert "slow lost lost" not in env.lines("events.log")
    wait_for(lambda: env.unacked() == 0, 10, w2.why)


def test_a_retried_task_resumes_after_its_last_finished_step(env: Env) -> None:
    """``current_claim().step`` in a Celery task: the first run records step one, then
    fails into ``autoretry_for``; the retry finds step one recorded (its result, not a
    second effect) and runs step two only."""
    w1 = start_worker(env, "w1")
    value = fulfil.apply_async(("F1",)).get(timeout=30)
    effects = [json.loads(x) for x in env.lines("fulfil.log")]
    assert [e["step"] for e in effects] == ["charge", "mail"], w1.why()  # each effect once
    assert effects[1]["fence"] > effects[0]["fence"]  # step two: the retry's
    assert value == {
        "order": "F1",
        "charge": f"charge by fence {effects[0]['fence']}",  # recorded by the first run
        "mail": f"mail by fence {effects[1]['fence']}",
        "fence": effects[1]["fence"],
    }
    with idemlock.connect(env.store_url) as coord:
        status = coord.idempotency("fulfil").status("fulfil-F1")
    assert status is not None and status.state == "completed"


def test_concurrency_limit_runs_one_at_a_time_and_waits_use_no_retries(env: Env) -> None:
    """``idemlock_concurrency=1`` with two workers and ``max_retries=0``: while the
    test holds the tenant's only permit no body runs and the tasks are re-sent
    (keeping ``retries`` at 0); then each runs exactly once, one at a time."""
    names = [f"r{i}" for i in range(3)]
    coord = idemlock.connect(env.store_url)
    permits = coord.semaphore(idemlock.SemaphoreSpec("export.concurrency", limit=1, ttl=60))
    held = permits.acquire(EXPORT_TENANT, owner="the-test")
    assert held is not None
    w1 = start_worker(env, "w1")
    start_worker(env, "w2")
    results = [export.apply_async((n, 0.2)) for n in names]

    def log() -> list[dict[str, Any]]:
        return [json.loads(x) for x in env.lines("export.log")]

    def came_back() -> bool:
        attempts = [e["name"] for e in log() if e["event"] == "attempt"]
        return any(attempts.count(n) >= 2 for n in names)

    wait_for(came_back, 30, w1.why)
    assert [e for e in log() if e["event"] == "start"] == []
    assert permits.release(held)
    values = [r.get(timeout=60) for r in results]
    assert [v["report"] for v in values] == names
    assert all(v["retries"] == 0 for v in values)  # re-sent, never counted as a retry
    for n in names:
        assert [e["event"] for e in log() if e["name"] == n and e["event"] != "attempt"] == [
            "start",
            "end",
        ]
    assert most_at_once(log()) == EXPORT_LIMIT
    assert permits.holders(EXPORT_TENANT) == []
    coord.close()


# ---- with workers, against an idemlock store that goes down and comes back ---------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RedisServer]:
    """The idemlock store: a Redis that writes every command to its append-only file
    before answering, so a restart keeps the claims (a stop is SIGKILL)."""
    durable = ("--appendonly", "yes", "--appendfsync", "always")
    server = RedisServer(tmp_path / "store", free_port(), durable)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def store_env(broker: RedisServer, store: RedisServer, tmp_path: Path) -> Iterator[Env]:
    client: Any = broker.client()
    with client:
        client.flushall()
    _make_app_db(tmp_path)
    e = Env(broker, tmp_path, store.url)
    yield e
    for w in e.workers:
        w.stop()


def postrun_states(env: Env, task: str) -> list[str]:
    return [json.loads(x)[2] for x in env.lines("postrun.log") if task in x]


def test_store_down_before_the_body_retries_until_it_is_back(
    store_env: Env, store: RedisServer
) -> None:
    """The store is down when the task claims its key: the task is re-sent with backoff
    (never failed, never dropped) and runs exactly once when the store is back."""
    env = store_env
    store.stop()
    worker = start_worker(env, "w1")
    sent = deposit.apply_async(("acc-1", 10))
    wait_for(lambda: postrun_states(env, "deposit").count("RETRY") >= 2, 30, worker.why)
    assert env.runs("deposit") == []
    assert sent.state == "RETRY"
    store.start()
    result = sent.get(timeout=30)
    assert result["account"] == "acc-1" and result["amount"] == 10
    assert env.runs("deposit") == [(result["fence"], 0, "finished")]  # retries not used up
    log = worker.log.read_text()
    assert "idempotency store failed before the task ran" in log
    assert "store failure 2 in a row" in log  # the countdown grows with each failure
    with idemlock.connect(store.url) as coord:
        status = coord.idempotency("deposit").status("deposit-acc-1")
    assert status is not None and (status.state, status.fence) == ("completed", result["fence"])
    wait_for(lambda: env.unacked() == 0, 10, worker.why)


def test_store_down_when_recording_keeps_the_claim_and_records_it_later(
    store_env: Env, store: RedisServer
) -> None:
    """The store goes down while the body runs: its result is written again once the
    store is back (the claim is never abandoned), and a duplicate replays it."""
    env = store_env
    (env.dir / "hold-acc-2").touch()
    worker = start_worker(env, "w1")
    sent = deposit.apply_async(("acc-2", 20))
    wait_for((env.dir / "running-acc-2").exists, 30, worker.why)
    store.stop()
    (env.dir / "go-acc-2").touch()
    wait_for(lambda: "could not record the outcome" in worker.log.read_text(), 30, worker.why)
    assert sent.state != "FAILURE"
    store.start()
    result = sent.get(timeout=30)
    assert result["account"] == "acc-2"
    with idemlock.connect(store.url) as coord:
        status = coord.idempotency("deposit").status("deposit-acc-2")
    assert status is not None and (status.state, status.fence) == ("completed", result["fence"])
    again = deposit.apply_async(("acc-2", 20))
    assert again.get(timeout=20) == result
    assert env.runs("deposit") == [(result["fence"], 0, "finished")]  # one run, ever


def test_store_down_past_the_lease_fails_the_task_and_never_abandons(
    store_env: Env, store: RedisServer
) -> None:
    """The store stays down after the body ran until the claim's lease is over: the
    task fails with StoreUnavailable saying the key stays reserved, and the claim is
    never abandoned (a retry could otherwise run at once)."""
    env = store_env
    worker = start_worker(env, "w1")
    sent = deposit_short.apply_async(("acc-3",))
    wait_for((env.dir / "running-acc-3").exists, 30, worker.why)
    store.stop()
    (env.dir / "go-acc-3").touch()
    try:
        with pytest.raises(idemlock.StoreUnavailable, match="stays reserved until"):
            sent.get(timeout=30, propagate=True)
    finally:
        store.start()
    log = worker.log.read_text()
    assert log.count("could not record the outcome") >= 2  # written again while it lasted
    events = env.lines("events.log")
    assert "deposit-short claim claimed" in events
    assert not [e for e in events if " abandon " in e]  # never abandoned


# ---- without a worker: direct calls ---------------------------------------------------


class Declined(Exception):
    """A business outcome worth replaying."""


@pytest.fixture
def direct() -> Iterator[tuple[Celery, idemlock.Coordinator]]:
    coord = idemlock.connect("memory://")
    yield Celery("direct", set_as_current=False), coord
    coord.close()


def current_key() -> str:
    return str(current_task.request.idemlock_key)


def test_direct_call_runs_once_and_exposes_the_fence(
    direct: tuple[Celery, idemlock.Coordinator],
) -> None:
    capp, coord = direct
    seen: list[tuple[int, int, str]] = []

    @capp.task(
        bind=True,
        base=IdempotentTask,
        idemlock_coordinator=coord,
        idemlock_spec="charge",
        idemlock_key=lambda order_id, amount: f"order-{order_id}",
    )
    def charge(self: Any, order_id: str, amount: int) -> dict[str, int]:
        seen.append((self.request.idemlock_fence, current_fence(), self.request.idemlock_key))
        return {"amount": amount}

    assert charge("A1", 5) == {"amount": 5}
    assert charge("A1", amount=5) == {"amount": 5}  # replayed: same canonical arguments
    assert len(seen) == 1
    fence, fence_again, key = seen[0]
    assert fence == fence_again and key == "order-A1"
    status = coord.idempotency("charge").status("order-A1")
    assert status is not None and status.fence == fence
    with pytest.raises(idemlock.PayloadMismatch):
        charge("A1", 6)
    assert len(seen) == 1
    # Nothing leaks past the call into the task's shared default request.
    assert getattr(charge.request, "idemlock_fence", None) is None
    with pytest.raises(ConfigurationError):
        current_fence()


def test_lease_is_the_specs_and_the_time_limit_is_max_run(
    direct: tuple[Celery, idemlock.Coordinator],
) -> None:
    """The claim's lease no longer follows the time limit (heartbeats keep it); the
    time limit plus margin is how long it is renewed."""
    capp, coord = direct
    leases: dict[str, float] = {}
    lost: dict[str, bool] = {}
    keys: dict[str, str] = {}

    def record(name: str) -> None:
        status = coord.idempotency(name).status(current_key())
        assert status is not None
        leases[name] = (status.expires_at - datetime.now(timezone.utc)).total_seconds()

    options: dict[str, Any] = {
        "base": IdempotentTask,
        "idemlock_coordinator": coord,
        "idemlock_lease_margin": 0,
    }

    @capp.task(idemlock_spec="hard", time_limit=60, soft_time_limit=30, **options)
    def hard() -> None:
        record("hard")

    spec = IdempotencySpec("plain", lease=timedelta(seconds=123))

    @capp.task(idemlock_spec=spec, **options)
    def plain() -> None:
        record("plain")

    short = IdempotencySpec("short", lease=timedelta(seconds=0.6))

    @capp.task(idemlock_spec=short, soft_time_limit=0.5, **options)
    def limited() -> None:
        time.sleep(2.0)  # past max_run (0.5 s) + one lease: renewal stopped, lost
        claim = idemlock.current_claim()
        lost["limited"] = claim is not None and claim.lost
        keys["limited"] = current_key()

    @capp.task(idemlock_spec=IdempotencySpec("long", lease=short.lease), time_limit=60, **options)
    def unlimited() -> None:
        time.sleep(2.0)  # 3 leases: renewed all along
        claim = idemlock.current_claim()
        lost["unlimited"] = claim is not None and claim.lost

    hard()
    plain()
    limited()
    unlimited()
    assert 29 < leases["hard"] <= 30  # the spec's default lease, not the time limit
    assert 122 < leases["plain"] <= 123
    assert lost == {"limited": True, "unlimited": False}
    # Nobody took the key over: the lost claim's result was still recorded.
    status = coord.idempotency(short).status(keys["limited"])
    assert status is not None and status.state == "completed"


def test_in_flight_direct_call_raises(direct: tuple[Celery, idemlock.Coordinator]) -> None:
    capp, coord = direct
    runs: list[int] = []

    @capp.task(base=IdempotentTask, idemlock_coordinator=coord, idemlock_spec="busy",
               idemlock_key=lambda n: f"n-{n}")  # fmt: skip
    def busy(n: int) -> int:
        runs.append(n)
        return n

    claim = coord.idempotency("busy").claim("n-1", payload={"n": 1})
    assert isinstance(claim, idemlock.Claimed)
    with pytest.raises(InFlightError):
        busy(1)
    coord.idempotency("busy").complete(claim.token, 1)
    assert busy(1) == 1
    assert runs == []


def test_in_flight_wait_mode_waits_for_the_result(
    direct: tuple[Celery, idemlock.Coordinator],
) -> None:
    capp, coord = direct
    port = coord.idempotency("slow")
    claim = port.claim("n-1", payload={"n": 1})
    assert isinstance(claim, idemlock.Claimed)

    @capp.task(base=IdempotentTask, idemlock_coordinator=coord, idemlock_spec="slow",
               idemlock_key=lambda n: f"n-{n}", idemlock_on_in_flight="wait")  # fmt: skip
    def slow(n: int) -> int:
        raise AssertionError("the holder's result must be replayed")

    timer = threading.Timer(0.2, port.complete, (claim.token, 10))
    timer.start()
    started = time.monotonic()
    assert slow(1) == 10
    assert time.monotonic() - started >= 0.15
    timer.join(timeout=60)
    assert not timer.is_alive(), "still running after 60 s"


def test_coordinator_from_a_url_or_a_factory(monkeypatch: pytest.MonkeyPatch) -> None:
    capp = Celery("direct", set_as_current=False)
    monkeypatch.setenv("IDEMLOCK_URL", "memory://")
    made: list[idemlock.Coordinator] = []

    def factory() -> idemlock.Coordinator:
        made.append(idemlock.connect("memory://"))
        return made[-1]

    def one() -> int:
        return 1

    def two() -> int:
        return 2

    def three() -> int:
        return 3

    def four() -> int:
        return 4

    opts: dict[str, Any] = {"base": IdempotentTask}
    tasks = {
        "url": capp.task(idemlock_coordinator="memory://", idemlock_spec="u", **opts)(one),
        "env": capp.task(idemlock_spec="e", **opts)(two),  # $IDEMLOCK_URL
        "factory": capp.task(idemlock_coordinator=factory, idemlock_spec="f", **opts)(three),
        "bad": capp.task(idemlock_coordinator=lambda: "x", idemlock_spec="b", **opts)(four),
    }
    assert tasks["url"]() == tasks["url"]() == 1
    assert tasks["env"]() == 2
    assert tasks["factory"]() == tasks["factory"]() == 3
    assert len(made) == 1  # opened once per process, then reused
    assert made[0].idempotency("f").status(made[0].keys()[0].key) is not None
    with pytest.raises(ConfigurationError, match="idemlock_coordinator"):
        tasks["bad"]()


def test_failures_abandon_or_replay(direct: tuple[Celery, idemlock.Coordinator]) -> None:
    capp, coord = direct
    runs: list[str] = []

    @capp.task(
        bind=True,
        base=IdempotentTask,
        idemlock_coordinator=coord,
        idemlock_spec="flaky",
        idemlock_key=lambda what: what,
        idemlock_replay_errors=(Declined,),
    )
    def flaky(self: Any, what: str) -> str:
        runs.append(what)
        if what == "declined":
            raise Declined("card declined")
        if runs.count(what) == 1:
            raise OSError("transient")
        return what

    for _ in range(2):
        with pytest.raises(Declined, match="card declined"):
            flaky("declined")
    assert runs.count("declined") == 1  # the recorded error was replayed

    with pytest.raises(OSError):
        flaky("broken")
    assert coord.idempotency("flaky").status("broken") is None  # abandoned
    assert flaky("broken") == "broken"  # so the retry ran
    assert runs.count("broken") == 2


def test_retry_is_never_recorded(direct: tuple[Celery, idemlock.Coordinator]) -> None:
    capp, coord = direct
    runs: list[int] = []

    @capp.task(bind=True, base=IdempotentTask, idemlock_coordinator=coord,
               idemlock_spec="retrying", idemlock_replay_errors=(Exception,))  # fmt: skip
    def retrying(self: Any, n: int) -> int:
        runs.append(n)
        if len(runs) == 1:
            raise self.retry()  # celery.exceptions.Retry, an Exception: still not recorded
        return n

    with pytest.raises(Retry):
        retrying(3)
    assert coord.keys() == []  # abandoned
    assert retrying(3) == 3
    assert retrying(3) == 3
    assert runs == [3, 3]


def test_misconfiguration_fails_when_the_task_is_made() -> None:
    with pytest.raises(ConfigurationError, match="idemlock_spec"):

        class NoSpec(IdempotentTask):
            name = "no-spec"

            def run(self) -> None: ...

    with pytest.raises(ConfigurationError, match="idemlock_on_in_flight"):

        class BadMode(IdempotentTask):
            name = "bad-mode"
            idemlock_spec = "x"
            idemlock_on_in_flight = "ignore"

            def run(self) -> None: ...

    class Base(IdempotentTask):  # no run(): a base for tasks, not checked
        idemlock_coordinator = "memory://"


# ---- duplicate sends (apply_async_once / delay_once) ----------------------------------


def queued(env: Env) -> int:
    """Messages waiting in the test queue (none taken by a worker yet)."""
    client: Any = env.broker.client()
    with client:
        return int(client.llen(app.conf.task_default_queue))


@pytest.fixture
def sender(env: Env, monkeypatch: pytest.MonkeyPatch) -> Iterator[Env]:
    """The test process as a sender: its tasks open the env's store (as the workers
    do), and forget it afterwards, since each test has a store of its own."""
    monkeypatch.setenv(ENV_STORE, env.store_url)
    monkeypatch.setenv(ENV_DIR, str(env.dir))
    names = ("idemlock_test.deposit_short", "idemlock_test.pay", "idemlock_test.flaky")
    tasks = [type(app.tasks[name]) for name in names]
    for cls in tasks:
        cls._idemlock_state = None
    yield env
    for cls in tasks:
        state = cls._idemlock_state
        if state is not None:
            state.coord.close()
        cls._idemlock_state = None


def test_send_once_refuses_a_queued_or_running_key_and_accepts_after_it_ran(
    sender: Env,
) -> None:
    env = sender
    first = deposit_short.apply_async_once(("Q1",), lease=30)
    assert first is not None
    assert deposit_short.delay_once("Q1") is None  # queued: refused, nothing sent
    assert deposit_short.apply_async_once(kwargs={"account": "Q1"}) is None  # same key
    assert queued(env) == 1
    w1 = start_worker(env, "w1")
    wait_for((env.dir / "running-Q1").exists, 20, w1.why)
    assert deposit_short.delay_once("Q1") is None  # running
    (env.dir / "go-Q1").touch()
    result = first.get(timeout=20)
    # Done, and the worker released the send lease (30 s): accepted, and it replays.
    again = deposit_short.delay_once("Q1")
    assert again is not None
    assert again.get(timeout=20) == result
    assert env.lines("events.log").count("deposit-short claim claimed") == 1
    assert env.lines("events.log").count("deposit-short claim replayed") == 1
    # Celery stores the result before it sends task_postrun: get() may return first.
    wait_for(lambda: len(env.lines("postrun.log")) >= 2, 20, w1.why)
    postrun = [json.loads(x) for x in env.lines("postrun.log")]
    assert [p[1:] for p in postrun] == [[first.id, "SUCCESS", False], [again.id, "SUCCESS", True]]
    # The replayed task released its send lease too: the next send is accepted.
    third = deposit_short.delay_once("Q1")
    assert third is not None and third.get(timeout=20) == result


def test_enqueue_once_the_shared_form_refuses_while_queued_or_running(sender: Env) -> None:
    """``enqueue_once(task, args=, kwargs=, lease=, **options)``, the form every queue
    integration shares, is ``apply_async_once``."""
    env = sender
    first = enqueue_once(deposit_short, args=("S1",), lease=30)
    assert first is not None
    assert enqueue_once(deposit_short, kwargs={"account": "S1"}, lease=30) is None  # queued
    assert queued(env) == 1
    w1 = start_worker(env, "w1")
    wait_for((env.dir / "running-S1").exists, 20, w1.why)
    assert enqueue_once(deposit_short, args=["S1"]) is None  # running
    (env.dir / "go-S1").touch()
    result = first.get(timeout=20)
    # Done: accepted (Celery's own options pass through), and it replays.
    again = enqueue_once(deposit_short, args=("S1",), lease=30, countdown=0)
    assert again is not None and again.get(timeout=20) == result
    assert env.lines("events.log").count("deposit-short claim claimed") == 1
    with pytest.raises(ConfigurationError, match="base=IdempotentTask"):
        enqueue_once(app.tasks["celery.backend_cleanup"], args=())
    with pytest.raises(ConfigurationError, match="args= must be a tuple or list"):
        enqueue_once(deposit_short, args="S1")


def test_send_once_lease_frees_the_key_of_a_lost_task(sender: Env) -> None:
    env = sender
    assert deposit_short.apply_async_once(("L1",), lease=1.0) is not None
    app.control.purge()  # the broker lost it before any worker ran it
    assert queued(env) == 0
    assert deposit_short.apply_async_once(("L1",), lease=1.0) is None  # its lease holds
    time.sleep(1.2)
    assert deposit_short.apply_async_once(("L1",), lease=1.0) is not None
    assert queued(env) == 1


def test_send_once_a_retrying_task_keeps_its_send_lease(sender: Env) -> None:
    env = sender
    first = flaky.delay_once("R1")
    assert first is not None
    w1 = start_worker(env, "w1")
    wait_for((env.dir / "flaky-retried-R1").exists, 20, w1.why)
    wait_for(lambda: "flaky abandon ok" in env.lines("events.log"), 10, w1.why)
    # Waiting for its countdown, with no claim: the send lease alone refuses.
    assert flaky.delay_once("R1") is None
    assert first.get(timeout=20) == {"job": "R1", "retries": 1}
    # The retried message carried the lease and released it when it ran.
    again = flaky.delay_once("R1")
    if again is None:  # say who still holds the key (the worker's log tells why)
        with idemlock.connect(env.store_url) as coord:
            owner = coord.lock(send_lock_spec("flaky", 600)).owner("flaky-R1")
            status = coord.idempotency("flaky").status("flaky-R1")
        pytest.fail(
            f"the send was refused: send lease held by {owner!r} (the first send was "
            f"{first.id}), record {status}\n{w1.why()}"
        )
    assert again.get(timeout=20) == {"job": "R1", "retries": 1}


def test_plain_sends_are_never_refused_and_take_no_send_lease(sender: Env) -> None:
    env = sender
    assert pay.apply_async(("P1", 5)) is not None
    assert pay.delay("P1", 5) is not None
    assert queued(env) == 2  # both queued: the opt-out default is unchanged
    assert pay.delay_once("P1", 5) is not None  # neither took the key's send lease
    assert pay.delay_once("P1", 5) is None
    assert queued(env) == 3


def test_send_once_eager_runs_releases_and_replays(
    direct: tuple[Celery, idemlock.Coordinator],
) -> None:
    capp, coord = direct
    capp.conf.task_always_eager = True
    runs: list[str] = []

    @capp.task(bind=True, base=IdempotentTask, idemlock_coordinator=coord,
               idemlock_spec="eager-once", idemlock_key=lambda order_id: order_id,
               idemlock_send_lease=60)  # fmt: skip
    def charge(self: Any, order_id: str) -> str:
        runs.append(order_id)
        return f"charged {order_id}"

    first = charge.delay_once("E1")
    assert first is not None and first.get(timeout=60) == "charged E1"
    # Ran and released its send lease (60 s): a new send is accepted and replays.
    again = charge.apply_async_once(("E1",), countdown=0)
    assert again is not None and again.get(timeout=60) == "charged E1"
    assert runs == ["E1"]
    with pytest.raises(ConfigurationError, match="send lease"):
        charge.apply_async_once(("E2",), lease=0)
    assert runs == ["E1"]
    # Running is refused by the claim itself, whatever the send lease.
    port = coord.idempotency("eager-once")
    claim = port.claim("E3")
    assert isinstance(claim, idemlock.Claimed)
    assert charge.delay_once("E3") is None
    port.abandon(claim.token)
    sent = charge.delay_once("E3")
    assert sent is not None and sent.get(timeout=60) == "charged E3"
    assert runs == ["E1", "E3"]


def test_send_once_misconfigured_lease_fails_when_the_task_is_made() -> None:
    with pytest.raises(ConfigurationError, match="idemlock_send_lease"):

        class BadLease(IdempotentTask):
            name = "bad-lease"
            idemlock_spec = "x"
            idemlock_send_lease = -1.0

            def run(self) -> None: ...
