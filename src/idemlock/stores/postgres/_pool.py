"""The asyncio connection pool the store makes for itself.

psycopg_pool's maintenance workers catch ``CancelledError`` from the task they run
(an ``AddConnection`` logs it as a failed connect and schedules a retry) and then wait
on their queue again. When ``asyncio.run()`` ends while a worker is connecting, that
cancellation is swallowed, the worker waits forever, and ``asyncio.run()`` never
returns. Our workers end when they are cancelled, wherever the cancellation landed.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from typing import Any

import psycopg_pool
from psycopg_pool.pool_async import StopWorker

logger = logging.getLogger("psycopg.pool")


async def _run(job: Any) -> None:
    if sys.version_info >= (3, 11):
        await job.run()
        task = asyncio.current_task()
        # A cancellation the job caught (and did not uncancel) still counts.
        if task is not None and task.cancelling() > 0:
            raise asyncio.CancelledError
    else:  # pragma: no cover - no Task.cancelling(): the job runs beside us
        await asyncio.shield(asyncio.ensure_future(job.run()))


class CancellableAsyncPool(psycopg_pool.AsyncConnectionPool[Any]):
    """An AsyncConnectionPool whose background workers end when cancelled."""

    @classmethod
    async def worker(cls, q: Any) -> None:
        while True:
            job = await q.get()
            if isinstance(job, StopWorker):
                return
            try:
                await _run(job)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # as psycopg_pool's: one failed job must not end it
                logger.warning("task run %s failed: %s: %s", job, type(exc).__name__, exc)
