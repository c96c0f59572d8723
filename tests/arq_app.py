"""The arq app of tests/test_arq.py: its workers run ``arq tests.arq_app.WorkerSettings``;
the Redis URL is ``$IDEMLOCK_JOBS_BROKER``."""

from __future__ import annotations

import os
from typing import Any

from arq.connections import RedisSettings
from arq.worker import Retry, func

from idemlock.integrations.arq import idempotent_job

from .queue_jobs import (
    LIMITED_RETRY,
    LIMITED_SPEC,
    LIMITED_WAIT,
    SPEC,
    async_coordinator,
    atwo_steps,
    awork,
    delivered,
    long_spec,
    tenant_of,
)

#: the job timeout; a killed worker's job runs elsewhere once its in-progress marker
#: ends (the longest job timeout + 10 s; the tests end it themselves)
JOB_TIMEOUT = 8


@idempotent_job(
    SPEC,
    key=lambda name, seconds=0.0, fail_first=False: name,
    coordinator=async_coordinator,
    retry_every=1.0,
    store_retry_backoff=0.5,
    store_retry_max=1.0,
)
async def arq_job(
    ctx: dict[str, Any], name: str, seconds: float = 0.0, fail_first: bool = False
) -> dict[str, Any]:
    return await awork(name, seconds, fail_first)


@idempotent_job(SPEC, key=lambda name: name, coordinator=async_coordinator)
async def arq_steps_job(ctx: dict[str, Any], name: str) -> dict[str, Any]:
    try:
        return await atwo_steps(name)
    except RuntimeError as exc:  # the first run's failure, after step one: arq runs it again
        raise Retry(defer=0.1) from exc


#: the lease of arq_long_job: long enough that a worker already polling when the first
#: run's worker dies (and its in-progress marker is ended) meets the dead attempt's
#: claim in flight, however busy the machine; it notes each delivery
LONG_LEASE = 6.0


@idempotent_job(
    long_spec(LONG_LEASE),
    key=delivered,
    coordinator=async_coordinator,
    retry_every=1.0,
)
async def arq_long_job(ctx: dict[str, Any], name: str, seconds: float = 0.0) -> dict[str, Any]:
    return await awork(name, seconds, False)


#: idemlock's reschedules of arq_tight_job come back every TIGHT_RETRY seconds (or
#: sooner), many times within one of its bodies; arq allows it only TIGHT_TRIES tries
TIGHT_RETRY = 0.2
TIGHT_TRIES = 2


@idempotent_job(
    SPEC,
    key=lambda name, seconds=0.0, fail_first=False: name,
    coordinator=async_coordinator,
    retry_every=TIGHT_RETRY,
    store_retry_backoff=TIGHT_RETRY / 2,
    store_retry_max=TIGHT_RETRY,
)
async def arq_tight_job(
    ctx: dict[str, Any], name: str, seconds: float = 0.0, fail_first: bool = False
) -> dict[str, Any]:
    return await awork(name, seconds, fail_first)


#: at most this many arq_limited_job bodies run at once (the worker runs up to 10 jobs)
LIMIT = 2


@idempotent_job(
    LIMITED_SPEC,
    key=lambda name, seconds=0.0: name,
    coordinator=async_coordinator,
    retry_every=LIMITED_RETRY,
    concurrency=LIMIT,
    concurrency_key=tenant_of,
    concurrency_wait=LIMITED_WAIT,
)
async def arq_limited_job(ctx: dict[str, Any], name: str, seconds: float = 0.0) -> dict[str, Any]:
    return await awork(name, seconds, False)


def redis_settings() -> RedisSettings:
    return RedisSettings.from_dsn(os.environ.get("IDEMLOCK_JOBS_BROKER", "redis://127.0.0.1:1"))


class WorkerSettings:
    functions = [  # noqa: RUF012
        arq_job,
        arq_long_job,
        arq_steps_job,
        func(arq_tight_job, name="arq_tight_job", max_tries=TIGHT_TRIES),
        # One try: a reschedule for a permit that counted would fail the job.
        func(arq_limited_job, name="arq_limited_job", max_tries=1),
    ]
    redis_settings = redis_settings()
    queue_name = os.environ.get("IDEMLOCK_JOBS_NAMESPACE", "arq:queue")
    job_timeout = JOB_TIMEOUT
    max_tries = 100
    poll_delay = 0.1
    keep_result = 600
