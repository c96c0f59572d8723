"""The memory store's adapter; its baseline is a dict under a threading.Lock."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from common import LOCK_OP, RESULT_BYTES, SCALE, Make, SyncFn

from idemlock import FencedOut
from subjects.base import Adapter


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


class MemoryBench(Adapter):
    name = "memory"
    scale = SCALE["memory"]

    def url(self, t: dict[str, Any]) -> str:
        return "memory://"

    def raw_pairs(self, op: str, t: dict[str, Any], stack: contextlib.ExitStack) -> SyncFn:
        raw = MemoryRaw()
        return raw.lock_pairs if op == LOCK_OP else raw.claim_pairs

    async def araw_pairs(self, op: str, tasks: int, stack: contextlib.AsyncExitStack) -> Make:
        raw = MemoryRaw()
        return raw.alock if op == LOCK_OP else raw.aclaim

    def raw_job(self, t: dict[str, Any], stack: contextlib.ExitStack) -> SyncFn:
        return MemoryRaw().jobs

    def write(self, url: str, stack: contextlib.ExitStack) -> Callable[[str, int], Any]:
        effects = MemoryRaw()
        return lambda key, fence: effects.fenced_write(key, fence, "done")

    def awrite(self, url: str, stack: Any, loop: Any) -> Callable[[str, int], Awaitable[Any]]:
        return MemoryRaw().afenced_write
