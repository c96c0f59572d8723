"""Idempotent Celery tasks: a redelivered or duplicate task replays the recorded result.

Make a task idempotent per key with the :class:`IdempotentTask` base class; its
options are ordinary task options::

    from celery import Celery
    from idemlock.integrations.celery import IdempotentTask

    app = Celery("shop", broker="redis://localhost:6379/0")

    @app.task(
        bind=True,
        base=IdempotentTask,
        idemlock_coordinator="sqlite:////var/lib/shop/idemlock.db",
        idemlock_spec="charge-order",
        idemlock_key=lambda order_id, amount: f"order-{order_id}",
        acks_late=True,
        reject_on_worker_lost=True,
        time_limit=60,
    )
    def charge(self, order_id: str, amount: int) -> dict:
        fence = self.request.idemlock_fence    # guards this attempt's writes
        return {"charge_id": payments.charge(order_id, amount, fence=fence)}

Options (task options or class attributes of a subclass; every one is optional but
``idemlock_spec``):

``idemlock_spec``
    An :class:`~idemlock.IdempotencySpec` or its name: the namespace of the keys and
    how long results are replayed (``ttl``). Never derived from the task's name, so
    renaming a task or moving its module cannot change its keys.
``idemlock_key``
    A callable of the task's arguments (not ``self``) returning the key; None uses
    the fingerprint of the canonical arguments. The canonical arguments are the
    payload either way: the same key with other arguments raises
    :class:`~idemlock.PayloadMismatch` (the task fails; it is not retried).
``idemlock_coordinator``
    A :class:`~idemlock.Coordinator`, a store URL, or a callable returning a
    Coordinator; None means :func:`idemlock.connect` (``$IDEMLOCK_URL``). A URL or a
    callable is opened lazily in each worker process, after the prefork pool has
    forked, so no process uses connections opened by another (prefer them to a
    Coordinator made at import time).
``idemlock_replay_errors``
    Exception classes whose raising is recorded and raised again on every replay
    (for example a declined card). Any other exception abandons the claim and
    propagates, so Celery's retry (``autoretry_for``, ``self.retry``) runs the task
    again. ``Retry``, ``Reject`` and ``Ignore`` always abandon (when the store cannot
    be told, the claim ends with its lease, so a retry waits rather than runs at once).
``idemlock_store_retry_backoff``, ``idemlock_store_retry_max``
    **A store failure before the body runs** (unreachable, timed out, full) never
    fails or drops the task: it is logged and the task is re-sent with a countdown
    that starts at ``idemlock_store_retry_backoff`` seconds (default 1) and doubles,
    with jitter, up to ``idemlock_store_retry_max`` (default 60), for as long as the
    store stays down. These re-sends keep ``self.request.retries`` unchanged, so an
    outage never uses up ``max_retries``; if the broker refuses the re-send too, the
    message is rejected with requeue. (``autoretry_for`` is not needed for this: the
    claim is made before ``run``, where autoretry does not reach.)
    **A store failure after the body ran** (its result or recorded error cannot be
    written) keeps the claim: the result is written again with backoff until the
    claim's lease ends (and, with a hard time limit, before the limit kills the
    process). If the store is still down by then the task fails with
    :class:`~idemlock.StoreUnavailable` and the key stays reserved until the lease
    ends, so a redelivery or retry never runs the body again at once.
``idemlock_on_in_flight``
    What a task does when another attempt holds the key: ``"retry"`` (default)
    re-sends it with a countdown of at most ``idemlock_retry_every`` seconds
    (default 5), never past the end of the holder's lease; these retries keep
    ``self.request.retries`` unchanged, so they never use up ``max_retries``, and
    they end at the latest when the holder's lease does (the key is then free or
    completed). ``"wait"`` blocks the worker slot until the holder finishes (at most
    the lease), then retries as above if it is still in flight. ``"raise"`` fails the
    task with :class:`~idemlock.InFlightError`. A task called directly or eagerly
    (``task_always_eager``) raises ``InFlightError``.
``idemlock_retry_every``
    The longest countdown of an in-flight retry, in seconds (default 5).
``idemlock_heartbeat``, ``idemlock_renew_every``
    Heartbeats (default on): while the body runs, the claim is renewed every
    ``idemlock_renew_every`` seconds (default: a third of the spec's lease) by the
    worker process's one renewer. ``False`` never renews (then the lease must
    outlast the body).
``idemlock_lease_margin``
    Seconds added to the time limit to make the claim's ``max_run`` (default 10).
``idemlock_send_lease``
    The default ``lease`` of :meth:`~IdempotentTask.apply_async_once` and
    :meth:`~IdempotentTask.delay_once`, in seconds (default 600).
``idemlock_concurrency``, ``idemlock_concurrency_key``, ``idemlock_concurrency_wait``
    **A concurrency limit**: at most ``idemlock_concurrency`` tasks of one
    concurrency key run their body at once, across every worker.
    ``idemlock_concurrency_key`` is a callable of the task's arguments returning that
    key (a tenant, a partner); None counts every task of this one together. After its
    claim (a replay needs no permit) the task holds a permit of the semaphore
    ``<spec name>.concurrency`` while its body runs, renewed like the claim and
    released when the body ends, whatever ends it. No permit free within
    ``idemlock_concurrency_wait`` seconds (default 1): the claim is abandoned and the
    task is re-sent with a countdown of at most ``idemlock_retry_every`` seconds,
    keeping ``self.request.retries`` (so it never uses up ``max_retries``).

**Duplicate sends** (opt-in). ``task.apply_async_once(args, kwargs, **options)``
and ``task.delay_once(*args, **kwargs)`` send the task like ``apply_async`` and
``delay`` and return its ``AsyncResult``, unless a task of the same key is already
queued or running: then they send nothing and return None. :func:`enqueue_once`
``(task, args=(...), kwargs={...}, lease=..., **options)`` is ``apply_async_once`` in
the form every idemlock queue integration shares. ``apply_async`` and
``delay`` are unchanged (a duplicate sent through them is queued, then replays).
Unlike a lock that the sender sets and the task deletes, which stays forever when
the task is lost, the refusal is a send lease on the key for ``lease`` seconds
(default ``idemlock_send_lease``; a ``countdown`` or ``eta`` adds its wait): the
worker releases it when the task has run (succeeded, replayed or failed for good),
while the task's running is refused by its claim, which heartbeats keep alive and
which ends one claim lease after a crash. A task lost before it ran (a purged
queue, a broker that lost the message, a worker killed with early acks) thus frees
its key when its send lease ends, and a send after that is accepted. A task that
waits (in-flight or store-down retries, ``self.retry``, a requeued ``Reject``)
keeps its send lease, since it is still queued. After the task completed, a send is
accepted again and replays the recorded result within the spec's ``ttl``. Give the
lease longer than a task may wait in the queue: once it ends, a duplicate is
accepted (it then replays or waits for the first, so nothing runs twice).

**The lease is the crash-recovery bound.** The claim's lease is the spec's
``lease`` (default 30 s), however long the task runs: heartbeats keep a live task's
claim, and a task whose worker died frees its key about one lease later. The task's
hard time limit (``time_limit``, per call or task or ``task_time_limit``), else its
soft time limit, plus ``idemlock_lease_margin``, is the claim's ``max_run``: renewal
stops then (runaway protection), so a task stuck past its time limit in a pool that
does not enforce it (solo, threads, eventlet) loses its key one lease later. A lost
claim (renewal refused, or none confirmed in time: a stopped process, a silent
store) sets ``current_claim().lost``; when the body returns, its outcome is still
recorded if nobody took the key over, else the task fails with
:class:`~idemlock.ClaimLost` and records nothing.

**The fencing token.** While the body runs, ``self.request.idemlock_fence`` (with
``bind=True``; else ``current_task.request.idemlock_fence`` or
:func:`current_fence`) is the claim's fence, which strictly increases with every new
claim of the key, and ``self.request.idemlock_key`` its key. After the call,
``task.request.idemlock_replayed`` tells ``task_postrun`` and ``task_success``
receivers whether the result was replayed. Pass the fence to your
writes (``UPDATE ... WHERE fence <= %s``, :meth:`idemlock.Coordinator.fence`) so a
late write of an attempt whose lease ended is refused.

The recommended settings (``acks_late``, ``reject_on_worker_lost``, a hard
``time_limit``, the broker's visibility timeout) and what idemlock guarantees with
them are in the Celery recipe of the documentation (``docs/recipes/celery.md``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import types
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any, ClassVar

from celery import Task, current_task  # type: ignore[import-untyped]
from celery.exceptions import Reject, Retry, TaskPredicate  # type: ignore[import-untyped]
from celery.utils import uuid  # type: ignore[import-untyped]

from .. import _attempts as attempts
from .._base.idempotency import Heartbeat
from .._context import enter_claim, leave_claim
from .._core.clock import duration
from .._core.types import ClaimToken, Completed, IdempotencySpec
from .._decorator import WrapPlan
from .._errors import (
    ConfigurationError,
    InFlightError,
    StaleClaim,
    StoreUnavailable,
)
from .._logfields import fields as log_fields
from .._logfields import port_fields
from .._sync import Coordinator, IdempotencyPort
from .._threads import Attempt
from .jobs import celery_resends as resends
from .jobs.celery_messages import (
    _STORE_ERRORS,
    SEND_HEADER,
    _ProcessState,
    _recorded,
    _send_lease,
    _wait_seconds,
)
from .jobs.guard import connect
from .jobs.options import DEFAULT_CONCURRENCY_WAIT, JobOptions, SendArgs, spec_name
from .jobs.permits import NoPermit, Permits
from .jobs.sends import free_send, send_under_lease

__all__ = [
    "IN_FLIGHT_MODES",
    "SEND_HEADER",
    "IdempotentTask",
    "current_fence",
    "enqueue_once",
]

log = logging.getLogger("idemlock.celery")

IN_FLIGHT_MODES = ("retry", "wait", "raise")

# Celery turns task options into class attributes; a function stored there would be
# bound to the task when read through ``self``, so these are kept as staticmethods.
_CALLABLE_OPTIONS = ("idemlock_key", "idemlock_coordinator", "idemlock_concurrency_key")

#: what a call sets on the task's request
_REQUEST_ATTRS = ("idemlock_key", "idemlock_fence", "idemlock_replayed")

#: first and longest pause between writes of a finished task's outcome
_RECORD_RETRY_FIRST = 0.1
_RECORD_RETRY_MAX = 2.0


def current_fence() -> int:
    """The fencing token of the idempotent task running in this thread."""
    task = current_task
    fence = getattr(task.request, "idemlock_fence", None) if task else None
    if fence is None:
        raise ConfigurationError(
            "current_fence() is only available inside the body of a task whose base is "
            "IdempotentTask (and only while it holds its claim)"
        )
    return int(fence)


class IdempotentTask(Task):  # type: ignore[misc]  # celery ships no type information
    """Celery task base class: run once per key, replay the result on redelivery.

    See the module documentation for the options, the recommended settings and the
    guarantees.
    """

    idemlock_coordinator: ClassVar[Coordinator | str | Callable[..., Coordinator] | None] = None
    idemlock_spec: ClassVar[IdempotencySpec | str | None] = None
    idemlock_key: ClassVar[Callable[..., str] | None] = None
    idemlock_replay_errors: ClassVar[tuple[type[BaseException], ...]] = ()
    idemlock_on_in_flight: ClassVar[str] = "retry"
    idemlock_retry_every: ClassVar[float] = 5.0
    idemlock_lease_margin: ClassVar[float] = 10.0
    idemlock_heartbeat: ClassVar[bool] = True
    idemlock_renew_every: ClassVar[float | None] = None
    idemlock_store_retry_backoff: ClassVar[float] = 1.0
    idemlock_store_retry_max: ClassVar[float] = 60.0
    idemlock_send_lease: ClassVar[float] = 600.0
    idemlock_concurrency: ClassVar[int | None] = None
    idemlock_concurrency_key: ClassVar[Callable[..., str] | None] = None
    idemlock_concurrency_wait: ClassVar[float] = DEFAULT_CONCURRENCY_WAIT

    _idemlock_lock: ClassVar[threading.Lock]
    _idemlock_state: _ProcessState | None = None
    #: the options above every queue integration shares, checked (a concrete task's)
    _idemlock_options: ClassVar[JobOptions]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in _CALLABLE_OPTIONS:
            value = cls.__dict__.get(name)
            if isinstance(value, types.FunctionType):
                setattr(cls, name, staticmethod(value))
        cls._idemlock_lock = threading.Lock()
        cls._idemlock_state = None
        # A concrete task (or a subclass of one), not an intermediate base class.
        if "run" in cls.__dict__ or hasattr(cls, "_idemlock_options"):
            cls._idemlock_check()

    @classmethod
    def _idemlock_check(cls) -> None:
        where = f"task {cls.__dict__.get('name') or cls.__name__}"
        if cls.idemlock_spec is None:
            raise ConfigurationError(
                f"{where}: IdempotentTask needs idemlock_spec= (an IdempotencySpec or a "
                "stable name for the task's keys)"
            )
        if cls.idemlock_on_in_flight not in IN_FLIGHT_MODES:
            raise ConfigurationError(
                f"{where}: idemlock_on_in_flight must be one of {IN_FLIGHT_MODES}, got "
                f"{cls.idemlock_on_in_flight!r}"
            )
        duration(cls.idemlock_lease_margin, f"{where}: idemlock_lease_margin")
        if not isinstance(cls.idemlock_heartbeat, bool):
            raise ConfigurationError(f"{where}: idemlock_heartbeat must be True or False")
        cls._idemlock_options = JobOptions(
            cls.idemlock_spec,
            cls.idemlock_key,
            coordinator=cls.idemlock_coordinator,
            replay_errors=tuple(cls.idemlock_replay_errors),
            retry_every=cls.idemlock_retry_every,
            store_retry_backoff=cls.idemlock_store_retry_backoff,
            store_retry_max=cls.idemlock_store_retry_max,
            renew_every=cls.idemlock_renew_every,
            send_lease=cls.idemlock_send_lease,
            concurrency=cls.idemlock_concurrency,
            concurrency_key=cls.idemlock_concurrency_key,
            concurrency_wait=cls.idemlock_concurrency_wait,
            where=where,
            prefix="idemlock_",
        )

    # ---- per process ---------------------------------------------------------------

    def _idemlock(self) -> _ProcessState:
        state = self._idemlock_state
        pid = os.getpid()
        if state is not None and state.pid == pid:
            return state
        with self._idemlock_lock:
            state = self._idemlock_state
            if state is None or state.pid != pid:
                o = self._idemlock_options
                plan = WrapPlan(self.run, o.key, o.replay_errors)
                coord = connect(o.coordinator, False, f"task {self.name}", "idemlock_coordinator")
                state = _ProcessState(pid, coord, plan)
                if o.permits is not None:
                    state.permits = Permits(coord, o, f"task {self.name}")
                type(self)._idemlock_state = state
        return state

    def _idemlock_port(self, state: _ProcessState, lease: float | None) -> IdempotencyPort:
        spec = self._idemlock_options.spec
        ms = 0 if lease is None else max(1, round(lease * 1000))
        port = state.ports.get(ms)
        if port is None:
            spec = spec if isinstance(spec, IdempotencySpec) else IdempotencySpec(spec)
            if lease is not None:
                # Same name, so the same keys: only the claim's lease changes.
                spec = dataclasses.replace(spec, lease=timedelta(seconds=lease))
            port = state.ports[ms] = state.coord.idempotency(spec)
        return port

    def _idemlock_max_run(self) -> float | None:
        """The hard time limit (else the soft one) in force for this call, plus margin:
        how long the claim is renewed."""
        hard, soft = self._idemlock_limits()
        limit = hard or soft
        if not limit:
            return None
        return float(limit) + float(self.idemlock_lease_margin)

    def _idemlock_limits(self) -> tuple[float | None, float | None]:
        request = self.request
        hard, soft = request.timelimit or (None, None)
        conf = self.app.conf
        hard = hard or self.time_limit or conf.task_time_limit
        soft = soft or self.soft_time_limit or conf.task_soft_time_limit
        return (float(hard) if hard else None, float(soft) if soft else None)

    def _idemlock_spec(self) -> IdempotencySpec | str:
        return self._idemlock_options.spec

    # ---- duplicate sends -------------------------------------------------------------

    def apply_async_once(
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        *,
        lease: timedelta | float | None = None,
        **options: Any,
    ) -> Any:
        """``apply_async(args, kwargs, **options)`` unless a task of the same key is
        queued or running: then send nothing and return None (see the module
        documentation). ``lease`` (default ``idemlock_send_lease``) bounds how long a
        sent task that never runs keeps its key reserved."""
        sent = SendArgs.parse(
            args,
            kwargs,
            lease,
            call=f"{self.name}.apply_async_once()",
            default_lease=self._idemlock_options.send_lease,
        )
        args, kwargs = sent.args, sent.kwargs
        seconds_ = sent.lease + _wait_seconds(options)
        state = self._idemlock()
        spec = self._idemlock_spec()
        key = state.plan.key_payload(args, kwargs)[0]
        task_id = str(options.pop("task_id", None) or uuid())
        headers = {**(options.pop("headers", None) or {}), SEND_HEADER: seconds_}
        sent_ = send_under_lease(
            state.coord,
            spec,
            key,
            task_id,
            seconds_,
            lambda: self.apply_async(args, kwargs, task_id=task_id, headers=headers, **options),
        )
        if sent_ is None:
            log.debug(
                "task %s: not sent, a task of key %r is queued or running",
                self.name,
                key,
                extra=log_fields(spec=spec_name(spec), operation="send", outcome="refused"),
            )
        return sent_

    def delay_once(self, *args: Any, **kwargs: Any) -> Any:
        """``delay(*args, **kwargs)`` unless a task of the same key is queued or
        running: then None. :meth:`apply_async_once` takes options and ``lease``."""
        return self.apply_async_once(args, kwargs)

    # ---- the call: claim, run, settle -------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # A request context of our own (a copy of the worker's, as Task.__call__ makes),
        # so the idemlock_* attributes reach the body and vanish with this call.
        outer = self.request
        self.push_request(args=args, kwargs=kwargs)
        send_lease = _send_lease(outer)
        done = True
        try:
            return self._idemlock_call(args, kwargs)
        except (Retry, Reject) as exc:
            # Sent again or requeued: still queued, so its send lease keeps the key.
            done = isinstance(exc, Reject) and not exc.requeue
            raise
        finally:
            inner = self.request.__dict__
            self.pop_request()
            if send_lease is not None and done:
                state = self._idemlock()
                key = state.plan.key_payload(args, kwargs)[0]
                free_send(state.coord, self._idemlock_spec(), key, outer.id, send_lease)
            if not outer.called_directly:
                # The worker's request of this delivery: what task_postrun and
                # task_success receivers see (never the shared default request).
                for name in _REQUEST_ATTRS:
                    if name in inner:
                        setattr(outer, name, inner[name])

    def _idemlock_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        started = time.monotonic()
        try:
            state = self._idemlock()
            plan = state.plan
            port = self._idemlock_port(state, None)
            every = attempts.heartbeat_every(port, self._idemlock_options.renew_every)
            wait = attempts.default_wait(port) if self.idemlock_on_in_flight == "wait" else None
            claim, sent = attempts.begin_call(port, plan, args, kwargs, wait)
        except InFlightError as exc:
            raise resends.while_in_flight(self, exc) from None
        except _STORE_ERRORS as exc:
            # Nothing ran and nothing is claimed: send the task again later.
            raise resends.after_store_failure(self, exc) from None
        request = self.request
        if isinstance(claim, Completed):
            request.idemlock_replayed = True
            log.debug(
                "task %s[%s] replays the recorded result",
                self.name,
                request.id,
                extra=port_fields(port, "claim", "replayed"),
            )
            return plan.replay(claim)
        token = claim.token
        request.idemlock_key = token.key
        request.idemlock_fence = token.fence
        request.idemlock_replayed = False
        beat = None
        if self.idemlock_heartbeat:
            beat = attempts.keep_alive(port, token, sent, every, self._idemlock_max_run())
        # current_claim() in the body, with its ``lost`` flag and its steps
        mark = enter_claim(token, Attempt(token.key, token, port=port))
        permits: Permits | None = state.permits
        try:
            try:
                if permits is None:
                    result = super().__call__(*args, **kwargs)
                else:
                    # After the claim (a replay needs no permit), around the body only.
                    limit_key = permits.key_of(args, kwargs)
                    with permits.held(limit_key, self._idemlock_max_run()):
                        result = super().__call__(*args, **kwargs)
            finally:
                leave_claim(mark)
                if beat is not None:
                    beat.stop()
        except NoPermit as exc:
            # Nothing ran: free the key and come back later, keeping ``retries``.
            attempts.abandon_quietly(port, token)
            raise resends.while_limited(self, exc.cause) from None
        except TaskPredicate:
            # Retry/Reject/Ignore are control flow, never an outcome to replay.
            attempts.abandon_quietly(port, token)
            raise
        except BaseException as exc:
            self._idemlock_settle(
                state, port, token, started, beat, attempts.fail, port, plan, token, exc
            )
            raise
        self._idemlock_settle(
            state, port, token, started, beat, attempts.record, port, plan, token, result, beat
        )
        return result

    def _idemlock_settle(
        self,
        state: _ProcessState,
        port: IdempotencyPort,
        token: ClaimToken,
        started: float,
        beat: Heartbeat | None,
        write: Callable[..., None],
        *args: Any,
    ) -> None:
        """Write a finished body's outcome; while the store fails, again with backoff
        until the claim's lease ends (or the hard time limit nears), never abandoning
        the claim: the body ran, so the key must stay reserved until its lease ends."""
        clock = state.coord.clock
        lease_end = token.expires_at.timestamp()
        if beat is not None and beat.state.expires_ms:
            # Renewed: the store holds the key until one lease after the last renewal.
            lease_end = max(lease_end, beat.state.expires_ms / 1000)
        # Each call is bounded by the store's timeout: none may still run when the hard
        # time limit kills this process (a write that ends after the lease is still
        # accepted while no other attempt took the key over).
        bound = float(state.coord.store.timeout)
        hard, _ = self._idemlock_limits()
        pause = _RECORD_RETRY_FIRST
        failed = False
        while True:
            try:
                write(*args)
                return
            except StaleClaim:
                # A failed write may have reached the store before its reply was lost:
                # then this claim's outcome is recorded already, and that is success.
                if failed and _recorded(port, token):
                    return
                raise
            except _STORE_ERRORS as exc:
                failed = True
                left = lease_end - clock.time()
                if hard is not None:
                    left = min(left, started + hard - bound - time.monotonic())
                if left <= pause:
                    log.error(
                        "task %s[%s] ran, but its outcome could not be recorded before its "
                        "claim's lease ends (%s): the key stays reserved until then, and a "
                        "later retry runs it again",
                        self.name,
                        self.request.id,
                        exc,
                        extra=port_fields(port, "complete", "error"),
                    )
                    raise StoreUnavailable(
                        f"task {self.name} ran, but its outcome for idempotency key "
                        f"{token.key!r} could not be recorded ({exc}); the key stays "
                        f"reserved until {token.expires_at.isoformat()}, after which a "
                        "retry runs the task again, so make its effects fenced "
                        "(self.request.idemlock_fence)"
                    ) from exc
                log.warning(
                    "task %s[%s]: could not record the outcome (%s); trying again in "
                    "%.2fs while the claim's lease lasts",
                    self.name,
                    self.request.id,
                    exc,
                    pause,
                    extra=port_fields(port, "complete", "error"),
                )
                time.sleep(pause)
                pause = min(pause * 2, _RECORD_RETRY_MAX)


def enqueue_once(
    task: IdempotentTask,
    /,
    *,
    args: Sequence[Any] | None = None,
    kwargs: Mapping[str, Any] | None = None,
    lease: timedelta | float | None = None,
    **options: Any,
) -> Any:
    """``task.apply_async(args, kwargs, **options)`` unless a task of its key is
    queued or running: then nothing is sent and the result is None; else the sent
    ``AsyncResult``. The form every idemlock queue integration shares (the job's
    arguments as ``args=``/``kwargs=``, the send ``lease``, the queue's own options);
    the same as :meth:`IdempotentTask.apply_async_once`."""
    send = getattr(task, "apply_async_once", None)
    if not callable(send):
        raise ConfigurationError(
            f"enqueue_once() needs a task made with base=IdempotentTask, got {task!r}"
        )
    return send(args, kwargs, lease=lease, **options)
