"""Giving back what a cancelled async call took: an async store runs a claim or an
acquire in a task of its own, so a cancellation of its caller never leaves the
outcome unknown, and undoes what it took as soon as it ends (issue 10 item 7)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from .._errors import StoreUnavailable
from .._logfields import fields as log_fields

T = TypeVar("T")

log = logging.getLogger("idemlock")


class Undoer:
    """The undo calls of one async store, kept referenced until they end. ``store`` is
    the store's name in log fields, ``shown`` in messages."""

    def __init__(self, store: str, shown: str) -> None:
        self.store = store
        self.shown = shown
        self._undoing: set[asyncio.Task[Any]] = set()

    async def run(
        self, call: Awaitable[T], undo: Callable[[T | None], Awaitable[Any] | None], what: str
    ) -> T:
        """Await ``call`` in a task of its own (bounded by the store's timeout); if the
        caller is cancelled meanwhile, ``undo(reply)`` (None: no reply) gives back what
        it took once it ends. The caller still sees the CancelledError."""
        task = asyncio.ensure_future(call)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(lambda t: self._after(t, undo, what))
            raise

    def _after(
        self, task: asyncio.Task[T], undo: Callable[[T | None], Awaitable[Any] | None], what: str
    ) -> None:
        if task.cancelled():
            log.warning(
                "idemlock: a cancelled %s %s was itself cancelled (event loop shutting "
                "down?); if it was applied, it frees itself when its lease ends",
                self.shown,
                what,
                extra=log_fields(store=self.store, operation=what, outcome="cancelled"),
            )
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, StoreUnavailable):
            return  # refused: nothing was taken
        # A StoreUnavailable (e.g. a timeout after the request was sent) leaves the
        # outcome unknown: undo what can be undone without the reply (None).
        aw = undo(None if exc is not None else task.result())
        if aw is None:
            return
        undoing = asyncio.ensure_future(aw)
        self._undoing.add(undoing)
        undoing.add_done_callback(self._undone)

    def _undone(self, task: asyncio.Task[Any]) -> None:
        self._undoing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning(
                "idemlock: could not undo a cancelled %s call; what it took frees "
                "itself when its lease ends",
                self.shown,
                exc_info=task.exception(),
                extra=log_fields(store=self.store, operation="undo", outcome="error"),
            )
