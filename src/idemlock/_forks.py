"""Fork safety (A6), one mechanism.

Celery prefork, gunicorn ``--preload`` and multiprocessing fork a process that already
holds connections, pools, listener threads and gRPC channels. Two rules cover them:

* **A pid check where a process-bound resource is used.** Its owner remembers
  ``os.getpid()`` when it made the resource and, on use, compares (as redis-py's
  ``Connection._checkpid`` does). In another process it drops the inherited resources
  *unclosed* (the parent still uses them: a close could send a goodbye on the parent's
  socket, or free the parent's state) into :data:`INHERITED`, and makes fresh ones,
  under :data:`LOCK` and checking the pid again inside it, so that several threads of
  the child arriving at once change them once.
* **One at-fork hook** (the only ``os.register_at_fork`` of the library) for what must
  be reset before any use: process-wide locks another thread may have held at the
  fork, the token generator's random prefix, and SQLite's gate that keeps fork() out
  of a transaction in progress. Modules add to it with :func:`at_fork`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["INHERITED", "LOCK", "at_fork"]

#: what a child inherited and must neither use nor close nor free (closing a psycopg
#: connection or a gRPC channel there could disturb the parent's): kept referenced
#: for the life of the process
INHERITED: list[Any] = []

#: held while an owner swaps inherited resources for fresh ones; new in every child (a
#: thread of the parent may have held it at the fork), so read it as ``_forks.LOCK``
LOCK = threading.Lock()

_before: list[Callable[[], object]] = []
_in_parent: list[Callable[[], object]] = []
_in_child: list[Callable[[], object]] = []


def at_fork(
    *,
    before: Callable[[], object] | None = None,
    after_in_parent: Callable[[], object] | None = None,
    after_in_child: Callable[[], object] | None = None,
) -> None:
    """Run these around every ``os.fork()`` (as :func:`os.register_at_fork`, whose
    order they keep: ``before`` in reverse order of registration, the others in order).
    Only for process-wide state that must be right before any use; a resource with an
    owner checks the pid where it is used instead."""
    if before is not None:
        _before.append(before)
    if after_in_parent is not None:
        _in_parent.append(after_in_parent)
    if after_in_child is not None:
        _in_child.append(after_in_child)


def _before_fork() -> None:
    for fn in reversed(_before):
        fn()


def _after_in_parent() -> None:
    for fn in _in_parent:
        fn()


def _after_in_child() -> None:
    global LOCK
    LOCK = threading.Lock()
    for fn in _in_child:
        fn()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_in_parent, after_in_child=_after_in_child
    )
