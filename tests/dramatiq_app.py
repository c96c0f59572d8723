"""The Dramatiq app of tests/test_dramatiq.py: its workers run
``dramatiq tests.dramatiq_app``; the broker URL is ``$IDEMLOCK_JOBS_BROKER``."""

from __future__ import annotations

import os
from typing import Any

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.middleware import CurrentMessage
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend

from idemlock.integrations.dramatiq import idempotent

from .queue_jobs import (
    LIMITED_RETRY,
    LIMITED_SPEC,
    LIMITED_WAIT,
    SPEC,
    coordinator,
    long_spec,
    tenant_of,
    two_steps,
    work,
)

#: a dead worker's unacknowledged messages are given to others after this (ms)
HEARTBEAT_TIMEOUT_MS = 3000

broker = RedisBroker(
    url=os.environ["IDEMLOCK_JOBS_BROKER"],
    namespace=os.environ.get("IDEMLOCK_JOBS_NAMESPACE", "dramatiq"),
    heartbeat_timeout=HEARTBEAT_TIMEOUT_MS,
    # Maintenance (requeueing dead workers' messages) on every fetch, not 0.1% of them.
    maintenance_chance=1_000_000,
)
broker.add_middleware(CurrentMessage())
broker.add_middleware(
    Results(backend=RedisBackend(url=os.environ["IDEMLOCK_JOBS_BROKER"]), result_ttl=600_000)
)
dramatiq.set_broker(broker)


@dramatiq.actor(max_retries=50, min_backoff=100, max_backoff=1000, store_results=True)
@idempotent(
    SPEC,
    key=lambda name, seconds=0.0, fail_first=False: name,
    coordinator=coordinator,
    retry_every=1.0,
    store_retry_backoff=0.5,
    store_retry_max=1.0,
)
def dq_job(name: str, seconds: float = 0.0, fail_first: bool = False) -> dict[str, Any]:
    return work(name, seconds, fail_first)


@dramatiq.actor(max_retries=5, min_backoff=100, max_backoff=1000, store_results=True)
@idempotent(SPEC, key=lambda name: name, coordinator=coordinator)
def dq_steps_job(name: str) -> dict[str, Any]:
    return two_steps(name)


#: longer than the broker takes to hand a dead worker's message to another, so the
#: redelivered message meets the dead attempt's claim in flight and must wait
LONG_LEASE = 9.0


@dramatiq.actor(max_retries=50, min_backoff=100, max_backoff=1000, store_results=True)
@idempotent(
    long_spec(LONG_LEASE),
    key=lambda name, seconds=0.0: name,
    coordinator=coordinator,
    retry_every=1.0,
)
def dq_long_job(name: str, seconds: float = 0.0) -> dict[str, Any]:
    return work(name, seconds, False)


#: idemlock's reschedules of dq_tight_job come back every TIGHT_RETRY seconds (or
#: sooner), many times within one of its bodies; Dramatiq allows it TIGHT_RETRIES retries
TIGHT_RETRY = 0.2
TIGHT_RETRIES = 2


@dramatiq.actor(max_retries=TIGHT_RETRIES, min_backoff=100, max_backoff=1000, store_results=True)
@idempotent(
    SPEC,
    key=lambda name, seconds=0.0, fail_first=False: name,
    coordinator=coordinator,
    retry_every=TIGHT_RETRY,
    store_retry_backoff=TIGHT_RETRY / 2,
    store_retry_max=TIGHT_RETRY,
)
def dq_tight_job(name: str, seconds: float = 0.0, fail_first: bool = False) -> dict[str, Any]:
    return work(name, seconds, fail_first)


#: at most this many dq_limited_job bodies run at once (the worker has 2 threads)
LIMIT = 1


# No retries at all: a reschedule for a permit that counted would fail the message.
@dramatiq.actor(max_retries=0, store_results=True)
@idempotent(
    LIMITED_SPEC,
    key=lambda name, seconds=0.0: name,
    coordinator=coordinator,
    retry_every=LIMITED_RETRY,
    concurrency=LIMIT,
    concurrency_key=tenant_of,
    concurrency_wait=LIMITED_WAIT,
)
def dq_limited_job(name: str, seconds: float = 0.0) -> dict[str, Any]:
    return work(name, seconds, False)
