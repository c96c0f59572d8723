"""The Dramatiq integration with real ``dramatiq`` worker processes on a real Redis
broker (the idemlock store on db 1 of the same server). The actor lives in
tests/dramatiq_app.py and writes what it does into a log file this test reads."""

from __future__ import annotations

import importlib
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import idemlock
from idemlock import ConfigurationError
from idemlock.integrations.dramatiq import enqueue_once, send_once

from .queue_jobs import (
    LEASE,
    SPEC,
    TENANT,
    coordinator,
    limited_permits,
    long_spec,
    make_quick,
    most_at_once,
    read_log,
)
from .servers._proc import popen
from .servers.redis import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[1]
#: the workers import the tests and the very idemlock this process imported
WORKER_PATH = os.pathsep.join([str(ROOT), str(Path(idemlock.__file__).resolve().parents[1])])
NAMESPACE = f"dq{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def app(redis_server: RedisServer) -> Iterator[ModuleType]:
    os.environ["IDEMLOCK_JOBS_BROKER"] = redis_server.url
    os.environ["IDEMLOCK_JOBS_NAMESPACE"] = NAMESPACE
    module = importlib.import_module("tests.dramatiq_app")
    yield module
    module.broker.flush_all()


class Env:
    def __init__(self, server: RedisServer, tmp: Path, app: ModuleType) -> None:
        self.app = app
        self.store = server.url.rsplit("/", 1)[0] + "/1"
        self.log = tmp / "jobs.log"
        self.store_file = tmp / "store-url"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.vars = {
            "IDEMLOCK_JOBS_LOG": str(self.log),
            "IDEMLOCK_JOBS_STORE": self.store,
            "IDEMLOCK_JOBS_STORE_FILE": str(self.store_file),
            "IDEMLOCK_JOBS_PREFIX": f"t{uuid.uuid4().hex[:12]}",
            "IDEMLOCK_JOBS_BROKER": server.url,
            "IDEMLOCK_JOBS_NAMESPACE": NAMESPACE,
        }

    def worker(self) -> subprocess.Popen[bytes]:
        env = {**os.environ, **self.vars, "PYTHONPATH": WORKER_PATH}
        proc = popen(
            [sys.executable, "-m", "dramatiq", "tests.dramatiq_app", "-p", "1", "-t", "2"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.log.with_suffix(".worker.err"), "ab"),  # noqa: SIM115
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def events(self, name: str, event: str | None = None) -> list[dict[str, Any]]:
        return [
            e
            for e in read_log(self.log)
            if e.get("name") == name and (event is None or e["event"] == event)
        ]

    def reschedules(self, message: Any) -> int:
        """How often the workers' ``Retries`` middleware sent ``message`` back (it logs
        each one to the worker's stderr)."""
        err = self.log.with_suffix(".worker.err")
        if not err.exists():
            return 0
        ref = message.message_id
        return sum(
            1 for line in err.read_text().splitlines() if ref in line and "Retrying message" in line
        )

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs:
            self.kill(proc)


@pytest.fixture
def env(
    redis_server: RedisServer, tmp_path: Path, app: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Env]:
    e = Env(redis_server, tmp_path, app)
    for k, v in e.vars.items():
        monkeypatch.setenv(k, v)
    app.dq_job.fn.idemlock_guard._state = None  # this process's guard: reopen from the env
    try:
        yield e
    finally:
        e.stop()


def wait_for(what: Callable[[], Any], timeout: float = 30.0, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}")


def result(message: Any, timeout: float = 30.0) -> Any:
    from dramatiq.results import ResultMissing

    def ready() -> Any:
        try:
            return [message.get_result()]
        except ResultMissing:
            return None

    return wait_for(ready, timeout=timeout, step=0.1)[0]


def test_runs_once_and_a_duplicate_of_a_completed_message_is_replayed(env: Env) -> None:
    env.worker()
    first = env.app.dq_job.send("a", 0.0)
    one = result(first)
    dup = env.app.dq_job.send("a", 0.0)
    assert result(dup) == one
    assert len(env.events("a", "start")) == 1
    status = coordinator().idempotency(SPEC).status("a")
    assert status is not None and status.state == "completed"


def test_a_failure_abandons_and_dramatiqs_retry_runs_it_again(env: Env) -> None:
    env.worker()
    msg = env.app.dq_job.send("f", 0.0, True)
    value = result(msg)
    starts = env.events("f", "start")
    assert len(starts) == 2 and len(env.events("f", "fail")) == 1
    assert starts[1]["fence"] > starts[0]["fence"]
    assert value["fence"] == starts[1]["fence"]


def test_a_retried_message_resumes_after_its_last_finished_step(env: Env) -> None:
    """``current_claim().step`` in a Dramatiq actor: the first delivery records step
    one, then fails; the Retries middleware's redelivery finds step one recorded (its
    result, not a second effect) and runs step two only."""
    env.worker()
    value = result(env.app.dq_steps_job.send("st"))
    effects = env.events("st", "effect")
    assert [e["step"] for e in effects] == ["one", "two"]  # each effect once
    assert len(env.events("st", "fail")) == 1
    assert effects[1]["fence"] > effects[0]["fence"]  # step two: the redelivery's
    assert value == {
        "name": "st",
        "one": f"one by fence {effects[0]['fence']}",  # recorded by the first delivery
        "two": f"two by fence {effects[1]['fence']}",
        "fence": effects[1]["fence"],
    }
    status = coordinator().idempotency(SPEC).status("st")
    assert status is not None and status.state == "completed"


def test_worker_sigkilled_mid_message_reruns_only_after_the_lease_ends(env: Env) -> None:
    worker = env.worker()
    msg = env.app.dq_job.send("k", 60.0)  # until it is killed, however slow the machine
    first = wait_for(lambda: env.events("k", "start"))[0]
    time.sleep(LEASE * 1.2)  # renewed past its first lease while it runs
    coord = coordinator()
    status = coord.idempotency(SPEC).status("k")
    assert status is not None and status.state == "in_flight"
    make_quick(env.log, "k")  # the rerun's body (this one sleeps on until killed)
    env.kill(worker)  # the whole worker: main process and the one running the body
    expires = coord.idempotency(SPEC).status("k").expires_at.timestamp()  # type: ignore[union-attr]
    env.worker()  # the broker gives it the dead worker's message
    second = wait_for(lambda: env.events("k", "start")[1:], timeout=60)[0]
    assert second["t"] >= expires - 0.05
    assert second["fence"] > first["fence"]
    assert result(msg, 60)["fence"] == second["fence"]
    assert len(env.events("k", "start")) == 2


def test_a_redelivery_that_meets_the_dead_claim_waits_for_its_lease(env: Env) -> None:
    worker = env.worker()
    msg = env.app.dq_long_job.send("w", 3.0)
    first = wait_for(lambda: env.events("w", "start"))[0]
    time.sleep(0.5)
    make_quick(env.log, "w")  # the rerun's body (this one sleeps on until killed)
    env.kill(worker)
    status = coordinator().idempotency(long_spec(env.app.LONG_LEASE)).status("w")
    assert status is not None and status.state == "in_flight"
    expires = status.expires_at.timestamp()
    env.worker()
    second = wait_for(lambda: env.events("w", "start")[1:], timeout=env.app.LONG_LEASE + 20)[0]
    assert second["t"] >= expires - 0.05
    assert second["fence"] > first["fence"]
    assert result(msg, 30)["fence"] == second["fence"]
    assert len(env.events("w", "start")) == 2


def test_a_message_slower_than_its_lease_is_not_run_twice_by_a_duplicate(env: Env) -> None:
    env.worker()
    slow = env.app.dq_job.send("s", LEASE * 3)
    wait_for(lambda: env.events("s", "start"))
    dup = env.app.dq_job.send("s", LEASE * 3)
    assert result(slow) == result(dup)
    assert len(env.events("s", "start")) == 1


def test_store_down_before_the_body_retries_never_fails(env: Env) -> None:
    env.store_file.write_text(f"redis://127.0.0.1:{free_port()}/1?timeout=0.5")
    env.worker()
    msg = env.app.dq_job.send("d", 0.0)
    wait_for(lambda: env.reschedules(msg) >= 2)  # several deliveries meet the dead store
    assert env.events("d") == []
    env.store_file.unlink()  # the store is back; the worker process reopens
    env.stop()
    env.worker()
    assert result(msg)["name"] == "d"
    assert len(env.events("d", "start")) == 1


def test_reschedules_while_a_key_is_held_do_not_use_up_max_retries(env: Env) -> None:
    """Issue 21 item 8: a duplicate of a message that runs many retry intervals meets
    the key in flight again and again; it replays the first run's result instead of
    failing once ``max_retries`` reschedules are spent."""
    env.worker()
    actor = env.app.dq_tight_job
    seconds = env.app.TIGHT_RETRY * 15
    first = actor.send("t", seconds)
    wait_for(lambda: env.events("t", "start"))
    dup = actor.send("t", seconds)
    one = result(first)
    assert result(dup) == one  # replayed, not failed with its retries used up
    assert env.reschedules(dup) > env.app.TIGHT_RETRIES  # more than Dramatiq allows
    assert len(env.events("t", "start")) == 1


def test_reschedules_while_the_store_is_down_do_not_use_up_max_retries(
    env: Env, tmp_path: Path
) -> None:
    from dramatiq.results import ResultMissing

    store = RedisServer(tmp_path / "store", free_port())  # not started yet: down
    env.store_file.write_text(store.url.rsplit("/", 1)[0] + "/1?timeout=0.2")
    env.worker()
    msg = env.app.dq_tight_job.send("down", 0.0)

    def rescheduled_or_over() -> bool:
        try:
            msg.get_result()
        except ResultMissing:
            return env.reschedules(msg) > env.app.TIGHT_RETRIES + 1
        return True  # a result (or a failure) is recorded: it is over

    wait_for(rescheduled_or_over)
    assert env.reschedules(msg) > env.app.TIGHT_RETRIES + 1  # still coming back
    assert env.events("down") == []
    store.start()  # the store is back where the worker looks for it
    try:
        assert result(msg)["name"] == "down"
    finally:
        store.stop()
    assert len(env.events("down", "start")) == 1


def test_without_a_current_message_a_reschedule_warns_that_it_counts(
    env: Env, caplog: pytest.LogCaptureFixture
) -> None:
    """Called where no CurrentMessage is set (directly, or by a broker without the
    middleware), idemlock cannot take the retry back: it says so and how to fix it."""
    import dramatiq

    guard = env.app.dq_tight_job.fn.idemlock_guard
    env.store_file.write_text(f"redis://127.0.0.1:{free_port()}/1?timeout=0.2")
    guard._state = None
    try:
        with caplog.at_level(logging.WARNING, "idemlock.jobs"), pytest.raises(dramatiq.Retry):
            env.app.dq_tight_job.fn("nomsg")
    finally:
        guard._state = None
    assert "add the CurrentMessage middleware" in caplog.text


def test_enqueue_once_refuses_a_queued_or_running_key(env: Env) -> None:
    actor = env.app.dq_job

    def send() -> Any:
        return enqueue_once(actor, args=("o",), kwargs={"seconds": 2.0}, lease=30)

    first = send()
    assert first is not None
    assert send() is None  # queued
    env.worker()
    wait_for(lambda: env.events("o", "start"))
    assert send() is None  # running
    result(first)
    again = send()  # done: accepted (and replayed)
    assert again is not None
    assert result(again) == result(first)
    assert len(env.events("o", "start")) == 1


def test_enqueue_once_lease_frees_a_key_whose_message_was_lost(env: Env) -> None:
    actor = env.app.dq_job
    assert enqueue_once(actor, args=("lost",), lease=1.0) is not None
    env.app.broker.flush(actor.queue_name)  # lost before any worker ran it
    assert enqueue_once(actor, args=("lost",), lease=1.0) is None
    time.sleep(1.2)
    assert enqueue_once(actor, args=("lost",), lease=1.0) is not None
    env.app.broker.flush(actor.queue_name)


def test_enqueue_once_passes_dramatiqs_own_options(env: Env) -> None:
    actor = env.app.dq_job
    sent = enqueue_once(actor, args=("opt",), lease=30, max_retries=7, delay=1)
    assert sent is not None and sent.options["max_retries"] == 7
    env.app.broker.flush(actor.queue_name)
    env.app.broker.flush(f"{actor.queue_name}.DQ")  # the delay queue


def test_send_once_the_deprecated_form_warns_and_still_sends_once(env: Env) -> None:
    actor = env.app.dq_job
    with pytest.warns(DeprecationWarning, match=r"call enqueue_once\(actor, args=") as rec:
        first = send_once(actor, "d", seconds=1.0, lease=30)
    assert rec[0].filename == __file__  # it points at the caller's line
    assert first is not None
    with pytest.warns(DeprecationWarning):
        assert send_once(actor, "d", 1.0, lease=30) is None  # queued
    env.worker()
    value = result(first)
    with pytest.warns(DeprecationWarning):
        again = send_once(actor, "d", seconds=1.0, lease=30)
    assert again is not None and result(again) == value
    assert len(env.events("d", "start")) == 1


def test_send_once_needs_an_idempotent_actor(app: ModuleType) -> None:
    import dramatiq

    @dramatiq.actor(broker=app.broker)
    def plain() -> None:
        pass

    with pytest.raises(ConfigurationError, match="@idempotent"):
        enqueue_once(plain)


def test_concurrency_limit_runs_one_at_a_time_and_waits_use_no_retries(env: Env) -> None:
    """``concurrency=1`` on a worker with two threads, and ``max_retries=0``: while the
    test holds the tenant's only permit no body runs and the messages are sent back
    (a counted retry would fail them); then each runs exactly once, one at a time."""
    names = [f"lim{i}" for i in range(4)]
    permits = coordinator().semaphore(limited_permits(env.app.LIMIT))
    held = permits.acquire(TENANT, owner="the-test")
    assert held is not None
    env.worker()
    messages = [env.app.dq_limited_job.send(n, 0.2) for n in names]
    wait_for(lambda: any(len(env.events(n, "attempt")) >= 2 for n in names))
    assert [e for n in names for e in env.events(n, "start")] == []
    assert permits.release(held)
    results = [result(m) for m in messages]  # a failed message raises here
    assert [r["name"] for r in results] == names
    for n in names:
        assert len(env.events(n, "start")) == len(env.events(n, "end")) == 1, n
    assert most_at_once([e for n in names for e in env.events(n)]) == 1
    assert sum(env.reschedules(m) for m in messages) >= 1  # sent back, uncounted
    assert permits.holders(TENANT) == []
