"""What the RQ, arq and Dramatiq integrations share: one decorated body per worker
process, the decision to run the job later (another attempt holds the key, or the
store failed before the body ran), and the opt-in refusal of duplicate sends.

The claim, the heartbeats that keep it alive while the body runs, the replay, the
abandon on failure and ``current_claim()`` are all the decorator's
(``Coordinator.idempotent``): a queue adds only how its jobs come back later.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
import logging
import os
import random
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from .._context import current_claim
from .._core.clock import duration
from .._core.types import IdempotencySpec, LockSpec
from .._decorator import WrapPlan
from .._errors import ConfigurationError, InFlightError, StoreFull, StoreUnavailable
from .._logfields import fields as log_fields
from .._sync import Coordinator
from .._urls import redact

log = logging.getLogger("idemlock.jobs")

#: store failures before the body that make a job come back later
STORE_ERRORS = (StoreUnavailable, StoreFull)

# Set by the body's first line, so a failure can tell "before the body" from "in it".
_STARTED: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "idemlock_job_started", default=None
)


class Later(Exception):
    """The job must come back later: nothing ran and nothing is held. ``cause`` is the
    InFlightError or store error that stopped it before its body; the queue's module
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


def described(value: Any) -> str:
    """``value`` as a message may show it: a str redacted (it may be a store URL with
    its password), anything else by its type only (its repr may hold secrets)."""
    if isinstance(value, str):
        return f"the str {redact(value)!r}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def spec_name(spec: IdempotencySpec | str) -> str:
    return spec if isinstance(spec, str) else spec.name


class JobGuard:
    """One job function made idempotent, resolved once per worker process.

    ``coordinator`` is a Coordinator (an ``AsyncCoordinator`` for async jobs), a store
    URL, a callable returning a coordinator, or None (``$IDEMLOCK_URL``). A URL or a callable is
    opened lazily in each process, after a forking worker forked."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        spec: IdempotencySpec | str,
        key: Callable[..., str] | None,
        coordinator: Any,
        replay_errors: tuple[type[BaseException], ...],
        retry_every: float,
        store_retry_backoff: float,
        store_retry_max: float,
        renew_every: timedelta | float | None,
        max_run: timedelta | float | None,
        skip: int = 0,
    ) -> None:
        if not isinstance(spec, (str, IdempotencySpec)):
            raise ConfigurationError(f"spec must be an IdempotencySpec or a name, got {spec!r}")
        if isinstance(spec, str):
            IdempotencySpec(spec)  # validates the name at import, not per job
        if key is not None and not callable(key):
            raise ConfigurationError("key must be a callable of the job's arguments or None")
        self.fn = fn
        self.is_async = inspect.iscoroutinefunction(fn)
        self.spec = spec
        self.key = key
        self.source = coordinator
        self.replay_errors = tuple(replay_errors)
        self.retry_every = duration(retry_every, "retry_every", positive=True)
        self.store_retry_backoff = duration(
            store_retry_backoff, "store_retry_backoff", positive=True
        )
        self.store_retry_max = duration(store_retry_max, "store_retry_max", positive=True)
        self.renew_every = renew_every
        self.max_run = max_run
        # arq passes its ctx first: it is neither part of the key nor the payload.
        self.skip = skip
        self.plan = WrapPlan(_without_first(fn) if skip else fn, key, self.replay_errors)
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
        from ..aio import AsyncCoordinator

        want: type = AsyncCoordinator if self.is_async else Coordinator
        source = self.source
        if isinstance(source, want):
            return source
        if source is None or isinstance(source, str):
            if self.is_async:
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
            f"job {self.fn.__qualname__}: coordinator must be an idemlock."
            f"{want.__name__} (the job is {'async' if self.is_async else 'sync'}), a store "
            f"URL, or a callable returning an idemlock.{want.__name__} (not a URL: pass "
            f"the URL itself); {got}"
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
        key = self.key
        if skip and self.is_async:
            # The decorator sees the job's own arguments only (arq's ctx is neither key
            # nor payload); the ctx is handed around it through a context variable.
            inner = body

            async def without_ctx(*args: Any, **kwargs: Any) -> Any:
                return await inner(_CTX.get(), *args, **kwargs)

            functools.update_wrapper(without_ctx, _without_first(fn))
            body = without_ctx
        decorate = coord.idempotent(
            self.spec,
            key,
            "raise",
            replay_errors=self.replay_errors,
            renew_every=self.renew_every,
            max_run=self.max_run,
        )
        decorated: Callable[..., Any] = decorate(body)
        return decorated

    # ---- one delivery --------------------------------------------------------------

    def delay(self, later: Later, defers: int, what: str) -> float:
        """Seconds until ``later``'s job runs again (and ``later.reason`` says so).

        ``defers`` is how often idemlock already sent this job back for a store failure
        or a held key (not the queue's count of tries, which these never use up): the
        store-failure backoff doubles with it."""
        exc = later.cause
        if isinstance(exc, InFlightError):
            left = self.retry_every
            if exc.expires_at is not None:
                left = exc.expires_at.timestamp() - self.resolved()[0].clock.time()
            # Just past the end of the holder's lease at the latest: the key is then
            # free (a dead holder) or still renewed (a live one: come back again).
            delay = round(min(self.retry_every, max(left, 0.0) + 0.05), 3)
            later.reason = f"{exc}; {what} runs again in {delay}s"
            return delay
        ceiling = min(self.store_retry_max, self.store_retry_backoff * 2.0 ** min(defers, 32))
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

    def call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run a sync job once: the result (run or replayed), its exception, or Later."""
        body = self.resolved()[1]
        with _attempt():
            return body(*args, **kwargs)

    async def acall(self, ctx: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run an async job once (see :meth:`call`)."""
        body = self.resolved()[1]
        cmark = _CTX.set(ctx)
        try:
            with _attempt():
                return await body(*args, **kwargs)
        finally:
            _CTX.reset(cmark)

    # ---- duplicate sends -----------------------------------------------------------

    def send_lock_spec(self, lease: float) -> LockSpec:
        return send_lock_spec(self.spec, lease)

    def key_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return self.plan.key_payload(args, kwargs)[0]

    def reserve_send(self, coord: Coordinator, key: str, owner: str, lease: float) -> bool:
        """:func:`reserve_send` for this job's spec."""
        return reserve_send(coord, self.spec, key, owner, lease)

    def free_send(self, coord: Coordinator, key: str, owner: str, lease: float) -> None:
        """:func:`free_send` for this job's spec."""
        free_send(coord, self.spec, key, owner, lease)

    async def areserve_send(self, coord: Any, key: str, owner: str, lease: float) -> bool:
        """:meth:`reserve_send` on an AsyncCoordinator."""
        status = await coord.idempotency(self.spec).status(key)
        if status is not None and status.state == "in_flight":
            return False
        held = await coord.lock(self.send_lock_spec(lease)).acquire(key, owner=owner)
        return held is not None and bool(held.owner == owner)

    async def afree_send(self, coord: Any, key: str, owner: str, lease: float) -> None:
        """:meth:`free_send` on an AsyncCoordinator."""
        port = coord.lock(self.send_lock_spec(lease))
        try:
            held = await port.acquire(key, owner=owner)
            if held is not None:
                await port.release(held)
        except STORE_ERRORS as exc:
            log.warning(
                "could not release a send lease (%s)",
                exc,
                extra=log_fields(
                    spec=spec_name(self.spec), operation="release", outcome="error", kind="lock"
                ),
            )


_CTX: contextvars.ContextVar[Any] = contextvars.ContextVar("idemlock_job_ctx", default=None)


# ---- duplicate sends, for any queue (Celery's IdempotentTask too) ----------------------

#: the send lease of ``enqueue_once`` when none is given, in seconds
DEFAULT_SEND_LEASE = 600.0


@dataclasses.dataclass(frozen=True)
class JobOptions:
    """What every queue's ``enqueue_once`` takes besides the queue's own send options,
    checked once for all of them: the job's arguments (``args=``, ``kwargs=``: the
    job's own keywords live in their dict, so none can collide with a send option)
    and idemlock's send ``lease`` in seconds."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    lease: float

    @classmethod
    def parse(
        cls,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        lease: timedelta | float | None,
        *,
        call: str,
        default_lease: float = DEFAULT_SEND_LEASE,
    ) -> JobOptions:
        """The options of ``call`` (named in errors), or ConfigurationError."""
        if args is None:
            args = ()
        if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
            raise ConfigurationError(
                f"{call}: args= must be a tuple or list of the job's positional arguments, "
                f"got {described(args)} (for one argument write args=(value,))"
            )
        if kwargs is None:
            kwargs = {}
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise ConfigurationError(
                f"{call}: kwargs= must be a dict of the job's keyword arguments by name, "
                f"got {described(kwargs)}"
            )
        given = default_lease if lease is None else lease
        value = duration(given, f"{call}: lease= (the send lease)", positive=True)
        return cls(tuple(args), dict(kwargs), value)


def guard_of(fn: Any, *, call: str, decorator: str) -> JobGuard:
    """The JobGuard an idemlock decorator put on ``fn``, or ConfigurationError."""
    guard = getattr(fn, "idemlock_guard", None)
    if not isinstance(guard, JobGuard):
        raise ConfigurationError(f"{call} needs a job decorated with {decorator}, got {fn!r}")
    return guard


def legacy_arguments(
    positional: tuple[Any, ...],
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    *,
    old: str,
    new: str,
    call: str,
) -> tuple[Sequence[Any] | None, Mapping[str, Any] | None]:
    """RQ's 0.1 form ``enqueue_once(queue, fn, args, kwargs)``: the (args, kwargs) it
    meant, with a DeprecationWarning that names the new call; ``positional`` empty:
    ``args``/``kwargs`` unchanged."""
    if not positional:
        return args, kwargs
    if len(positional) > 2 or args is not None or (len(positional) == 2 and kwargs is not None):
        raise ConfigurationError(
            f"{call}: pass the job's arguments as args=(...) and kwargs={{...}} only, "
            f"got {len(positional)} more positional argument(s)"
        )
    deprecated(old, new, stacklevel=4)
    args = positional[0]
    if len(positional) == 2:
        kwargs = positional[1]
    return args, kwargs


def deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` goes in a later release; ``stacklevel`` counts from the
    caller of this function (3: the caller of the function that called it)."""
    warnings.warn(
        f"{old} is deprecated and will be removed in idemlock 0.3: call {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def send_lock_spec(spec: IdempotencySpec | str, lease: float) -> LockSpec:
    return LockSpec(f"{spec_name(spec)}.send", ttl=timedelta(seconds=lease))


def reserve_send(
    coord: Coordinator, spec: IdempotencySpec | str, key: str, owner: str, lease: float
) -> bool:
    """Take the send lease of ``key`` for the job ``owner``; False when the key is
    queued (another send holds its lease) or running (its claim is in flight)."""
    status = coord.idempotency(spec).status(key)
    if status is not None and status.state == "in_flight":
        return False
    held = coord.lock(send_lock_spec(spec, lease)).acquire(key, owner=owner)
    return held is not None and held.owner == owner


def free_send(
    coord: Coordinator, spec: IdempotencySpec | str, key: str, owner: str, lease: float
) -> None:
    """Release the send lease ``owner`` took (if it still holds it)."""
    port = coord.lock(send_lock_spec(spec, lease))
    try:
        held = port.acquire(key, owner=owner)
        if held is not None:
            port.release(held)
    except STORE_ERRORS as exc:
        # It ends with its lease: a duplicate is refused until then at worst.
        log.warning(
            "could not release a send lease (%s)",
            exc,
            extra=log_fields(
                spec=spec_name(spec), operation="release", outcome="error", kind="lock"
            ),
        )


@contextmanager
def _attempt() -> Iterator[None]:
    """Around one run of a job's body: a key in flight or a store failure before the
    body started becomes Later (the job comes back); once it started, it propagates."""
    started: list[bool] = []
    mark = _STARTED.set(started)
    try:
        yield
    except (InFlightError, *STORE_ERRORS) as exc:
        if started:
            raise
        raise Later(exc) from exc
    finally:
        _STARTED.reset(mark)


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
