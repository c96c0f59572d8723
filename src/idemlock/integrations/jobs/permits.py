"""The concurrency limit of a queue's job (``concurrency=N``): a permit of the job's
semaphore (:attr:`JobOptions.permits`) held around its body, after its claim (so a
replayed result needs none), renewed in the background by the coordinator's one
renewer and released when the body ends, whatever ends it.

No permit free within ``concurrency_wait``: :class:`NoPermit` leaves the body before
it started; the claim is abandoned and the job comes back later (``Later``, Celery's
re-send), not counted as a failure or a retry. A permit lost while the body ran (a
worker paused past the permit's lease) does not fail a body that finished: the limit
bounds load, the claim's fence guards the job's writes, so it is logged and the
outcome stands."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, ExitStack, asynccontextmanager, contextmanager
from typing import Any

from ..._core.keys import validate_key
from ..._core.types import SemaphoreSpec
from ..._errors import LockLost, LockNotAcquired
from ..._logfields import fields as log_fields
from .options import ALL_JOBS, JobOptions

log = logging.getLogger("idemlock.jobs")


class NoPermit(BaseException):
    """Raised in the body (before it started) when no permit was free in time: the
    claim is abandoned and the job comes back later. A BaseException, so a job's
    ``replay_errors`` (even ``Exception``) never records it as the job's outcome."""

    def __init__(self, cause: LockNotAcquired) -> None:
        super().__init__(str(cause))
        self.cause = cause


class Permits:
    """The concurrency limit of one job function with one coordinator (sync or async)."""

    def __init__(self, coord: Any, options: JobOptions, what: str) -> None:
        spec = options.permits
        assert spec is not None
        self.spec: SemaphoreSpec = spec
        self.port = coord.semaphore(spec)
        self.options = options
        self.what = what

    def key_of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The concurrency key of a job's arguments (its own, not arq's ctx)."""
        fn: Callable[..., str] | None = self.options.concurrency_key
        if fn is None:
            return ALL_JOBS
        return validate_key(fn(*args, **kwargs), f"{self.what}: concurrency_key's result")

    def _hold_args(self, max_hold: float | None) -> dict[str, Any]:
        o = self.options
        return {"wait": o.concurrency_wait, "renew_every": o.renew_every, "max_hold": max_hold}

    def _no_permit(self, key: str, exc: LockNotAcquired) -> NoPermit:
        limited = LockNotAcquired(
            f"{self.what}: no permit of its concurrency limit ({self.spec.limit} at once "
            f"for key {key!r}) was free within {self.options.concurrency_wait}s"
        )
        limited.__cause__ = exc
        return NoPermit(limited)

    def _lost(self, key: str, exc: LockLost) -> None:
        log.warning(
            "%s: its permit of key %r was lost while it ran (%s); the limit of %d at once "
            "may have been passed meanwhile, the job's outcome stands",
            self.what,
            key,
            exc,
            self.spec.limit,
            extra=log_fields(spec=self.spec.name, operation="renew", outcome="lost"),
        )

    @contextmanager
    def held(self, key: str, max_hold: float | None) -> Iterator[None]:
        """Hold a permit of ``key`` for a block (sync), or raise :class:`NoPermit`."""
        finished = False
        try:
            with ExitStack() as stack:
                try:
                    stack.enter_context(self.port.hold(key, **self._hold_args(max_hold)))
                except LockNotAcquired as exc:
                    raise self._no_permit(key, exc) from None
                yield
                finished = True
        except LockLost as exc:
            if not finished:
                raise
            self._lost(key, exc)

    @asynccontextmanager
    async def aheld(self, key: str, max_hold: float | None) -> AsyncIterator[None]:
        """Hold a permit of ``key`` for an ``async with`` block, or raise
        :class:`NoPermit`. A lost permit does not cancel the body (see the module)."""
        finished = False
        try:
            async with AsyncExitStack() as stack:
                try:
                    await stack.enter_async_context(
                        self.port.hold(key, cancel_on_lost=False, **self._hold_args(max_hold))
                    )
                except LockNotAcquired as exc:
                    raise self._no_permit(key, exc) from None
                yield
                finished = True
        except LockLost as exc:
            if not finished:
                raise
            self._lost(key, exc)
