"""Jobs that the RQ, arq and Dramatiq workers of the tests import and run.

Every job appends what it does to the file ``$IDEMLOCK_JOBS_LOG`` (one JSON line per
event), so a test counts runs and reads fences from outside the worker processes.
The idemlock store is ``$IDEMLOCK_JOBS_STORE`` under the key prefix
``$IDEMLOCK_JOBS_PREFIX``, read again in every process (a file
named by ``$IDEMLOCK_JOBS_STORE_FILE`` overrides it, so a test can point the jobs at
a dead store and back).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import idemlock
import idemlock.aio
from idemlock import IdempotencySpec, SemaphoreSpec

LEASE = 2.0
SPEC = IdempotencySpec("jobs", lease=timedelta(seconds=LEASE))
#: the spec of the jobs with a concurrency limit (their permits: "jobs-limited.concurrency")
LIMITED_SPEC = IdempotencySpec("jobs-limited", lease=timedelta(seconds=LEASE))
#: the concurrency key of every limited job: one tenant, so they all count together
TENANT = "tenant-1"
#: how soon a limited job that found no permit comes back (RQ rounds it up to 1 s)
LIMITED_RETRY = 0.2
#: how long a limited job waits for a permit before it is sent back
LIMITED_WAIT = 0.05


def long_spec(lease: float) -> IdempotencySpec:
    return IdempotencySpec("jobs-long", lease=timedelta(seconds=lease))


def store_url() -> str:
    override = os.environ.get("IDEMLOCK_JOBS_STORE_FILE")
    if override and Path(override).exists():
        return Path(override).read_text().strip()
    return os.environ["IDEMLOCK_JOBS_STORE"]


def prefix() -> str:
    # Each test has its own: keys of one test (or queue) never meet another's.
    return os.environ.get("IDEMLOCK_JOBS_PREFIX", "idemlock")


def coordinator() -> idemlock.Coordinator:
    return idemlock.connect(store_url(), key_prefix=prefix())


def async_coordinator() -> idemlock.aio.AsyncCoordinator:
    return idemlock.aio.connect(store_url(), key_prefix=prefix())


def note(event: str, **fields: Any) -> None:
    claim = idemlock.current_claim()
    line = {
        "event": event,
        "pid": os.getpid(),
        "t": time.time(),
        "fence": None if claim is None else claim.fence,
        **fields,
    }
    with open(os.environ["IDEMLOCK_JOBS_LOG"], "a") as f:
        f.write(json.dumps(line) + "\n")


def fail_once(name: str, fail_first: bool) -> None:
    marker = Path(os.environ["IDEMLOCK_JOBS_LOG"] + f".{name}.failed")
    if fail_first and not marker.exists():
        marker.write_text("x")
        note("fail", name=name)
        raise RuntimeError(f"{name} fails once")


def _quick_marker(name: str) -> Path:
    return Path(os.environ["IDEMLOCK_JOBS_LOG"] + f".{name}.quick")


def make_quick(log: Path, name: str) -> None:
    """From now on the bodies of job ``name`` that start do not sleep: a test that
    killed a long first run lets the rerun it waits for end at once."""
    Path(f"{log}.{name}.quick").write_text("x")


def body_seconds(name: str, seconds: float) -> float:
    return 0.0 if _quick_marker(name).exists() else seconds


def delivered(name: str, *args: Any, **kwargs: Any) -> str:
    """A key function that notes each delivery (before its claim): the log shows
    when a worker was handed the job, even one that then waits for a lease."""
    note("delivery", name=name)
    return name


def work(name: str, seconds: float, fail_first: bool) -> dict[str, Any]:
    """The body every queue's job runs: note the start, maybe fail once, sleep, end."""
    note("start", name=name)
    fail_once(name, fail_first)
    time.sleep(body_seconds(name, seconds))
    note("end", name=name)
    return {"name": name, "fence": idemlock.current_claim().fence}  # type: ignore[union-attr]


async def awork(name: str, seconds: float, fail_first: bool) -> dict[str, Any]:
    note("start", name=name)
    fail_once(name, fail_first)
    await asyncio.sleep(body_seconds(name, seconds))
    note("end", name=name)
    return {"name": name, "fence": idemlock.current_claim().fence}  # type: ignore[union-attr]


def step_effect(name: str, step: str, fence: int) -> str:
    """One step's side effect: an "effect" line in the log, which the test counts."""
    note("effect", name=name, step=step)
    return f"{step} by fence {fence}"


def two_steps(name: str) -> dict[str, Any]:
    """A body of two steps through ``current_claim().step``, whose first delivery fails
    between them (RuntimeError): the redelivery finds step one recorded and runs two."""
    claim = idemlock.current_claim()
    assert claim is not None
    one = claim.step("one", step_effect, name, "one", claim.fence)
    fail_once(name, True)
    two = claim.step("two", step_effect, name, "two", claim.fence)
    return {"name": name, "one": one, "two": two, "fence": claim.fence}


async def atwo_steps(name: str) -> dict[str, Any]:
    """:func:`two_steps` in an ``async def``: each step awaited."""
    claim = idemlock.current_claim()
    assert claim is not None
    one = await claim.step("one", step_effect, name, "one", claim.fence)
    fail_once(name, True)
    two = await claim.step("two", step_effect, name, "two", claim.fence)
    return {"name": name, "one": one, "two": two, "fence": claim.fence}


def tenant_of(name: str, *args: Any, **kwargs: Any) -> str:
    """The limited jobs' ``concurrency_key``: called once per delivery that holds its
    claim and asks for a permit, so the log shows the deliveries sent back."""
    note("attempt", name=name)
    return TENANT


def limited_permits(limit: int) -> SemaphoreSpec:
    """The limited jobs' semaphore, as a test takes its permits (a long ttl: the test
    does not renew them)."""
    return SemaphoreSpec(f"{LIMITED_SPEC.name}.concurrency", limit=limit, ttl=60)


def most_at_once(events: list[dict[str, Any]]) -> int:
    """The most bodies that ran at once, from their "start" and "end" events (each
    noted while its permit was held, so an end sorts before a start it let in)."""
    edges = sorted(
        (e["t"], 0 if e["event"] == "end" else 1) for e in events if e["event"] in ("start", "end")
    )
    running = most = 0
    for _, is_start in edges:
        running += 1 if is_start else -1
        most = max(most, running)
    return most


def read_log(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ---- RQ -----------------------------------------------------------------------------

try:
    from idemlock.integrations.rq import idempotent_job
except ImportError:  # pragma: no cover - rq is in the test extra
    pass
else:

    @idempotent_job(
        SPEC,
        key=lambda name, seconds=0.0, fail_first=False: name,
        coordinator=coordinator,
        retry_every=1.0,
        store_retry_backoff=0.5,
        store_retry_max=1.0,
    )
    def rq_job(name: str, seconds: float = 0.0, fail_first: bool = False) -> dict[str, Any]:
        return work(name, seconds, fail_first)

    @idempotent_job(
        LIMITED_SPEC,
        key=lambda name, seconds=0.0, fail_first=False: name,
        coordinator=coordinator,
        retry_every=LIMITED_RETRY,
        concurrency=1,
        concurrency_key=tenant_of,
        concurrency_wait=LIMITED_WAIT,
    )
    def rq_limited_job(name: str, seconds: float = 0.0, fail_first: bool = False) -> dict[str, Any]:
        return work(name, seconds, fail_first)

    @idempotent_job(SPEC, key=lambda name: name, coordinator=coordinator)
    def rq_steps_job(name: str) -> dict[str, Any]:
        return two_steps(name)
