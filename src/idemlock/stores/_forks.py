"""What a forked child must forget of its parent (A6): every store keeps here the
objects (stores, clients, watchers) whose sockets, threads, pools or event loops the
child inherited, and one ``os.register_at_fork`` hook tells each of them in the child.

A store declares one :class:`ForkRegistry` per kind of object, with what the child does
to each; registries run in the order they were made (module import order), so a store
whose hook must run before another's declares that registry first."""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class ForkRegistry(Generic[T]):
    """A weak set of objects; in a forked child ``in_child(obj)`` runs for each one still
    alive. Objects are held weakly: registering keeps nothing from being collected."""

    __slots__ = ("_in_child", "_objects")

    def __init__(self, in_child: Callable[[T], object]) -> None:
        self._in_child = in_child
        self._objects: weakref.WeakSet[T] = weakref.WeakSet()
        _REGISTRIES.append(self)

    def add(self, obj: T) -> None:
        self._objects.add(obj)

    def discard(self, obj: T) -> None:
        self._objects.discard(obj)

    def _after_fork_in_child(self) -> None:
        for obj in list(self._objects):
            self._in_child(obj)


_REGISTRIES: list[ForkRegistry[Any]] = []


def _after_fork_in_child() -> None:
    for registry in _REGISTRIES:
        registry._after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
