"""A SQLite lock waiter in another process is woken when the lock is reserved for it,
instead of finding out at its next poll.

The waiters here are processes whose polls are pushed past their whole wait (and the
holder's lease outlives it): only a wake-up can hand them the lock while their turn's
window is open, so without wake-ups they time out and the test fails. No timing
asserts: the waits are long, and only who got the lock, in which order, is checked.
"""

from __future__ import annotations

import multiprocessing as mp
import sqlite3
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import idemlock
from idemlock import LockSpec
from idemlock.stores.sqlite import _wake

pytestmark = pytest.mark.skipif(not _wake.SUPPORTED, reason="abstract sockets are Linux's")

SPEC = "L"
WAIT = 15.0  # each waiter's whole wait: far longer than a hand-off


def _waiter(url: str, name: str, out: Any) -> None:
    from idemlock._core import flows
    from idemlock.stores.sqlite import SQLiteStore

    # After the attempt that queues it a second time (so it may be chosen), no poll
    # before the wait ends: every later wait chunk lasts the whole wait.
    flows._backoff = lambda attempt, cap: 0.001 if attempt == 0 else WAIT
    flows.MAX_WAIT_CHUNK = WAIT
    SQLiteStore.poll_cap = WAIT
    coord = idemlock.connect(url)
    locks = coord.lock(SPEC)
    lease = locks.acquire("k", owner=name, wait=WAIT)
    out.put((name, None if lease is None else lease.token))
    if lease is not None:
        locks.release(lease)  # came through the queue: reserves the lock for the next
    coord.close()


def _wait_queued(path: Path, owner: str) -> None:
    """Until ``owner`` is queued (it asked twice, so it may be chosen)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with sqlite3.connect(path) as raw:
            row = raw.execute("SELECT tries FROM lock_waiters WHERE owner = ?", (owner,)).fetchone()
        if row is not None and row[0] > 1:
            return
        time.sleep(0.01)
    raise AssertionError(f"{owner} never queued")


@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_waiters_in_other_processes_are_woken_in_turn(start: str, tmp_path: Path) -> None:
    """Forked waiters too: a child does not answer to its parent's name, it binds its
    own (the parent here listens before forking)."""
    if start == "fork":
        from idemlock.stores.sqlite import _store

        _store._DOORBELL.listen()
    ctx: Any = mp.get_context(start)
    path = tmp_path / "wake.db"
    url = f"sqlite:///{path}"
    coord = idemlock.connect(url)
    locks = coord.lock(LockSpec(SPEC, ttl=timedelta(seconds=120)))  # outlives the waits
    lease = locks.acquire("k")
    assert lease is not None
    out = ctx.Queue()
    procs = []
    for name in ("first", "second"):
        proc = ctx.Process(target=_waiter, args=(url, name, out))
        proc.start()
        procs.append(proc)
        _wait_queued(path, name)
    try:
        assert locks.release(lease)
        # A one-shot try finds the lock reserved for the oldest waiter, and wakes it.
        assert locks.acquire("k") is None
        got = [out.get(timeout=60), out.get(timeout=60)]
    finally:
        for proc in procs:
            proc.join(60)
        coord.close()
    # "first" was woken by the reservation, "second" by first's release.
    assert got == [("first", lease.token + 1), ("second", lease.token + 2)]
    assert [p.exitcode for p in procs] == [0, 0]
