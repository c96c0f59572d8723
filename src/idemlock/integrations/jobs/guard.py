"""What the RQ, arq and Dramatiq integrations share: one decorated body per worker
process, the decision to run the job later (another attempt holds the key, or the
store failed before the body ran), and the release of a send lease once a job ran.

The claim, the heartbeats that keep it alive while the body runs, the replay, the
abandon on failure and ``current_claim()`` are all the decorator's
(``Coordinator.idempotent``): a queue adds only how its jobs come back later.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import os
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..._context import current_claim
from ..._core.clock import duration
from ..._decorator import WrapPlan
from ..._errors import ConfigurationError, InFlightError, LockNotAcquired
from ..._logfields import fields as log_fields
from ..._sync import Coordinator
from .options import JobOptions, described, spec_name
from .permits import NoPermit, Permits
from .sends import STORE_ERRORS, free_send

log = logging.getLogger("idemlock.jobs")

# Set by the body's first line, so a failure can tell "before the body" from "in it".
_STARTED: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "idemlock_job_started", default=None
)


class Later(Exception):
    """The job must come back later: nothing ran and nothing is held. ``cause`` is the
    InFlightError, store error or LockNotAcquired (no permit of its concurrency limit
    was free) that stopped it before its body; the queue's module
    asks :meth:`JobGuard.delay` when, and sends the job back in a way that does not
    use up the job's own retries (those count the body's failures only)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause
        self.reason = str(cause)


def current_fence() -> int:
    """The fencing token of the idempotent job running in this thread or task."""
    token = current_claim()
    if token is None:
        raise ConfigurationError(
            "current_fence() is only available inside the body of an idempotent job "
            "(and only while it holds its claim)"
        )
    return int(token.fence)


class JobGuard:
    """One job function made idempotent with its :class:`JobOptions`, resolved once per
    worker process: the options' coordinator (an ``AsyncCoordinator`` for async jobs)
    given as a URL or a callable is opened lazily in each process, after a forking
    worker forked. ``skip``: leading arguments that are neither key nor payload."""

    def __init__(self, fn: Callable[..., Any], options: JobOptions, skip: int = 0) -> None:
        self.fn = fn
        self.is_async = inspect.iscoroutinefunction(fn)
        self.options = options
        self.spec = options.spec
        # arq passes its ctx first: it is neither part of the key nor the payload.
        self.skip = skip
        self.plan = WrapPlan(_without_first(fn) if skip else fn, options.key, options.replay_errors)
        self._lock = threading.Lock()
        self._state: tuple[int, Any, Callable[..., Any]] | None = None

    # ---- per process ---------------------------------------------------------------

    def resolved(self) -> tuple[Any, Callable[..., Any]]:
        """(coordinator, decorated body) of this process."""
        state = self._state
        pid = os.getpid()
        if state is None or state[0] != pid:
            with self._lock:
                state = self._state
                if state is None or state[0] != pid:
                    coord = self._connect()
                    body = self._decorate(coord)
                    state = (pid, coord, body)
                    self._state = state
        return state[1], state[2]

    def _connect(self) -> Any:
        return connect(
            self.options.coordinator, self.is_async, f"job {self.fn.__qualname__}", "coordinator"
        )

    def _decorate(self, coord: Any) -> Callable[..., Any]:
        fn = self.fn
        skip = self.skip
        if self.is_async:

            @functools.wraps(fn)
            async def abody(*args: Any, **kwargs: Any) -> Any:
                _mark_started()
                return await fn(*args, **kwargs)

            body: Callable[..., Any] = abody
        else:

            @functools.wraps(fn)
            def sbody(*args: Any, **kwargs: Any) -> Any:
                _mark_started()
                return fn(*args, **kwargs)

            body = sbody
        if skip and self.is_async:
            # The decorator sees the job's own arguments only (arq's ctx is neither key
            # nor payload); the ctx is handed around it through a context variable.
            inner = body

            async def without_ctx(*args: Any, **kwargs: Any) -> Any:
                return await inner(_CTX.get(), *args, **kwargs)

            functools.update_wrapper(without_ctx, _without_first(fn))
            body = without_ctx
        o = self.options
        if o.permits is not None:
            body = _limited(body, Permits(coord, o, f"job {fn.__qualname__}"), self.is_async)
        decorate = coord.idempotent(
            o.spec,
            o.key,
            "raise",
            replay_errors=o.replay_errors,
            renew_every=o.renew_every,
            max_run=o.max_run,
        )
        decorated: Callable[..., Any] = decorate(body)
        return decorated

    # ---- one delivery --------------------------------------------------------------

    def delay(self, later: Later, defers: int, what: str) -> float:
        """Seconds until ``later``'s job runs again (and ``later.reason`` says so).

        ``defers`` is how often idemlock already sent this job back for a store failure
        or a held key (not the queue's count of tries, which these never use up): the
        store-failure backoff doubles with it."""
        exc, o = later.cause, self.options
        if isinstance(exc, LockNotAcquired):
            # The permits are renewed while their holders run, so no end is known:
            # within retry_every, jittered, so the deferred jobs do not all return at once.
            delay = round(random.uniform(o.retry_every / 2, o.retry_every), 3)
            later.reason = f"{exc}; {what} runs again in {delay}s"
            return delay
        if isinstance(exc, InFlightError):
            left = o.retry_every
            if exc.expires_at is not None:
                left = exc.expires_at.timestamp() - self.resolved()[0].clock.time()
            # Just past the end of the holder's lease at the latest: the key is then
            # free (a dead holder) or still renewed (a live one: come back again).
            delay = round(min(o.retry_every, max(left, 0.0) + 0.05), 3)
            later.reason = f"{exc}; {what} runs again in {delay}s"
            return delay
        ceiling = min(o.store_retry_max, o.store_retry_backoff * 2.0 ** min(defers, 32))
        # Full jitter (never nothing): workers hit by one outage do not return together.
        delay = round(random.uniform(ceiling / 2, ceiling), 3)
        log.warning(
            "%s: the idempotency store failed before the job ran (%s); running it again in %ss",
            what,
            exc,
            delay,
            extra=log_fields(spec=spec_name(self.spec), operation="claim", outcome="error"),
        )
        later.reason = f"idempotency store unavailable: {exc}; again in {delay}s"
        return delay

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any], direct: bool = False) -> Any:
        """Run a sync job once: the result (run or replayed), its exception, or Later;
        ``direct`` (called outside a worker: no queue to come back through): Later's
        cause instead."""
        body = self.resolved()[1]
        with _attempt(direct):
            return body(*args, **kwargs)

    async def acall(
        self, ctx: Any, args: tuple[Any, ...], kwargs: dict[str, Any], direct: bool = False
    ) -> Any:
        """Run an async job once (see :meth:`call`)."""
        body = self.resolved()[1]
        cmark = _CTX.set(ctx)
        try:
            with _attempt(direct):
                return await body(*args, **kwargs)
        finally:
            _CTX.reset(cmark)

    def key_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return self.plan.key_payload(args, kwargs)[0]

    def deliver(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        send: tuple[str, float] | None,
        later: Callable[[Later], Any],
    ) -> Any:
        """Run one delivery of a sync job: its result, or ``later(...)``'s when it must
        come back (the job is still queued: its send lease keeps guarding the key);
        ``send`` (owner, seconds) is the send lease ``enqueue_once`` took, released
        once the job ran, replayed or failed."""
        deferred = False
        try:
            return self.call(args, kwargs)
        except Later as exc:
            deferred = True
            return later(exc)
        finally:
            if send is not None and not deferred:
                coord = self.resolved()[0]
                free_send(coord, self.spec, self.key_of(args, kwargs), *send)


_CTX: contextvars.ContextVar[Any] = contextvars.ContextVar("idemlock_job_ctx", default=None)


def guard_of(fn: Any, *, call: str, decorator: str) -> JobGuard:
    """The JobGuard an idemlock decorator put on ``fn``, or ConfigurationError."""
    guard = getattr(fn, "idemlock_guard", None)
    if not isinstance(guard, JobGuard):
        raise ConfigurationError(f"{call} needs a job decorated with {decorator}, got {fn!r}")
    return guard


def connect(source: Any, is_async: bool, what: str, option: str) -> Any:
    """The coordinator of ``source`` (a coordinator, a store URL, a callable returning
    a coordinator, or None: ``$IDEMLOCK_URL``) in this process, or ConfigurationError
    naming ``what`` and its ``option``."""
    from ...aio import AsyncCoordinator

    want: type = AsyncCoordinator if is_async else Coordinator
    if isinstance(source, want):
        return source
    if source is None or isinstance(source, str):
        if is_async:
            import idemlock.aio

            return idemlock.aio.connect(source)
        import idemlock

        return idemlock.connect(source)
    got = f"got {described(source)}"
    if callable(source) and not isinstance(source, (Coordinator, AsyncCoordinator)):
        made = source()
        if isinstance(made, want):
            return made
        got = f"the callable returned {described(made)}"
    raise ConfigurationError(
        f"{what}: {option} must be an idemlock.{want.__name__} (the job is "
        f"{'async' if is_async else 'sync'}), a store URL, or a callable returning an "
        f"idemlock.{want.__name__} (not a URL: pass the URL itself); {got}"
    )


@contextmanager
def _attempt(direct: bool) -> Iterator[None]:
    """Around one run of a job's body: a key in flight, no permit free or a store
    failure before the body started becomes Later (the job comes back; ``direct``: it
    propagates); once the body started, it propagates."""
    started: list[bool] = []
    mark = _STARTED.set(started)
    try:
        yield
    except NoPermit as exc:
        if direct:
            raise exc.cause from None
        raise Later(exc.cause) from None
    except (InFlightError, *STORE_ERRORS) as exc:
        if started or direct:
            raise
        raise Later(exc) from exc
    finally:
        _STARTED.reset(mark)


def _limited(body: Callable[..., Any], permits: Permits, is_async: bool) -> Callable[..., Any]:
    """``body`` run while holding a permit of its concurrency key (after the claim:
    a replay needs none), or NoPermit before it starts."""
    max_run = permits.options.max_run
    max_hold = None if max_run is None else float(duration(max_run, "max_run"))
    if is_async:

        async def alimited(*args: Any, **kwargs: Any) -> Any:
            async with permits.aheld(permits.key_of(args, kwargs), max_hold):
                return await body(*args, **kwargs)

        limited: Callable[..., Any] = alimited
    else:

        def slimited(*args: Any, **kwargs: Any) -> Any:
            with permits.held(permits.key_of(args, kwargs), max_hold):
                return body(*args, **kwargs)

        limited = slimited
    return functools.update_wrapper(limited, body)


def _mark_started() -> None:
    started = _STARTED.get()
    if started is not None:
        started.append(True)


def _without_first(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A stand-in for ``fn`` without its first parameter (arq's ctx), for signatures."""
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())[1:]

    def stand_in(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("never called")

    # __wrapped__ stays ``fn`` so its annotations resolve in its own module; the
    # signature stops at this stand-in.
    functools.update_wrapper(stand_in, fn)
    stand_in.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    return stand_in
