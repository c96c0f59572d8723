"""Idempotent arq jobs: a retried, redelivered or duplicate job replays the recorded
result instead of running again.

::

    from arq.connections import RedisSettings
    from idemlock.integrations.arq import idempotent_job, current_fence

    @idempotent_job(
        "charge-order",
        key=lambda order_id, amount: f"order-{order_id}",
        coordinator="redis://localhost:6379/1",
    )
    async def charge(ctx, order_id: str, amount: int) -> dict:
        return {"charge_id": await payments.charge(order_id, amount, fence=current_fence())}

    class WorkerSettings:
        functions = [charge]
        redis_settings = RedisSettings()

    # elsewhere: await pool.enqueue_job("charge", "o-7", 1200)

The key and the payload are the job's arguments after ``ctx``. What a job does when
a worker runs it is what ``AsyncCoordinator.idempotent`` does (the rules of the RQ,
Dramatiq and Celery integrations):

* It **claims its key at execution**; a key completed within the spec's ``ttl``
  replays the recorded result and the body does not run.
* While the body runs the claim is **renewed** (heartbeats on the worker's event
  loop, one renewer for all its jobs), so the spec's ``lease`` is only how long a
  dead worker's key stays reserved; a lost claim cancels the body. ``max_run``
  stops renewing after that long (give it the job's timeout).
* ``idemlock.current_claim()`` / :func:`current_fence` is the fence in the body.
* An exception abandons the claim and propagates (arq fails the job, or retries it
  on ``arq.Retry``); exceptions in ``replay_errors`` are recorded and raised again
  on every replay instead.
* **Another attempt holds the key** or **the store fails before the body runs**:
  nothing ran and nothing is held; the job raises ``arq.Retry(defer=...)``: for a
  held key at most ``retry_every`` seconds and never later than just past the
  holder's lease; for a store failure a backoff from ``store_retry_backoff``
  doubling to ``store_retry_max``, for as long as the store is down. These
  reschedules **do not count as tries**: before raising, the job gives back the try
  arq's worker counted for this run, so ``max_tries`` (default 5) is left to the
  body's own ``arq.Retry`` and ``ctx["job_try"]`` counts only the runs that reached
  the body (or died in it). Keep arq's ``retry_jobs`` on (its default).

The job keeps its id through all of this: ``await job.result()`` on the ``Job``
that ``enqueue_job`` returned waits through the reschedules and gives the body's
result, or the recorded result a duplicate replays (arq's dedup by ``_job_id`` is
unchanged). Only if the queue's Redis cannot take the try back (it failed just
then) does that one reschedule count, with a warning in the ``idemlock.jobs`` log.

A worker killed mid-job (SIGKILL) leaves the job in the queue with its in-progress
marker, which ends after the job timeout plus 10 s; another worker then runs it: it
waits for the dead claim's lease, claims with a higher fence and runs.

**Concurrency limit** (opt-in): ``concurrency=N`` runs at most N bodies of one
concurrency key at once, across every worker; ``concurrency_key`` is a callable of
the job's arguments returning that key (a tenant, a partner; None: every job of this
function counts together). After its claim (a replay needs no permit) the job holds
a permit of the semaphore ``<spec name>.concurrency`` while its body runs, renewed
like the claim and released when the body ends, whatever ends it. No permit free
within ``concurrency_wait`` seconds (default 1): nothing ran, the claim is abandoned
and the job raises ``arq.Retry(defer=...)`` like the reschedules above, giving its
try back, within ``retry_every`` seconds; it does not use up the job's retries.

**Duplicate sends** (opt-in): ``await enqueue_once(pool, fn, args=(...),
kwargs={...}, lease=600, _queue_name=...)`` (the call every idemlock queue
integration shares) refuses (returns None) to enqueue a job whose key is already
queued or running, with a send lease of ``lease`` seconds released when the job
runs; a job lost before it ran frees its key when the lease ends.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

from arq.connections import ArqRedis
from arq.constants import retry_key_prefix
from arq.jobs import Job
from arq.worker import Retry
from redis.exceptions import RedisError

from .._core.types import IdempotencySpec
from .._errors import ConfigurationError
from .._logfields import fields as log_fields
from .jobs.guard import JobGuard, Later, current_fence, guard_of
from .jobs.options import JobKeywords, JobOptions, SendArgs, deprecated, spec_name
from .jobs.sends import afree_send, asend_under_lease

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..aio import AsyncCoordinator

__all__ = ["current_fence", "enqueue_once", "idempotent_job"]

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

log = logging.getLogger("idemlock.jobs")

#: Redis key (under arq's prefix style) naming the send lease of a job id
_SEND_KEY = "idemlock:send-lease:"
#: Redis key counting idemlock's reschedules of a job id (its store-failure backoff)
_DEFERS_KEY = "idemlock:arq-defers:"
#: how long that count outlives its last reschedule (arq keeps its count of tries so long)
_KEY_SECONDS = 88400


def idempotent_job(
    spec: IdempotencySpec | str,
    key: Callable[..., str] | None = None,
    *,
    coordinator: AsyncCoordinator | str | Callable[[], AsyncCoordinator] | None = None,
    **options: Unpack[JobKeywords],
) -> Callable[[F], F]:
    """Make an arq job (``async def job(ctx, ...)``) idempotent per key (see the module
    documentation). ``coordinator`` is an :class:`idemlock.aio.AsyncCoordinator`, a
    store URL, a callable returning one, or None (``$IDEMLOCK_URL``).
    The other options (:class:`~idemlock.integrations.jobs.options.JobKeywords`) are
    the module documentation's, the same on every queue."""

    checked = JobOptions.of(spec, key, coordinator, options, where="@idempotent_job")

    def decorate(fn: F) -> F:
        guard = JobGuard(fn, checked, skip=1)
        if not guard.is_async:
            raise ConfigurationError(f"{fn.__qualname__}: an arq job must be an async def")

        @functools.wraps(fn)
        async def job_function(ctx: Any, *args: Any, **kwargs: Any) -> Any:
            job_id = ctx.get("job_id") if isinstance(ctx, dict) else None
            if job_id is None:  # called directly: no queue to come back through
                return await guard.acall(ctx, args, kwargs, direct=True)
            what = f"job {fn.__qualname__}[{job_id}]"
            deferred = False
            try:
                return await guard.acall(ctx, args, kwargs)
            except Later as later:
                deferred = True
                defers = await _uncount_try(guard, ctx, job_id, what)
                raise Retry(defer=guard.delay(later, defers, what)) from None
            finally:
                if not deferred:
                    await _job_done(guard, ctx, job_id, args, kwargs)

        job_function.idemlock_guard = guard  # type: ignore[attr-defined]
        return cast(F, job_function)

    return decorate


async def _uncount_try(guard: JobGuard, ctx: dict[str, Any], job_id: str, what: str) -> int:
    """Give back the try arq counted for this run, whose body did not run, so the job's
    ``max_tries`` is left to the body; count the reschedule in idemlock's own key
    instead. The reschedules of this job before this one."""
    fallback = max(0, int(ctx.get("job_try", 1) or 1) - 1)
    redis = ctx.get("redis")
    if redis is None:
        return fallback
    try:
        # arq's worker added one to this key (its count of the job's tries) just
        # before it called the job; it fails the job once the count passes max_tries.
        async with redis.pipeline(transaction=True) as pipe:
            pipe.decr(retry_key_prefix + job_id)
            pipe.incr(_DEFERS_KEY + job_id)
            pipe.expire(_DEFERS_KEY + job_id, _KEY_SECONDS)
            _, defers, _ = await pipe.execute()
    except (RedisError, OSError, asyncio.TimeoutError) as exc:
        log.warning(
            "%s: could not give back arq's count of this try (%s); this reschedule "
            "counts toward the job's max_tries",
            what,
            exc,
            extra=log_fields(spec=spec_name(guard.spec), operation="claim", outcome="error"),
        )
        return fallback
    return max(0, int(defers) - 1)


async def _job_done(
    guard: JobGuard, ctx: dict[str, Any], job_id: str, args: Any, kwargs: Any
) -> None:
    """The job ran (or replayed, or failed): forget its reschedules and release the
    send lease ``enqueue_once`` took (if any)."""
    redis = ctx.get("redis")
    if redis is None:
        return
    async with redis.pipeline(transaction=False) as pipe:
        pipe.get(_SEND_KEY + job_id)
        pipe.delete(_DEFERS_KEY + job_id)
        lease, _ = await pipe.execute()
    if lease is None:
        return
    coord = guard.resolved()[0]
    await afree_send(coord, guard.spec, guard.key_of(args, kwargs), job_id, float(lease))
    await redis.delete(_SEND_KEY + job_id)


async def enqueue_once(
    pool: ArqRedis,
    fn: Callable[..., Awaitable[Any]],
    /,
    *legacy_args: Any,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    lease: timedelta | float | None = None,
    **options: Any,
) -> Job | None:
    """``pool.enqueue_job(name, *args, **options, **kwargs)`` unless a job of its key
    is queued or running: then nothing is sent and the result is None; else the
    ``arq.jobs.Job``. ``lease`` (seconds or a timedelta, default 600) bounds how long a
    sent job that never runs keeps its key reserved. ``options`` are ``enqueue_job``'s own
    ``_``-options (``_job_id``, ``_defer_by``, ``_queue_name``...); the job is sent under
    ``fn.__qualname__`` (arq's default name). arq also returns None when a job of the
    same ``_job_id`` exists.

    The job's arguments are always ``args=``/``kwargs=`` (the form of every idemlock
    queue integration). The 0.1 form ``enqueue_once(pool, fn, *args, **kwargs)``
    still works, with a DeprecationWarning."""
    call = "enqueue_once()"
    legacy_kwargs = {k: options.pop(k) for k in list(options) if not k.startswith("_")}
    if legacy_args or legacy_kwargs:
        if args is not None or kwargs is not None:
            raise ConfigurationError(
                f"{call}: pass the job's arguments as args=(...) and kwargs={{...}} only, "
                f"got {len(legacy_args)} more positional and the keyword(s) "
                f"{sorted(legacy_kwargs)}"
            )
        deprecated(
            "enqueue_once(pool, fn, *args, **kwargs) with the job's arguments spread",
            "enqueue_once(pool, fn, args=(...), kwargs={...}, lease=..., _queue_name=...)",
        )
        args, kwargs = legacy_args, legacy_kwargs
    guard = guard_of(fn, call=call, decorator="@idempotent_job")
    sent = SendArgs.parse(args, kwargs, lease, call=call, default_lease=guard.options.send_lease)
    job_id = str(options.pop("_job_id", None) or uuid.uuid4().hex)

    async def send() -> Job | None:
        # Where the worker finds the lease to release: beside the job, as long-lived.
        await pool.set(_SEND_KEY + job_id, str(sent.lease), px=max(1, int(sent.lease * 1000)))
        # None: arq refused the id (a job with it exists)
        return await pool.enqueue_job(
            fn.__qualname__, *sent.args, _job_id=job_id, **options, **sent.kwargs
        )

    key = guard.key_of(sent.args, sent.kwargs)
    return await asend_under_lease(guard.resolved()[0], guard.spec, key, job_id, sent.lease, send)
