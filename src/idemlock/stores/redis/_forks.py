"""The Redis stores (blocking and asyncio) a forked child must have forget what it
inherited from its parent: the parent's sockets, listener threads and event loops."""

from __future__ import annotations

from typing import Protocol

from .._forks import ForkRegistry


class ForkAware(Protocol):
    def _after_fork_in_child(self) -> None: ...


_STORES: ForkRegistry[ForkAware] = ForkRegistry(lambda store: store._after_fork_in_child())


def forget_on_fork(store: ForkAware) -> None:
    """Have ``store._after_fork_in_child()`` run in a forked child (while it lives)."""
    _STORES.add(store)
