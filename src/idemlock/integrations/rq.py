"""Idempotent RQ jobs: a retried, redelivered or duplicate job replays the recorded
result instead of running again.

::

    from redis import Redis
    from rq import Queue, Retry
    from idemlock.integrations.rq import idempotent_job, current_fence

    @idempotent_job(
        "charge-order",
        key=lambda order_id, amount: f"order-{order_id}",
        coordinator="redis://localhost:6379/1",
    )
    def charge(order_id: str, amount: int) -> dict:
        return {"charge_id": payments.charge(order_id, amount, fence=current_fence())}

    queue = Queue(connection=Redis())
    queue.enqueue(charge, "o-7", 1200, retry=Retry(max=3))

Run the workers with the scheduler (``rq worker --with-scheduler``): a job that must
come back later is scheduled, not run at once.

What a job does when a worker runs it (the decorator ``Coordinator.idempotent`` does
the claiming, so the rules are the same as everywhere in idemlock):

* It **claims its key at execution**. A key completed within the spec's ``ttl``
  replays the recorded result (the job succeeds with it; its body does not run).
* While the body runs, the claim is **renewed** (heartbeats, every third of the
  spec's ``lease``), so the lease is only how long the key stays reserved after a
  worker died: a live job keeps its key however long it runs. ``max_run`` stops
  renewing after that long (give it the job's ``job_timeout``).
* ``idemlock.current_claim()`` / :func:`current_fence` give the claim's fence
  inside the body: pass it to your writes so a dead attempt's late write is refused.
* An exception abandons the claim and propagates, so RQ's ``Retry`` runs the job
  again; exception classes listed in ``replay_errors`` are recorded and raised again
  on every replay instead.
* **Another attempt holds the key** (a duplicate, or a redelivery of a job whose
  work horse was killed): the job returns ``rq.Retry`` and is scheduled again after
  at most ``retry_every`` seconds, never later than just past the holder's lease, so
  it replays once the holder completes, or runs once a dead holder's lease ends.
* **The store fails before the body runs** (unreachable, timed out, full): nothing
  ran and nothing is held, and the job is scheduled again with a backoff from
  ``store_retry_backoff`` (1 s) doubling to ``store_retry_max`` (60 s), for as long
  as the store is down. It is never failed or dropped for it.

These reschedules return ``rq.Retry(max=2**31)``, so they never exhaust the job's
own ``retry=Retry(max=...)``, which counts the body's failures. A job called
directly (outside a worker) raises ``InFlightError`` or the store error instead.

A work horse killed mid-body (SIGKILL, out of memory) is seen by its worker, which
retries the job when it was enqueued with ``retry=Retry(...)``; the retry waits for
the dead claim's lease to end, then claims with a higher fence and runs. A whole
worker killed leaves its job in RQ's started registry until RQ's own clean-up
(a minute or more: the dead worker's heartbeat TTL, then maintenance) retries it, and
its scheduler lock ends about as late; the retry then meets the claim as above.

**Concurrency limit** (opt-in): ``concurrency=N`` runs at most N bodies of one
concurrency key at once, across every worker; ``concurrency_key`` is a callable of
the job's arguments returning that key (a tenant, a partner; None: every job of this
function counts together). After its claim (a replay needs no permit) the job holds
a permit of the semaphore ``<spec name>.concurrency`` while its body runs, renewed
like the claim and released when the body ends, whatever ends it. No permit free
within ``concurrency_wait`` seconds (default 1): nothing ran, the claim is abandoned
and the job returns ``rq.Retry`` like the reschedules above, within ``retry_every``
seconds; it does not use up the job's retries.

**Duplicate sends** (opt-in): ``enqueue_once(queue, fn, args=(...), kwargs={...},
lease=600, **options)`` (the call every idemlock queue integration shares) refuses
(returns None) to enqueue a job whose key is already queued or running. It takes
a send lease on the key for ``lease`` seconds, released when the job runs; a job
lost before it ran (a flushed queue, a crashed enqueuer) frees its key when that
lease ends, so nothing stays locked forever. Running is the claim itself, kept alive
by heartbeats.
"""

from __future__ import annotations

import functools
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast, overload

from rq import Queue, Retry, get_current_job
from rq.job import Job

from .._core.types import IdempotencySpec
from .._sync import Coordinator
from .jobs.guard import JobGuard, Later, current_fence, guard_of
from .jobs.options import JobKeywords, JobOptions, SendArgs, legacy_arguments
from .jobs.sends import send_under_lease

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ..aio import AsyncCoordinator

__all__ = ["SEND_META", "current_fence", "enqueue_once", "idempotent_job"]

F = TypeVar("F", bound=Callable[..., Any])

#: job.meta entry of a job sent by enqueue_once: the send lease's seconds
SEND_META = "idemlock_send_lease"
#: a reschedule for InFlight or a store failure must never use up the job's retries
_FOREVER = 2**31


def idempotent_job(
    spec: IdempotencySpec | str,
    key: Callable[..., str] | None = None,
    *,
    coordinator: Coordinator
    | AsyncCoordinator
    | str
    | Callable[[], Coordinator | AsyncCoordinator]
    | None = None,
    **options: Unpack[JobKeywords],
) -> Callable[[F], F]:
    """Make an RQ job function idempotent per key (see the module documentation).

    ``key`` is a callable of the job's arguments returning its key (None: the
    fingerprint of the canonical arguments, which are the payload either way).
    ``coordinator`` is an :class:`idemlock.Coordinator`, a store URL, a callable
    returning one, or None (``$IDEMLOCK_URL``); a URL or callable is opened in each
    work horse, after RQ forked it.
    The other options (:class:`~idemlock.integrations.jobs.options.JobKeywords`) are
    the module documentation's, the same on every queue."""

    checked = JobOptions.of(spec, key, coordinator, options, where="@idempotent_job")

    def decorate(fn: F) -> F:
        guard = JobGuard(fn, checked)

        @functools.wraps(fn)
        def job_function(*args: Any, **kwargs: Any) -> Any:
            job = get_current_job()
            if job is None:  # called directly: no queue to come back through
                return guard.call(args, kwargs, direct=True)
            what = f"job {job.func_name}[{job.id}]"
            send_lease = job.meta.get(SEND_META)

            def later(exc: Later) -> Retry:
                # RQ counts a returned Retry in number_of_retries, apart from the
                # retries_left of the job's own retry=Retry(max=...): those stay for the
                # body's failures.
                delay = guard.delay(exc, int(job.number_of_retries or 0), what)
                return Retry(max=_FOREVER, interval=max(1, math.ceil(delay)))

            send = None if send_lease is None else (job.id, float(send_lease))
            return guard.deliver(args, kwargs, send, later)

        job_function.idemlock_guard = guard  # type: ignore[attr-defined]
        return cast(F, job_function)

    return decorate


@overload
def enqueue_once(
    queue: Queue,
    fn: Callable[..., Any],
    /,
    *,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    lease: timedelta | float | None = None,
    **options: Any,
) -> Job | None: ...


@overload
def enqueue_once(
    queue: Queue,
    fn: Callable[..., Any],
    legacy_args: Sequence[Any],
    legacy_kwargs: Mapping[str, Any] | None = None,
    /,
    *,
    lease: timedelta | float | None = None,
    **options: Any,
) -> Job | None: ...  # deprecated: enqueue_once(queue, fn, args=..., kwargs=...)


def enqueue_once(
    queue: Queue,
    fn: Callable[..., Any],
    /,
    *legacy: Any,
    args: Any = None,
    kwargs: Any = None,
    lease: timedelta | float | None = None,
    **options: Any,
) -> Job | None:
    """``queue.enqueue(fn, args=args, kwargs=kwargs, **options)`` unless a job of its
    key is queued or running: then nothing is sent and the result is None; else the
    sent ``rq.job.Job``. ``lease`` (seconds or a timedelta, default 600) bounds how long a sent job
    that never runs keeps its key reserved (a crash, a flushed queue). ``options`` are
    ``queue.enqueue``'s own (``retry=``, ``job_timeout=``, ``job_id=``, ``meta=``...).

    The job's arguments are always ``args=``/``kwargs=``, so none of its keywords can
    collide with a send option (the form of every idemlock queue integration). The
    0.1 form ``enqueue_once(queue, fn, args, kwargs)`` still works, with a
    DeprecationWarning."""
    call = "enqueue_once()"
    args, kwargs = legacy_arguments(
        legacy,
        args,
        kwargs,
        old="enqueue_once(queue, fn, args, kwargs) with positional args/kwargs",
        new="enqueue_once(queue, fn, args=(...), kwargs={...}, lease=..., **options)",
        call=call,
    )
    guard = guard_of(fn, call=call, decorator="@idempotent_job")
    sent = SendArgs.parse(args, kwargs, lease, call=call, default_lease=guard.options.send_lease)
    job_id = str(options.pop("job_id", None) or uuid.uuid4().hex)
    meta = {**(options.pop("meta", None) or {}), SEND_META: sent.lease}
    key = guard.key_of(sent.args, sent.kwargs)
    return send_under_lease(
        guard.resolved()[0],
        guard.spec,
        key,
        job_id,
        sent.lease,
        lambda: queue.enqueue(
            fn, args=sent.args, kwargs=sent.kwargs, job_id=job_id, meta=meta, **options
        ),
    )
