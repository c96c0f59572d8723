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
from idemlock import IdempotencySpec

LEASE = 2.0
SPEC = IdempotencySpec("jobs", lease=timedelta(seconds=LEASE))


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


def work(name: str, seconds: float, fail_first: bool) -> dict[str, Any]:
    """The body every queue's job runs: note the start, maybe fail once, sleep, end."""
    note("start", name=name)
    fail_once(name, fail_first)
    time.sleep(seconds)
    note("end", name=name)
    return {"name": name, "fence": idemlock.current_claim().fence}  # type: ignore[union-attr]


async def awork(name: str, seconds: float, fail_first: bool) -> dict[str, Any]:
    note("start", name=name)
    fail_once(name, fail_first)
    await asyncio.sleep(seconds)
    note("end", name=name)
    return {"name": name, "fence": idemlock.current_claim().fence}  # type: ignore[union-attr]


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
