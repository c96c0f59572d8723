"""Idempotent Dramatiq actors: a retried, redelivered or duplicate message replays the
recorded result instead of running the actor again.

Put :func:`idempotent` under ``@dramatiq.actor``::

    import dramatiq
    from dramatiq.brokers.redis import RedisBroker
    from dramatiq.middleware import CurrentMessage
    from idemlock.integrations.dramatiq import idempotent, current_fence

    broker = RedisBroker(url="redis://localhost:6379/0")
    broker.add_middleware(CurrentMessage())   # uncounted reschedules, enqueue_once
    dramatiq.set_broker(broker)

    @dramatiq.actor(max_retries=20)
    @idempotent(
        "charge-order",
        key=lambda order_id, amount: f"order-{order_id}",
        coordinator="redis://localhost:6379/1",
    )
    def charge(order_id: str, amount: int) -> dict:
        return {"charge_id": payments.charge(order_id, amount, fence=current_fence())}

What a message does when a worker runs it is what ``Coordinator.idempotent`` does
(the same rules as the RQ and Celery integrations):

* It **claims its key at execution**; a key completed within the spec's ``ttl``
  replays the recorded result and the actor body does not run.
* While the body runs the claim is **renewed** (heartbeats), so the spec's ``lease``
  is only how long a dead worker's key stays reserved. ``max_run`` stops renewing
  after that long (give it the actor's ``time_limit``).
* ``idemlock.current_claim()`` / :func:`current_fence` is the fence in the body.
* An exception abandons the claim and propagates to Dramatiq's ``Retries``
  middleware (the message is retried with its backoff); exceptions in
  ``replay_errors`` are recorded and raised again on every replay instead.
* **Another attempt holds the key** or **the store fails before the body runs**:
  nothing ran and nothing is held; the actor raises ``dramatiq.Retry(delay=...)``
  (not logged as an error): for a held key at most ``retry_every`` seconds and never
  later than just past the holder's lease; for a store failure a backoff from
  ``store_retry_backoff`` doubling to ``store_retry_max``, for as long as the store
  is down. These reschedules **do not count toward** ``max_retries``: the actor
  takes back the retry the ``Retries`` middleware adds for them (in the message's
  ``retries`` option), so ``max_retries`` is left to the body's failures. This needs
  the ``CurrentMessage`` middleware (without it they count, and a warning says so)
  and the ``Retries`` middleware (Dramatiq's default). An actor with a
  ``retry_when`` is asked about them too: it must return True for a
  ``dramatiq.Retry``.

The message keeps its id through all of this, so its result (``message.get_result``
with the ``Results`` middleware) is the body's result, or the recorded result a
duplicate replays.

A worker killed mid-body (SIGKILL) leaves its message unacknowledged; the Redis
broker gives it to another worker once the dead worker's heartbeat is older than
``heartbeat_timeout``; the redelivered message waits for the dead claim's lease,
then claims with a higher fence and runs.

**Concurrency limit** (opt-in): ``concurrency=N`` runs at most N bodies of one
concurrency key at once, across every worker; ``concurrency_key`` is a callable of
the job's arguments returning that key (a tenant, a partner; None: every job of this
function counts together). After its claim (a replay needs no permit) the job holds
a permit of the semaphore ``<spec name>.concurrency`` while its body runs, renewed
like the claim and released when the body ends, whatever ends it. No permit free
within ``concurrency_wait`` seconds (default 1): nothing ran, the claim is abandoned
and the actor raises ``dramatiq.Retry`` like the reschedules above, taking its retry
back, within ``retry_every`` seconds; it does not use up the job's retries.

**Duplicate sends** (opt-in): :func:`enqueue_once` refuses (returns None) to send a
message whose key is already queued or running, with a send lease of ``lease``
seconds released when the message runs (this needs the ``CurrentMessage``
middleware); a message lost before it ran frees its key when the lease ends.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar, cast

import dramatiq
from dramatiq.middleware import CurrentMessage

from .._core.types import IdempotencySpec
from .._errors import ConfigurationError
from .._logfields import fields as log_fields
from .._sync import Coordinator
from .jobs.guard import JobGuard, Later, current_fence, guard_of
from .jobs.options import JobKeywords, JobOptions, SendArgs, deprecated, spec_name
from .jobs.sends import send_under_lease

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["SEND_OPTION", "current_fence", "enqueue_once", "idempotent", "send_once"]

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R")

log = logging.getLogger("idemlock.jobs")

#: message option of a message sent by enqueue_once: the send lease's seconds
SEND_OPTION = "idemlock_send_lease"
#: message option counting idemlock's reschedules of a message (its store-failure backoff)
DEFERS_OPTION = "idemlock_defers"


def idempotent(
    spec: IdempotencySpec | str,
    key: Callable[..., str] | None = None,
    *,
    coordinator: Coordinator | str | Callable[[], Coordinator] | None = None,
    **options: Unpack[JobKeywords],
) -> Callable[[F], F]:
    """Make a Dramatiq actor's function idempotent per key (put it under
    ``@dramatiq.actor``; see the module documentation). ``coordinator`` is an
    :class:`idemlock.Coordinator`, a store URL, a callable returning one, or None
    (``$IDEMLOCK_URL``), opened lazily in each worker process.
    The other options (:class:`~idemlock.integrations.jobs.options.JobKeywords`) are
    the module documentation's, the same on every queue."""

    checked = JobOptions.of(spec, key, coordinator, options, where="@idempotent")

    def decorate(fn: F) -> F:
        guard = JobGuard(fn, checked)
        if guard.is_async:
            raise ConfigurationError(
                f"{fn.__qualname__}: idemlock.integrations.dramatiq takes plain functions "
                "(Dramatiq runs actors in threads)"
            )

        @functools.wraps(fn)
        def actor_function(*args: Any, **kwargs: Any) -> Any:
            message = CurrentMessage.get_current_message()
            if message is None:
                # Called directly, or by a worker whose broker lacks CurrentMessage.
                try:
                    return guard.call(args, kwargs)
                except Later as exc:
                    delay = guard.delay(exc, 0, f"actor {fn.__qualname__}")
                    _warn_without_current_message(fn.__qualname__, guard)
                    raise dramatiq.Retry(exc.reason, delay=_ms(delay)) from None
            options = message.options
            what = f"actor {fn.__qualname__}[{message.message_id}]"

            def later(exc: Later) -> None:
                defers = int(options.get(DEFERS_OPTION, 0) or 0)
                delay = guard.delay(exc, defers, what)
                options[DEFERS_OPTION] = defers + 1
                # The Retries middleware adds one to "retries" for this Retry and
                # fails the message once they pass max_retries: take that one back
                # first, so the reschedule leaves max_retries to the body's failures.
                options["retries"] = int(options.get("retries", 0) or 0) - 1
                raise dramatiq.Retry(exc.reason, delay=_ms(delay)) from None

            send_lease = options.get(SEND_OPTION)
            send = None if send_lease is None else (message.message_id, float(send_lease))
            return guard.deliver(args, kwargs, send, later)

        actor_function.idemlock_guard = guard  # type: ignore[attr-defined]
        return cast(F, actor_function)

    return decorate


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


_warned: set[str] = set()


def _warn_without_current_message(name: str, guard: JobGuard) -> None:
    if name in _warned:
        return
    _warned.add(name)
    log.warning(
        "actor %s: idemlock reschedules it (its key is held, or the store failed before "
        "it ran) but sees no current message, so the reschedule counts toward the "
        "actor's max_retries: add the CurrentMessage middleware to the broker "
        "(broker.add_middleware(dramatiq.middleware.CurrentMessage()))",
        name,
        extra=log_fields(spec=spec_name(guard.spec), operation="claim", outcome="error"),
    )


def enqueue_once(
    actor: dramatiq.Actor[Any, R],
    /,
    *,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    lease: timedelta | float | None = None,
    delay: int | None = None,
    **options: Any,
) -> dramatiq.Message[R] | None:
    """``actor.send_with_options(args=args, kwargs=kwargs, delay=delay, **options)``
    unless a message of its key is queued or running: then nothing is sent and the
    result is None; else the sent ``dramatiq.Message``. ``lease`` (seconds or a
    timedelta, default 600) bounds how long a sent message that never runs keeps its key reserved;
    ``delay`` (milliseconds) and ``options`` (message options: ``max_retries``...) are
    Dramatiq's own. The actor's broker needs the ``CurrentMessage`` middleware.

    The job's arguments are always ``args=``/``kwargs=`` (the form of every idemlock
    queue integration); :func:`send_once` is the deprecated 0.1 form."""
    call = "enqueue_once()"
    guard = guard_of(
        getattr(actor, "fn", None), call=call, decorator="@idempotent (under @dramatiq.actor)"
    )
    sent = SendArgs.parse(args, kwargs, lease, call=call, default_lease=guard.options.send_lease)
    if not any(isinstance(m, CurrentMessage) for m in actor.broker.middleware):
        raise ConfigurationError(
            f"{call} needs the CurrentMessage middleware on the broker "
            "(broker.add_middleware(dramatiq.middleware.CurrentMessage())), so the "
            "worker can release the send lease when the message runs"
        )
    message = actor.message_with_options(
        args=sent.args, kwargs=sent.kwargs, **options, **{SEND_OPTION: sent.lease}
    )
    key = guard.key_of(sent.args, sent.kwargs)
    owner = message.message_id
    queued: dramatiq.Message[R] | None = send_under_lease(
        guard.resolved()[0],
        guard.spec,
        key,
        owner,
        sent.lease,
        lambda: actor.broker.enqueue(message, delay=delay),
    )
    return queued


def send_once(
    actor: dramatiq.Actor[Any, R],
    *args: Any,
    lease: timedelta | float | None = None,
    delay: int | None = None,
    **kwargs: Any,
) -> dramatiq.Message[R] | None:
    """Deprecated (the 0.1 form): ``enqueue_once(actor, args=args, kwargs=kwargs,
    lease=lease, delay=delay)``, which this calls, with a DeprecationWarning."""
    deprecated(
        "send_once(actor, *args, **kwargs)",
        "enqueue_once(actor, args=(...), kwargs={...}, lease=..., delay=...)",
    )
    return enqueue_once(actor, args=args, kwargs=kwargs, lease=lease, delay=delay)
