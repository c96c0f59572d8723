"""The Redis stores (blocking and asyncio) a forked child must have forget what it
inherited from its parent: the parent's sockets, listener threads and event loops."""

from __future__ import annotations

import os
import weakref
from typing import Protocol


class ForkAware(Protocol):
    def _after_fork_in_child(self) -> None: ...


_STORES: weakref.WeakSet[ForkAware] = weakref.WeakSet()


def forget_on_fork(store: ForkAware) -> None:
    """Have ``store._after_fork_in_child()`` run in a forked child (while it lives)."""
    _STORES.add(store)


def _after_fork_in_child() -> None:
    for store in list(_STORES):
        store._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
