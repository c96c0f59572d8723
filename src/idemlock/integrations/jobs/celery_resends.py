"""Sending an idempotent Celery task again without running it: after a store failure
before the body ran (a growing, jittered countdown) and while another attempt holds
the key (until its lease ends). A re-send keeps ``retries``, so these waits never use
up ``max_retries``; nor do the re-sends of a task that found no permit of its
concurrency limit free."""

from __future__ import annotations

import logging
import random
from typing import Any

from celery.exceptions import Reject, Retry  # type: ignore[import-untyped]

from ..._errors import InFlightError, LockNotAcquired
from ..._logfields import fields as log_fields
from .celery_messages import _STORE_TRIES_HEADER, _store_tries
from .options import spec_name

log = logging.getLogger("idemlock.celery")


def after_store_failure(task: Any, exc: BaseException) -> BaseException:
    """A Retry after a store failure before the body ran, with a growing countdown,
    or ``exc`` itself for a direct or eager call."""
    request = task.request
    if request.called_directly or request.is_eager:
        return exc
    headers = dict(request.headers or {})
    tries = _store_tries(request, headers)
    ceiling = min(
        task._idemlock_options.store_retry_max,
        task._idemlock_options.store_retry_backoff * 2.0 ** min(tries, 32),
    )
    # Full jitter (but never nothing): workers hit by one outage do not all come
    # back at the same instant.
    countdown = round(random.uniform(ceiling / 2, ceiling), 3)
    headers[_STORE_TRIES_HEADER] = tries + 1
    log.warning(
        "task %s[%s]: the idempotency store failed before the task ran (%s); "
        "retrying in %ss (store failure %d in a row)",
        task.name,
        request.id,
        exc,
        countdown,
        tries + 1,
        extra=log_fields(
            spec=spec_name(task._idemlock_options.spec), operation="claim", outcome="error"
        ),
    )
    why = f"idempotency store unavailable: {exc}; retrying in {countdown}s"
    return resend(task, exc, countdown, why, headers=headers)


def resend(
    task: Any, exc: BaseException, countdown: float, why: str, **options: Any
) -> BaseException:
    """Send this task again after ``countdown`` seconds, keeping ``retries``: the
    Retry to raise, or a requeueing Reject when the broker refuses the message."""
    request = task.request
    sig = task.signature_from_request(
        request, countdown=countdown, retries=request.retries, **options
    )
    try:
        sig.apply_async()
    except Exception as err:
        # Not sent: put the message back rather than lose the only copy.
        rejected: BaseException = Reject(err, requeue=True)
        return rejected
    retry: BaseException = Retry(why, exc=exc, when=countdown, sig=sig)
    return retry


def while_in_flight(task: Any, exc: InFlightError) -> BaseException:
    """A Retry that comes back when the holder is likely done, or ``exc`` itself."""
    request = task.request
    if task.idemlock_on_in_flight == "raise" or request.called_directly or request.is_eager:
        return exc
    state = task._idemlock()
    every = task._idemlock_options.retry_every
    left = every
    if exc.expires_at is not None:
        left = exc.expires_at.timestamp() - state.coord.clock.time()
    # Just past the end of the holder's lease at the latest: the key is then free.
    countdown = round(min(every, max(left, 0.0) + 0.05), 3)
    until = f" until {exc.expires_at.isoformat()}" if exc.expires_at else ""
    why = f"idempotency key {exc.key!r} is held by another attempt{until}"
    # Waiting for another attempt is not a failure: keep ``retries`` as it is, so
    # these re-sends do not use up max_retries (``task.retry`` would add one).
    # A store failure streak is over: the next one backs off from the start again.
    headers = {k: v for k, v in (request.headers or {}).items() if k != _STORE_TRIES_HEADER}
    return resend(task, exc, countdown, f"{why}; retrying in {countdown}s", headers=headers)


def while_limited(task: Any, exc: LockNotAcquired) -> BaseException:
    """A Retry that comes back within ``idemlock_retry_every`` (jittered) when no
    permit of the task's concurrency limit was free, or ``exc`` itself for a direct or
    eager call. It keeps ``retries``: waiting for a permit is not a failure."""
    request = task.request
    if request.called_directly or request.is_eager:
        return exc
    every = task._idemlock_options.retry_every
    # The holders renew their permits while they run, so no end is known; jittered,
    # so the tasks sent back together do not all return at once.
    countdown = round(random.uniform(every / 2, every), 3)
    headers = {k: v for k, v in (request.headers or {}).items() if k != _STORE_TRIES_HEADER}
    return resend(task, exc, countdown, f"{exc}; retrying in {countdown}s", headers=headers)
