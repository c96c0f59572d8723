"""Races with real threads, asyncio tasks and processes: one winner, never two."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import idemlock
import idemlock.aio
from idemlock import Claimed, Completed, IdempotencySpec, InFlight, LockSpec

from .harness import Harness

SPEC = IdempotencySpec("race", lease=timedelta(seconds=30))
LOCK = LockSpec("race", ttl=timedelta(seconds=30))


def test_threads_claim_one_key(harness: Harness) -> None:
    coords = [harness.sync() for _ in range(8)]
    barrier = threading.Barrier(len(coords))
    outcomes: dict[str, list[str]] = {f"k{i}": [] for i in range(10)}

    def worker(coord: idemlock.Coordinator) -> None:
        port = coord.idempotency(SPEC)
        for key in outcomes:
            barrier.wait(timeout=60)
            outcomes[key].append(port.claim(key).kind)

    threads = [threading.Thread(target=worker, args=(c,)) for c in coords]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "still running after 60 s"
    for c in coords:
        c.close()
    for key, kinds in outcomes.items():
        assert kinds.count("claimed") == 1, (key, kinds)
        assert kinds.count("in_flight") == len(coords) - 1


async def test_tasks_claim_one_key(harness: Harness) -> None:
    coord = harness.aio()
    other = harness.aio()
    try:
        ports = [coord.idempotency(SPEC), other.idempotency(SPEC)]
        for i in range(5):
            results = await asyncio.gather(
                *(ports[n % 2].claim(f"t{i}", payload={"i": i}) for n in range(40))
            )
            assert sum(isinstance(r, Claimed) for r in results) == 1
            assert sum(isinstance(r, InFlight) for r in results) == 39
    finally:
        await coord.close()
        await other.close()


def test_threads_mutual_exclusion_and_rising_tokens(harness: Harness) -> None:
    inside = 0
    worst = 0
    tokens: list[int] = []
    guard = threading.Lock()

    def worker() -> None:
        nonlocal inside, worst
        coord = harness.sync()
        locks = coord.lock(LOCK)
        for _ in range(10):
            lease = locks.acquire("shared", wait=30)
            assert lease is not None and lease.token is not None
            with guard:
                inside += 1
                worst = max(worst, inside)
                tokens.append(lease.token)
            time.sleep(0.001)
            with guard:
                inside -= 1
            assert locks.release(lease)
        coord.close()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "still running after 60 s"
    assert worst == 1
    assert len(tokens) == 40
    assert tokens == sorted(tokens) and len(set(tokens)) == 40


# ---- processes (stores that outlive a process) ----------------------------------


def _processes() -> Any:
    """Fresh processes, forked from a forkserver that has idemlock and this module
    imported already: each worker is still a process of its own with its own
    connections (not a fork of the test's threads), without paying a new interpreter's
    start-up and imports each time, as "spawn" did (seconds a test on a loaded machine)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["idemlock", "idemlock.aio", __name__])
    return ctx


def _claim_worker(url: str, prefix: str, keys: list[str], start: Any, out: Any) -> None:
    coord = idemlock.connect(url, key_prefix=prefix)
    port = coord.idempotency(SPEC)
    assert start.wait(60), "never told to start"
    kinds = []
    for key in keys:
        claim = port.claim(key, payload={"k": key})
        if isinstance(claim, Claimed):
            port.complete(claim.token, os.getpid())
        kinds.append((key, claim.kind, os.getpid()))
    coord.close()
    out.put(kinds)


def test_processes_claim_one_key(process_harness: Harness) -> None:
    h = process_harness
    assert h.url is not None
    ctx = _processes()
    keys = [f"p{i}" for i in range(30)]
    start, out = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=_claim_worker, args=(h.url, h.prefix, keys, start, out))
        for _ in range(4)
    ]
    for p in procs:
        p.start()
    start.set()
    results = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    winners: dict[str, list[int]] = {k: [] for k in keys}
    for rows in results:
        for key, kind, pid in rows:
            if kind == "claimed":
                winners[key].append(pid)
    assert all(len(w) == 1 for w in winners.values()), winners
    # Everyone who came later saw the winner's result.
    coord = h.sync()
    port = coord.idempotency(SPEC)
    for key, (pid,) in winners.items():
        replay = port.claim(key, payload={"k": key})
        assert isinstance(replay, Completed) and replay.result == pid
    coord.close()


def _lock_worker(url: str, prefix: str, log: str, rounds: int, start: Any) -> None:
    coord = idemlock.connect(url, key_prefix=prefix)
    locks = coord.lock(LOCK)
    assert start.wait(60), "never told to start"
    for _ in range(rounds):
        lease = locks.acquire("shared", wait=60)
        assert lease is not None
        fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.write(fd, f"enter {os.getpid()} {lease.token}\n".encode())
        time.sleep(0.002)
        os.write(fd, f"exit {os.getpid()} {lease.token}\n".encode())
        os.close(fd)
        assert locks.release(lease)
    coord.close()


def test_processes_mutual_exclusion(process_harness: Harness, tmp_path: Path) -> None:
    h = process_harness
    assert h.url is not None
    log = tmp_path / "cs.log"
    ctx = _processes()
    start = ctx.Event()
    procs = [
        ctx.Process(target=_lock_worker, args=(h.url, h.prefix, str(log), 8, start))
        for _ in range(3)
    ]
    for p in procs:
        p.start()
    start.set()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    lines = log.read_text().splitlines()
    assert len(lines) == 2 * 3 * 8
    tokens = []
    for enter, leave in zip(lines[::2], lines[1::2], strict=True):
        e_kind, e_pid, e_tok = enter.split()
        l_kind, l_pid, l_tok = leave.split()
        # Every critical section is entered and left by one process before the next.
        assert (e_kind, l_kind) == ("enter", "exit")
        assert (e_pid, e_tok) == (l_pid, l_tok)
        tokens.append(int(e_tok))
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens)
