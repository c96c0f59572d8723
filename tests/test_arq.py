"""The arq integration with real ``arq`` worker processes on a real Redis (the queue on
db 0, the idemlock store on db 1). The job lives in tests/arq_app.py and writes what it
does into a log file this test reads."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from arq import create_pool
from arq.connections import ArqRedis, RedisSettings
from arq.constants import in_progress_key_prefix
from arq.jobs import Job, JobStatus

import idemlock
from idemlock import ConfigurationError
from idemlock.integrations.arq import enqueue_once, idempotent_job

from .arq_app import (
    JOB_TIMEOUT,
    LIMIT,
    LONG_LEASE,
    TIGHT_RETRY,
    TIGHT_TRIES,
    arq_job,
    arq_limited_job,
)
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


class Env:
    def __init__(self, server: RedisServer, tmp: Path, pool: ArqRedis, queue: str) -> None:
        self.pool = pool
        self.queue = queue
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
            "IDEMLOCK_JOBS_NAMESPACE": queue,
        }

    def worker(self) -> subprocess.Popen[bytes]:
        env = {**os.environ, **self.vars, "PYTHONPATH": WORKER_PATH}
        proc = popen(
            [sys.executable, "-m", "arq", "tests.arq_app.WorkerSettings"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(self.log.with_suffix(".worker.err"), "ab"),  # noqa: SIM115
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    async def started_worker(self) -> subprocess.Popen[bytes]:
        """A new worker, once it has started polling the queue."""
        err = self.log.with_suffix(".worker.err")

        def starts() -> int:
            return err.read_text().count("Starting worker for") if err.exists() else 0

        before = starts()
        proc = self.worker()
        await wait_for(lambda: starts() > before or proc.poll() is not None, timeout=60)
        assert proc.poll() is None, err.read_text()
        return proc

    async def end_in_progress_marker(self, job: Job) -> None:
        """End now the in-progress marker a killed worker left on ``job``, as arq's
        expiry does after ``job_timeout`` + 10 s: a polling worker takes the job."""
        assert await self.pool.delete(in_progress_key_prefix + job.job_id) == 1

    def events(self, name: str, event: str | None = None) -> list[dict[str, Any]]:
        return [
            e
            for e in read_log(self.log)
            if e.get("name") == name and (event is None or e["event"] == event)
        ]

    async def send(self, *args: Any, **options: Any) -> Job:
        return await self.send_to("arq_job", *args, **options)

    async def send_to(self, function: str, *args: Any, **options: Any) -> Job:
        job = await self.pool.enqueue_job(function, *args, _queue_name=self.queue, **options)
        assert job is not None
        return job

    def reschedules(self, job: Job) -> int:
        """How often the workers sent ``job`` back to the queue with ``arq.Retry``
        (arq logs each one to the worker's stderr)."""
        err = self.log.with_suffix(".worker.err")
        if not err.exists():
            return 0
        ref = f"{job.job_id}:"
        return sum(
            1 for line in err.read_text().splitlines() if ref in line and "retrying job" in line
        )

    def kill(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def stop(self) -> None:
        for proc in self.procs:
            self.kill(proc)


@pytest.fixture
async def env(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Env]:
    pool = await create_pool(RedisSettings.from_dsn(redis_server.url))
    e = Env(redis_server, tmp_path, pool, f"arq:q{uuid.uuid4().hex[:8]}")
    for k, v in e.vars.items():
        monkeypatch.setenv(k, v)
    arq_job.idemlock_guard._state = None  # type: ignore[attr-defined]
    arq_limited_job.idemlock_guard._state = None  # type: ignore[attr-defined]
    try:
        yield e
    finally:
        e.stop()
        await pool.aclose()


async def wait_for(what: Callable[[], Any], timeout: float = 30.0, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(step)
    raise AssertionError(f"timed out waiting for {what}")


async def result(job: Job, timeout: float = 30.0) -> Any:
    return await job.result(timeout=timeout, poll_delay=0.1)


async def test_runs_once_and_a_duplicate_of_a_completed_job_is_replayed(env: Env) -> None:
    env.worker()
    first = await env.send("a", 0.0)
    one = await result(first)
    dup = await env.send("a", 0.0)
    assert await result(dup) == one
    assert len(env.events("a", "start")) == 1
    status = coordinator().idempotency(SPEC).status("a")
    assert status is not None and status.state == "completed"


async def test_a_failure_abandons_the_claim_so_a_retry_runs_with_a_higher_fence(
    env: Env,
) -> None:
    env.worker()
    failed = await env.send("f", 0.0, True)
    with pytest.raises(RuntimeError, match="fails once"):
        await result(failed)
    status = coordinator().idempotency(SPEC).status("f")
    assert status is None or status.state != "in_flight"  # abandoned, not held
    again = await env.send("f", 0.0, True)
    value = await result(again)
    starts = env.events("f", "start")
    assert len(starts) == 2
    assert starts[1]["fence"] > starts[0]["fence"]
    assert value["fence"] == starts[1]["fence"]


async def test_a_retried_job_resumes_after_its_last_finished_step(env: Env) -> None:
    """``current_claim().step`` in an arq job: the first run records step one, then
    raises ``arq.Retry``; the next run finds step one recorded (its result, not a second
    effect) and runs step two only."""
    env.worker()
    value = await result(await env.send_to("arq_steps_job", "st"))
    effects = env.events("st", "effect")
    assert [e["step"] for e in effects] == ["one", "two"]  # each effect once
    assert len(env.events("st", "fail")) == 1
    assert effects[1]["fence"] > effects[0]["fence"]  # step two: the retry's
    assert value == {
        "name": "st",
        "one": f"one by fence {effects[0]['fence']}",  # recorded by the first run
        "two": f"two by fence {effects[1]['fence']}",
        "fence": effects[1]["fence"],
    }
    status = coordinator().idempotency(SPEC).status("st")
    assert status is not None and status.state == "completed"


async def test_worker_sigkilled_mid_job_reruns_only_after_the_lease_ends(env: Env) -> None:
    worker = env.worker()
    job = await env.send("k", JOB_TIMEOUT * 0.75)
    first = (await wait_for(lambda: env.events("k", "start")))[0]
    coord = coordinator()

    def renewed() -> bool:
        # Its first lease ends by first["t"] + LEASE (claimed before the body started).
        status = coord.idempotency(SPEC).status("k")
        assert status is not None and status.state == "in_flight", status
        return status.expires_at.timestamp() > first["t"] + LEASE

    await wait_for(renewed)  # renewed past its first lease while it runs
    make_quick(env.log, "k")  # the rerun's body (this one sleeps on until killed)
    env.kill(worker)
    expires = coord.idempotency(SPEC).status("k").expires_at.timestamp()  # type: ignore[union-attr]
    await env.started_worker()
    await env.end_in_progress_marker(job)  # arq hands the job out again
    second = (await wait_for(lambda: env.events("k", "start")[1:], timeout=60))[0]
    assert second["t"] >= expires - 0.05
    assert second["fence"] > first["fence"]
    assert (await result(job, 30))["fence"] == second["fence"]
    assert len(env.events("k", "start")) == 2


async def test_a_rerun_that_meets_the_dead_claim_waits_for_its_lease(env: Env) -> None:
    # Two workers polling: one runs the job, and the other, kept off it by the job's
    # in-progress marker, is there to take it once the marker ends.
    workers = [await env.started_worker(), await env.started_worker()]
    job = await env.pool.enqueue_job("arq_long_job", "w", JOB_TIMEOUT * 0.75, _queue_name=env.queue)
    assert job is not None
    first = (await wait_for(lambda: env.events("w", "start")))[0]
    make_quick(env.log, "w")  # the rerun's body (this one sleeps on until killed)
    (running,) = [w for w in workers if w.pid == first["pid"]]
    env.kill(running)
    status = coordinator().idempotency(long_spec(LONG_LEASE)).status("w")
    assert status is not None and status.state == "in_flight"
    expires = status.expires_at.timestamp()
    await env.end_in_progress_marker(job)
    second = (await wait_for(lambda: env.events("w", "start")[1:], timeout=LONG_LEASE + 60))[0]
    # arq handed the job out again before the lease ended: the rerun met the claim in
    # flight, waited for the lease, and only then ran.
    deliveries = env.events("w", "delivery")
    assert len(deliveries) >= 2 and deliveries[1]["t"] < expires, (deliveries, expires)
    assert second["t"] >= expires - 0.05
    assert second["fence"] > first["fence"]
    assert (await result(job, 30))["fence"] == second["fence"]


async def test_a_job_slower_than_its_lease_is_not_run_twice_by_a_duplicate(env: Env) -> None:
    env.worker()
    slow = await env.send("s", LEASE * 3)  # within the job timeout, 3 leases
    await wait_for(lambda: env.events("s", "start"))
    dup = await env.send("s", LEASE * 3)
    assert await result(slow) == await result(dup)
    assert len(env.events("s", "start")) == 1


async def test_store_down_before_the_body_retries_never_fails(env: Env) -> None:
    env.store_file.write_text(f"redis://127.0.0.1:{free_port()}/1?timeout=0.5")
    env.worker()
    job = await env.send("d", 0.0)
    await wait_for(lambda: env.reschedules(job) >= 2)  # several tries meet the dead store
    assert env.events("d") == []
    assert await job.status() in (JobStatus.deferred, JobStatus.queued, JobStatus.in_progress)
    env.store_file.unlink()  # the store is back; a new worker process opens it
    env.stop()
    env.worker()
    assert (await result(job))["name"] == "d"
    assert len(env.events("d", "start")) == 1


async def test_reschedules_while_a_key_is_held_do_not_use_up_max_tries(env: Env) -> None:
    """Issue 21 item 8: a duplicate of a job that runs many retry intervals meets the
    key in flight again and again; it replays the first run's result instead of failing
    with arq's "max N retries exceeded", and none of those reschedules was a try."""
    env.worker()
    seconds = TIGHT_RETRY * 15
    first = await env.send_to("arq_tight_job", "t", seconds)
    await wait_for(lambda: env.events("t", "start"))
    dup = await env.send_to("arq_tight_job", "t", seconds)
    one = await result(first)
    assert await result(dup) == one  # replayed, not JobExecutionFailed
    assert env.reschedules(dup) > TIGHT_TRIES  # it came back more often than arq allows
    info = await dup.result_info()
    assert info is not None and info.success and info.job_try == 1
    assert len(env.events("t", "start")) == 1


async def test_reschedules_while_the_store_is_down_do_not_use_up_max_tries(
    env: Env, tmp_path: Path
) -> None:
    store = RedisServer(tmp_path / "store", free_port())  # not started yet: down
    env.store_file.write_text(store.url.rsplit("/", 1)[0] + "/1?timeout=0.2")
    env.worker()
    job = await env.send_to("arq_tight_job", "down", 0.0)

    async def rescheduled_or_over() -> bool:
        over = await job.status() in (JobStatus.complete, JobStatus.not_found)
        return over or env.reschedules(job) > TIGHT_TRIES + 1

    await wait_for(rescheduled_or_over)
    assert env.reschedules(job) > TIGHT_TRIES + 1  # still coming back, not failed
    assert env.events("down") == []
    store.start()  # the store is back where the worker looks for it
    try:
        assert (await result(job))["name"] == "down"
    finally:
        store.stop()
    info = await job.result_info()
    assert info is not None and info.success and info.job_try == 1
    assert len(env.events("down", "start")) == 1


async def test_called_directly_it_runs_and_replays(env: Env) -> None:
    assert await arq_job({}, "direct") == await arq_job({}, "direct")
    assert len(env.events("direct", "start")) == 1


async def test_enqueue_once_refuses_a_queued_or_running_key(env: Env) -> None:
    first = await enqueue_once(
        env.pool, arq_job, args=("o",), kwargs={"seconds": 1.5}, lease=30, _queue_name=env.queue
    )
    assert first is not None
    again = await enqueue_once(
        env.pool, arq_job, args=("o",), kwargs={"seconds": 1.5}, lease=30, _queue_name=env.queue
    )
    assert again is None  # queued
    env.worker()
    await wait_for(lambda: env.events("o", "start"))
    running = await enqueue_once(
        env.pool, arq_job, args=("o",), kwargs={"seconds": 1.5}, lease=30, _queue_name=env.queue
    )
    assert running is None
    value = await result(first)
    later = await enqueue_once(
        env.pool, arq_job, args=("o",), kwargs={"seconds": 1.5}, lease=30, _queue_name=env.queue
    )
    assert later is not None  # done: accepted, and replayed
    assert await result(later) == value
    assert len(env.events("o", "start")) == 1


async def test_enqueue_once_lease_frees_a_key_whose_job_was_lost(env: Env) -> None:
    job = await enqueue_once(env.pool, arq_job, args=("lost",), lease=1.0, _queue_name=env.queue)
    assert job is not None
    await env.pool.delete(env.queue)  # lost before any worker ran it
    assert (
        await enqueue_once(env.pool, arq_job, args=("lost",), lease=1.0, _queue_name=env.queue)
        is None
    )
    await asyncio.sleep(1.2)
    assert (
        await enqueue_once(env.pool, arq_job, args=("lost",), lease=1.0, _queue_name=env.queue)
        is not None
    )


async def test_enqueue_once_the_deprecated_spread_form_warns_and_still_sends_once(
    env: Env,
) -> None:
    with pytest.warns(DeprecationWarning, match=r"call enqueue_once\(pool, fn, args=") as rec:
        first = await enqueue_once(env.pool, arq_job, "d", seconds=1.0, _queue_name=env.queue)
    assert rec[0].filename == __file__  # it points at the caller's line
    assert first is not None
    with pytest.warns(DeprecationWarning):
        assert await enqueue_once(env.pool, arq_job, "d", 1.0, _queue_name=env.queue) is None
    env.worker()
    value = await result(first)
    assert value["name"] == "d"
    with pytest.warns(DeprecationWarning):
        again = await enqueue_once(env.pool, arq_job, "d", seconds=1.0, _queue_name=env.queue)
    assert again is not None and await result(again) == value
    assert len(env.events("d", "start")) == 1


def test_a_sync_function_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="async def"):
        idempotent_job("x")(lambda ctx: None)


#: A user's program sending once through arq the way every queue does (the other queues'
#: part: tests/test_static.py, in the session that cannot hold arq).
ARQ_USER_PROGRAM = """
from __future__ import annotations

from datetime import timedelta
from typing import Any

from arq.connections import ArqRedis
from arq.jobs import Job as ArqJob

from idemlock.integrations import arq as idem_arq


@idem_arq.idempotent_job("charge", key=lambda order_id, amount: order_id)
async def acharge(ctx: dict[str, Any], order_id: str, amount: int) -> int:
    return amount


async def send_arq(pool: ArqRedis) -> ArqJob | None:
    return await idem_arq.enqueue_once(
        pool, acharge, args=("o-7",), kwargs={"amount": 1200}, lease=timedelta(minutes=10),
        _queue_name="arq:queue",
    )
"""


def test_users_strict_mypy_accepts_enqueue_once_on_arq(tmp_path: Path) -> None:
    from .test_static import _mypy_user

    out = _mypy_user(tmp_path, ARQ_USER_PROGRAM)
    assert out.returncode == 0, out.stdout + out.stderr
    # The check is real: a lease that is not seconds is refused.
    wrong = ARQ_USER_PROGRAM.replace("lease=timedelta(minutes=10)", 'lease="10 min"')
    out = _mypy_user(tmp_path, wrong)
    assert out.returncode == 1 and 'Argument "lease" to "enqueue_once"' in out.stdout, out.stdout


async def test_concurrency_limit_runs_at_most_two_at_once_and_waits_use_no_tries(
    env: Env,
) -> None:
    """``concurrency=2`` on a worker that runs up to 10 jobs at once, with
    ``max_tries=1``: while the test holds both of the tenant's permits no body runs
    and the jobs are sent back (a counted try would fail them); then each runs exactly
    once, never more than two at a time."""
    names = [f"lim{i}" for i in range(5)]
    permits = coordinator().semaphore(limited_permits(LIMIT))
    held = [permits.acquire(TENANT, owner=f"the-test-{i}") for i in range(LIMIT)]
    assert all(held)
    env.worker()
    jobs = [await env.send_to("arq_limited_job", n, 0.3) for n in names]
    await wait_for(lambda: any(len(env.events(n, "attempt")) >= 2 for n in names))
    assert [e for n in names for e in env.events(n, "start")] == []
    for lease in held:
        assert lease is not None and permits.release(lease)
    values = [await result(job) for job in jobs]  # a failed job raises here
    assert [v["name"] for v in values] == names
    for n in names:
        assert len(env.events(n, "start")) == len(env.events(n, "end")) == 1, n
    assert 1 <= most_at_once([e for n in names for e in env.events(n)]) <= LIMIT
    for job in jobs:
        info = await job.result_info()
        assert info is not None and info.success and info.job_try == 1
    assert sum(env.reschedules(job) for job in jobs) >= 1  # sent back, uncounted
    assert permits.holders(TENANT) == []


async def test_concurrency_limit_a_cancelled_body_releases_its_permit(env: Env) -> None:
    permits = coordinator().semaphore(limited_permits(LIMIT))
    running = asyncio.ensure_future(arq_limited_job({}, "cancelled", 60.0))
    await wait_for(lambda: env.events("cancelled", "start"))
    assert [h.owner for h in permits.holders(TENANT)] != []  # held while the body runs
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    await wait_for(lambda: permits.holders(TENANT) == [])
    assert env.events("cancelled", "end") == []
