"""The memory store's adapter; its baseline is a dict under a threading.Lock."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from typing import Any

from common import (
    BASE,
    LOCK_OP,
    OURS,
    OURS_AIO,
    OURS_PORT,
    SCALE,
    Make,
    Results,
    SyncFn,
    new_prefix,
)

import idemlock
import idemlock.aio
from idemlock import FencedOut
from subjects.base import (
    RESULT_BYTES,
    aio_claim,
    aio_lock,
    new_loop,
    on_loop,
    ours_ajob,
    ours_claim_pairs,
    ours_job,
    ours_lock_pairs,
    port_claim_pairs,
    port_lock_pairs,
)


class MemoryRaw:
    """The floor of an in-process store: a dict under a lock, the same critical sections."""

    def __init__(self) -> None:
        self.mu = threading.Lock()
        self.claims: dict[str, list[Any]] = {}
        self.locks: dict[str, tuple[str, int, float]] = {}
        self.effects: dict[str, tuple[int, str]] = {}
        self.counter = 0

    def claim(self, key: str, token: str) -> int | None:
        now = time.monotonic()
        with self.mu:
            rec = self.claims.get(key)
            if rec is not None and rec[3] > now:
                return None
            self.counter += 1
            self.claims[key] = ["in_flight", token, self.counter, now + 300.0, None]
            return self.counter

    def complete(self, key: str, token: str, result: bytes) -> bool:
        now = time.monotonic()
        with self.mu:
            rec = self.claims.get(key)
            if rec is None or rec[1] != token or rec[0] != "in_flight":
                return False
            rec[0], rec[3], rec[4] = "completed", now + 3600.0, result
            return True

    def acquire(self, key: str, owner: str) -> int | None:
        now = time.monotonic()
        with self.mu:
            cur = self.locks.get(key)
            if cur is not None and cur[2] > now:
                return None
            self.counter += 1
            self.locks[key] = (owner, self.counter, now + 30.0)
            return self.counter

    def release(self, key: str, owner: str, token: int) -> bool:
        with self.mu:
            cur = self.locks.get(key)
            if cur is None or cur[0] != owner or cur[1] != token:
                return False
            del self.locks[key]
            return True

    def fenced_write(self, key: str, fence: int, value: str) -> None:
        with self.mu:
            cur = self.effects.get(key)
            if cur is not None and cur[0] > fence:
                raise FencedOut(key, fence, cur[0])
            self.effects[key] = (fence, value)

    async def afenced_write(self, key: str, fence: int) -> None:
        self.fenced_write(key, fence, "done")

    def claim_pairs(self, count: int, t: int = 0) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key, token = f"{tag}-{t}-{i}", uuid.uuid4().hex
            assert self.claim(key, token) is not None
            assert self.complete(key, token, RESULT_BYTES)

    def lock_pairs(self, count: int, t: int = 0) -> None:
        key = f"k{t}"
        for _ in range(count):
            token = self.acquire(key, "owner")
            assert token is not None
            assert self.release(key, "owner", token)

    def jobs(self, count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key, token = f"{tag}-{i}", uuid.uuid4().hex
            fence = self.claim(key, token)
            assert fence is not None
            self.fenced_write(key, fence, "done")
            assert self.complete(key, token, RESULT_BYTES)

    async def aclaim(self, t: int, count: int) -> None:
        self.claim_pairs(count, t)

    async def alock(self, t: int, count: int) -> None:
        self.lock_pairs(count, t)


class MemoryBench:
    name = "memory"
    scale = SCALE["memory"]
    trips_unit = "in-process"
    kinds = (BASE, OURS)

    def target(self) -> dict[str, Any]:
        return {}

    counting = None

    def sync_fns(
        self, op: str, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        raw = MemoryRaw()
        coord = idemlock.connect("memory://", key_prefix=new_prefix())
        stack.callback(coord.close)
        if op == LOCK_OP:
            return {
                BASE: raw.lock_pairs,
                OURS: ours_lock_pairs(coord),
                OURS_PORT: port_lock_pairs(coord),
            }
        return {
            BASE: raw.claim_pairs,
            OURS: ours_claim_pairs(coord),
            OURS_PORT: port_claim_pairs(coord),
        }

    async def async_fns(
        self, op: str, tasks: int, stack: contextlib.AsyncExitStack, res: Results, where: Any
    ) -> dict[str, Make]:
        raw = MemoryRaw()
        coord = idemlock.aio.connect("memory://", key_prefix=new_prefix())
        stack.push_async_callback(coord.close)
        if op == LOCK_OP:
            return {BASE: raw.alock, OURS: aio_lock(coord)}
        return {BASE: raw.aclaim, OURS: aio_claim(coord)}

    def job_fns(
        self, t: dict[str, Any], stack: contextlib.ExitStack, res: Results
    ) -> dict[str, SyncFn]:
        raw = MemoryRaw()
        coord = idemlock.connect("memory://", key_prefix=new_prefix())
        stack.callback(coord.close)
        loop = new_loop(stack)
        acoord = idemlock.aio.connect("memory://", key_prefix=new_prefix())
        stack.callback(lambda: loop.run_until_complete(acoord.close()))
        effects = MemoryRaw()
        return {
            BASE: raw.jobs,
            OURS: ours_job(coord, lambda key, fence: effects.fenced_write(key, fence, "done")),
            OURS_AIO: on_loop(loop, ours_ajob(acoord, effects.afenced_write)),
        }
