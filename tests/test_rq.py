"""The RQ integration with real ``rq worker`` processes on a real Redis (the queue on
db 0, the idemlock store on db 1). The jobs live in tests/queue_jobs.py and write what
they do into a log file this test reads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from redis import Redis
from rq import Queue, Retry
from rq.job import Job, JobStatus
from rq.registry import StartedJobRegistry
from rq.scheduler import SCHEDULER_LOCKING_KEY_TEMPLATE

import idemlock
from idemlock import ConfigurationError
from idemlock.integrations.rq import enqueue_once

from .queue_jobs import (
    LEASE,
    LIMITED_SPEC,
    SPEC,
    TENANT,
    coordinator,
    limited_permits,
    make_quick,
    most_at_once,
    read_log,
    rq_job,
    rq_limited_job,
    rq_steps_job,
)
from .servers._proc import popen
from .servers.redis import RedisServer, free_port

ROOT = Path(__file__).resolve().parents[1]
#: the workers import the tests and the very idemlock this process imported
WORKER_PATH = os.pathsep.join([str(ROOT), str(Path(idemlock.__file__).resolve().parents[1])])


class Env:
    def __init__(self, server: RedisServer, tmp: Path) -> None:
        self.broker = server.url
        self.store = server.url.rsplit("/", 1)[0] + "/1"
        self.log = tmp / "jobs.log"
        self.store_file = tmp / "store-url"
        self.queue_name = f"q{uuid.uuid4().hex[:8]}"
        self.redis = Redis.from_url(self.broker)
        self.queue = Queue(self.queue_name, connection=self.redis)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.vars = {
            "IDEMLOCK_JOBS_LOG": str(self.log),
            "IDEMLOCK_JOBS_STORE": self.store,
            "IDEMLOCK_JOBS_STORE_FILE": str(self.store_file),
            "IDEMLOCK_JOBS_PREFIX": f"t{uuid.uuid4().hex[:12]}",
        }

    def worker(self) -> subprocess.Popen[bytes]:
        env = {**os.environ, **self.vars, "PYTHONPATH": WORKER_PATH}
        proc = popen(
            [
                sys.executable,
                "-m",
                "rq.cli",
                "worker",
                "--with-scheduler",
                "--url",
                self.broker,
                self.queue_name,
            ],
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

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


@pytest.fixture
def env(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Env]:
    e = Env(redis_server, tmp_path)
    for k, v in e.vars.items():
        monkeypatch.setenv(k, v)
    # The test process's own guard (enqueue_once) opens its coordinator from the env.
    rq_job.idemlock_guard._state = None  # type: ignore[attr-defined]
    rq_limited_job.idemlock_guard._state = None  # type: ignore[attr-defined]
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


def finished(job: Job) -> Any:
    status = job.get_status(refresh=True)
    assert status != JobStatus.FAILED, job.latest_result()
    return status == JobStatus.FINISHED


def test_runs_once_and_a_duplicate_of_a_completed_job_is_replayed(env: Env) -> None:
    env.worker()
    first = env.queue.enqueue(rq_job, "a", 0.0)
    wait_for(lambda: finished(first))
    dup = env.queue.enqueue(rq_job, "a", 0.0)
    wait_for(lambda: finished(dup))
    assert dup.return_value() == first.return_value()
    assert len(env.events("a", "start")) == 1
    status = coordinator().idempotency(SPEC).status("a")
    assert status is not None and status.state == "completed"


def test_a_failure_abandons_and_rqs_retry_runs_it_again_with_a_higher_fence(env: Env) -> None:
    env.worker()
    job = env.queue.enqueue(rq_job, "f", 0.0, True, retry=Retry(max=2))
    wait_for(lambda: finished(job), timeout=30)
    starts = env.events("f", "start")
    assert len(starts) == 2 and len(env.events("f", "fail")) == 1
    assert starts[1]["fence"] > starts[0]["fence"]
    assert job.return_value()["fence"] == starts[1]["fence"]


def test_a_retried_job_resumes_after_its_last_finished_step(env: Env) -> None:
    """``current_claim().step`` in an RQ job: the first run records step one, then
    fails; RQ's retry finds step one recorded (its result, not a second effect) and runs
    step two only."""
    env.worker()
    job = env.queue.enqueue(rq_steps_job, "st", retry=Retry(max=2))
    wait_for(lambda: finished(job), timeout=30)
    effects = env.events("st", "effect")
    assert [e["step"] for e in effects] == ["one", "two"]  # each effect once
    assert len(env.events("st", "fail")) == 1
    assert effects[1]["fence"] > effects[0]["fence"]  # step two: the retry's
    assert job.return_value() == {
        "name": "st",
        "one": f"one by fence {effects[0]['fence']}",  # recorded by the first run
        "two": f"two by fence {effects[1]['fence']}",
        "fence": effects[1]["fence"],
    }
    status = coordinator().idempotency(SPEC).status("st")
    assert status is not None and status.state == "completed"


def test_work_horse_sigkilled_mid_job_reruns_only_after_the_lease_ends(env: Env) -> None:
    env.worker()
    job = env.queue.enqueue(rq_job, "k", 30.0, retry=Retry(max=2))
    first = wait_for(lambda: env.events("k", "start"))[0]
    # Let a few heartbeats pass: the claim is kept alive past its lease while it runs.
    time.sleep(LEASE * 1.5)
    coord = coordinator()
    status = coord.idempotency(SPEC).status("k")
    assert status is not None and status.state == "in_flight"
    make_quick(env.log, "k")  # the rerun's body (this one sleeps on until killed)
    os.kill(first["pid"], signal.SIGKILL)  # the work horse running the body
    killed_at = time.time()
    expires = coord.idempotency(SPEC).status("k").expires_at.timestamp()  # type: ignore[union-attr]
    # The retried job meets the dead claim and waits for its lease.
    second = wait_for(lambda: env.events("k", "start")[1:], timeout=40)[0]
    assert second["t"] >= expires - 0.05, (second["t"] - killed_at, expires - killed_at)
    assert second["fence"] > first["fence"]
    wait_for(lambda: finished(job), timeout=40)
    assert job.return_value()["fence"] == second["fence"]
    assert len(env.events("k", "start")) == 2  # and no third run


def test_whole_worker_sigkilled_its_abandoned_job_reruns_only_after_the_lease_ends(
    env: Env,
) -> None:
    worker = env.worker()
    job = env.queue.enqueue(rq_job, "w", 30.0, retry=Retry(max=2))
    first = wait_for(lambda: env.events("w", "start"))[0]
    time.sleep(LEASE * 1.2)
    make_quick(env.log, "w")  # the rerun's body (this one sleeps on until killed)
    # The worker and its work horse (which RQ puts in a process group of its own).
    os.killpg(worker.pid, signal.SIGKILL)
    os.kill(first["pid"], signal.SIGKILL)
    worker.wait(10)
    status = coordinator().idempotency(SPEC).status("w")
    assert status is not None and status.state == "in_flight"
    expires = status.expires_at.timestamp()
    # RQ's own maintenance finds the abandoned job once the dead worker's heartbeat is
    # old (a minute at least), when the dead worker's scheduler lock (as long) has
    # expired too; bring both about now, as a minute's wait would.
    StartedJobRegistry(queue=env.queue).cleanup(timestamp=time.time() + 3600)
    env.redis.delete(SCHEDULER_LOCKING_KEY_TEMPLATE % env.queue_name)
    env.worker()
    second = wait_for(lambda: env.events("w", "start")[1:], timeout=40)[0]
    assert second["t"] >= expires - 0.05
    assert second["fence"] > first["fence"]
    wait_for(lambda: finished(job), timeout=40)
    assert job.return_value()["fence"] == second["fence"]
    assert len(env.events("w", "start")) == 2  # and no third run


def test_a_job_slower_than_its_lease_is_not_run_twice_by_a_duplicate(env: Env) -> None:
    env.worker()
    env.worker()
    slow = env.queue.enqueue(rq_job, "s", LEASE * 3)
    wait_for(lambda: env.events("s", "start"))
    # Its own retry budget is one retry: the reschedules while the key is held (one
    # a second for 3 leases) must not use it up (issue 21 item 8).
    dup = env.queue.enqueue(rq_job, "s", LEASE * 3, retry=Retry(max=1))
    wait_for(lambda: finished(slow), timeout=40)
    wait_for(lambda: finished(dup), timeout=40)
    assert len(env.events("s", "start")) == 1
    assert dup.return_value() == slow.return_value()
    dup.refresh()
    assert (dup.number_of_retries or 0) > 1  # rescheduled more often than its budget
    assert dup.retries_left == 1  # and the budget is untouched


def test_store_down_before_the_body_reschedules_never_fails(env: Env) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/1?timeout=0.5"
    env.store_file.write_text(dead)
    env.worker()
    job = env.queue.enqueue(rq_job, "d", 0.0)
    # Each horse fails to reach the store and the job is scheduled again.
    wait_for(lambda: job.get_status(refresh=True) == JobStatus.SCHEDULED, timeout=20)
    assert env.events("d") == []
    env.store_file.unlink()  # the store is back
    wait_for(lambda: finished(job), timeout=30)
    assert len(env.events("d", "start")) == 1


def test_called_directly_it_runs_and_replays(env: Env) -> None:
    assert rq_job("direct") == rq_job("direct")
    assert len(env.events("direct", "start")) == 1


def test_enqueue_once_refuses_a_queued_or_running_key(env: Env) -> None:
    first = enqueue_once(env.queue, rq_job, args=("o",), kwargs={"seconds": 2.0}, lease=30)
    assert first is not None
    assert (
        enqueue_once(env.queue, rq_job, args=("o",), kwargs={"seconds": 2.0}, lease=30) is None
    )  # queued
    env.worker()
    wait_for(lambda: env.events("o", "start"))
    assert (
        enqueue_once(env.queue, rq_job, args=("o",), kwargs={"seconds": 2.0}, lease=30) is None
    )  # running
    wait_for(lambda: finished(first))
    # Done: a new send is accepted (and replays).
    again = enqueue_once(env.queue, rq_job, args=("o",), kwargs={"seconds": 2.0}, lease=30)
    assert again is not None
    wait_for(lambda: finished(again))
    assert len(env.events("o", "start")) == 1


def test_enqueue_once_lease_frees_a_key_whose_job_was_lost(env: Env) -> None:
    job = enqueue_once(env.queue, rq_job, args=("lost",), lease=1.0)
    assert job is not None
    env.queue.empty()  # the job is lost before any worker ran it
    assert enqueue_once(env.queue, rq_job, args=("lost",), lease=1.0) is None
    time.sleep(1.2)
    assert enqueue_once(env.queue, rq_job, args=("lost",), lease=1.0) is not None


def test_enqueue_once_the_deprecated_positional_form_warns_and_still_sends_once(
    env: Env,
) -> None:
    with pytest.warns(DeprecationWarning, match=r"call enqueue_once\(queue, fn, args=") as rec:
        first = enqueue_once(env.queue, rq_job, ("d",), {"seconds": 1.0}, lease=30)
    assert rec[0].filename == __file__  # it points at the caller's line
    assert first is not None and first.args == ("d",) and first.kwargs == {"seconds": 1.0}
    with pytest.warns(DeprecationWarning):
        assert enqueue_once(env.queue, rq_job, ("d", 1.0), lease=30) is None  # same key
    env.worker()
    wait_for(lambda: finished(first))
    with pytest.warns(DeprecationWarning):
        again = enqueue_once(env.queue, rq_job, ("d",), {"seconds": 1.0}, lease=30)
    assert again is not None
    wait_for(lambda: finished(again))
    assert again.return_value() == first.return_value()
    assert len(env.events("d", "start")) == 1


def test_enqueue_once_refuses_arguments_it_cannot_send(env: Env) -> None:
    with pytest.raises(ConfigurationError, match=r"args= must be a tuple or list"):
        enqueue_once(env.queue, rq_job, args="o-7")
    with pytest.raises(ConfigurationError, match=r"kwargs= must be a dict"):
        bad: Any = [("seconds", 1.0)]
        enqueue_once(env.queue, rq_job, args=("o",), kwargs=bad)
    with pytest.raises(
        ConfigurationError, match=r"the send lease\) must be a positive number of seconds"
    ):
        enqueue_once(env.queue, rq_job, args=("o",), lease=0)
    with pytest.raises(ConfigurationError, match=r"args=\(\.\.\.\) and kwargs=\{\.\.\.\} only"):
        enqueue_once(env.queue, rq_job, ("o",), args=("o",))
    with pytest.raises(ConfigurationError, match="@idempotent_job"):
        enqueue_once(env.queue, print, args=("o",))
    assert env.queue.count == 0


def test_concurrency_limit_runs_one_at_a_time_and_waits_use_no_retries(env: Env) -> None:
    """``concurrency=1`` with two workers: while the test holds the tenant's only
    permit no body runs (the jobs are sent back, again and again, without using their
    one retry); once it is free, every job runs exactly once, never two at a time."""
    names = [f"lim{i}" for i in range(3)]
    permits = coordinator().semaphore(limited_permits(1))
    held = permits.acquire(TENANT, owner="the-test")
    assert held is not None
    env.worker()
    env.worker()
    jobs = [env.queue.enqueue(rq_limited_job, n, 0.2, retry=Retry(max=1)) for n in names]
    # Some job reached the permit, was sent back, and came back for it again.
    wait_for(lambda: any(len(env.events(n, "attempt")) >= 2 for n in names))
    assert [e for n in names for e in env.events(n, "start")] == []
    assert permits.release(held)
    for job in jobs:
        wait_for(lambda job=job: finished(job), timeout=60)  # type: ignore[misc]
    events = [e for n in names for e in env.events(n)]
    for n in names:
        assert len(env.events(n, "start")) == len(env.events(n, "end")) == 1, n
    assert most_at_once(events) == 1
    for job in jobs:
        job.refresh()
        assert job.retries_left == 1  # the job's own budget: untouched
    assert max(job.number_of_retries or 0 for job in jobs) >= 1  # and yet sent back
    assert permits.holders(TENANT) == []  # every permit released
    # A duplicate of a completed job replays without a permit, even with none free.
    held = permits.acquire(TENANT, owner="the-test")
    assert held is not None
    dup = env.queue.enqueue(rq_limited_job, names[0], 0.2)
    wait_for(lambda: finished(dup))
    assert dup.return_value() == jobs[0].return_value()
    assert len(env.events(names[0], "start")) == 1
    permits.release(held)


def test_concurrency_limit_called_directly_releases_on_failure_and_replays_unlimited(
    env: Env,
) -> None:
    """Outside a worker: no permit free raises LockNotAcquired (and frees the claim);
    a failing body releases its permit; a completed key replays with no permit free."""
    permits = coordinator().semaphore(limited_permits(1))
    held = permits.acquire(TENANT, owner="the-test")
    assert held is not None
    with pytest.raises(idemlock.LockNotAcquired, match=r"no permit of its concurrency limit"):
        rq_limited_job("direct")
    status = coordinator().idempotency(LIMITED_SPEC).status("direct")
    assert status is None or status.state != "in_flight"  # the claim was given back
    assert env.events("direct", "start") == []
    assert permits.release(held)
    with pytest.raises(RuntimeError, match="fails once"):
        rq_limited_job("direct", 0.0, True)
    assert permits.holders(TENANT) == []  # released by the failure
    first = rq_limited_job("direct", 0.0, True)
    assert permits.holders(TENANT) == []
    held = permits.acquire(TENANT, owner="the-test")
    assert held is not None
    assert rq_limited_job("direct", 0.0, True) == first  # replayed: no permit needed
    assert len(env.events("direct", "start")) == 2  # the failure and the run
    permits.release(held)
