"""What becomes of an asyncio Redis call whose caller stopped waiting (cancelled, or
past the store's timeout): its task cancelled, let run to the end, or what it took
given back once it ends, in the background. The policy per call is the plumbing's
(see ``AsyncPlumbing._eval``); this holds the tasks meanwhile and carries it out.

Not :class:`~idemlock.stores._undo.Undoer` (etcd, PostgreSQL): a pipelined call has
no task (its reply comes in through the pipe, see ``undo_reply``), a call's task may
be left to finish or be cancelled rather than undone, a task cancelled by the loop
shutting down is still undone without its reply, and an undo that meets
StoreUnavailable is not logged (what it holds expires with its lease).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import ResponseError

from ..._errors import StoreUnavailable
from ..._logfields import fields as log_fields
from . import _common as C
from ._pipeline import Lost


class Orphans:
    """The calls of one store whose callers stopped waiting, and their undo calls:
    kept referenced until they end, so none is collected mid-way."""

    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def undo_reply(self, undo: Callable[[Any], Any] | None, reply: Any) -> None:
        """The reply (or a :class:`Lost`) of a pipelined claim or acquire whose caller
        stopped waiting: undo what it took."""
        if isinstance(reply, ResponseError):
            return  # refused: nothing was taken
        if undo is not None:
            # A lost connection leaves the outcome unknown: undo without the reply.
            self.undo_now(undo, None if isinstance(reply, Lost) else reply)

    def background(self, aw: Awaitable[Any]) -> None:
        """Run ``aw`` in a task nobody waits for (its failure logged)."""
        try:
            task = asyncio.ensure_future(aw)
        except RuntimeError:  # the loop is closing
            aw.close()  # type: ignore[attr-defined]
            return
        self._tasks.add(task)
        task.add_done_callback(self._undone)

    def abandon_task(
        self,
        task: asyncio.Task[Any],
        undo: Callable[[Any], Any] | None,
        what: str,
        cancel: bool,
    ) -> None:
        """The caller stopped waiting for ``task``: cancel it, let it finish, or undo
        what it did once it ends."""
        if task.done() and undo is None:
            if not task.cancelled():
                task.exception()  # retrieved: a failure nobody waits for is no error
            return
        if cancel:
            task.cancel()
        self._tasks.add(task)
        if undo is not None:
            task.add_done_callback(lambda t: self._undo_after(t, undo, what))
        task.add_done_callback(self._undone)

    def undo_now(self, undo: Callable[[Any], Any], reply: Any) -> None:
        """Start ``undo(reply)`` (a call or nothing) in the background."""
        try:
            aw = undo(reply)
        except Exception:  # the store is closed, the loop is going away
            return
        if aw is not None:
            self.background(aw)

    def _undo_after(self, task: asyncio.Task[Any], undo: Callable[[Any], Any], what: str) -> None:
        if task.cancelled():
            # Cancelled by the deadline (or the loop shutting down): the outcome is
            # unknown; undo what can be undone without the reply.
            reply: Any = None
        else:
            exc = task.exception()
            if exc is not None and not isinstance(exc, StoreUnavailable):
                return  # refused: nothing was taken
            # A StoreUnavailable (a timeout after the script was sent) leaves the
            # outcome unknown too.
            reply = None if exc is not None else task.result()
        self.undo_now(undo, reply)

    def _undone(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None and not isinstance(exc, StoreUnavailable):
            C.log.warning(
                "idemlock: a Redis call its caller stopped waiting for failed; what it "
                "holds frees itself when its lease ends",
                exc_info=exc,
                extra=log_fields(store="redis", operation="undo", outcome="error"),
            )


def retrieved(task: asyncio.Task[Any]) -> None:
    # A failed connect nobody waits for any more (its callers were cancelled) is no
    # error of its own: the next call connects again.
    if not task.cancelled():
        task.exception()
