"""The memory store's adapter; its baseline is a dict under a threading.Lock."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from common import JOB_OP, LOCK_OP, RESULT_BYTES, SCALE, Make, SyncFn

from idemlock import FencedOut
from subjects.base import Adapter, Ctx, Raw


class MemoryRaw(Raw):
    """The floor of an in-process store: a dict under a lock, the same critical sections
    (claim: insert; complete: update; acquire: insert; release: delete; fenced write),
    called directly: building requests would cost as much as the work."""

    def __init__(self) -> None:
        self.mu = threading.Lock()
        self.rows: dict[str, list[Any]] = {}  # claims and locks: [owner, fence, expiry, result]
        self.effects: dict[str, tuple[int, str]] = {}
        self.counter = 0

    def take(self, key: str, owner: str, ttl: float) -> int:
        now = time.monotonic()
        with self.mu:
            rec = self.rows.get(key)
            assert rec is None or rec[2] <= now, "taken"
            self.counter += 1
            self.rows[key] = [owner, self.counter, now + ttl, None]
            return self.counter

    def complete(self, key: str, owner: str) -> None:
        now = time.monotonic()
        with self.mu:
            rec = self.rows[key]
            assert rec[0] == owner and rec[3] is None
            rec[2], rec[3] = now + 3600.0, RESULT_BYTES

    def release(self, key: str, owner: str, fence: int) -> None:
        with self.mu:
            rec = self.rows.pop(key)
            assert rec[0] == owner and rec[1] == fence

    def fenced_write(self, key: str, fence: int) -> None:
        with self.mu:
            cur = self.effects.get(key)
            if cur is not None and cur[0] > fence:
                raise FencedOut(key, fence, cur[0])
            self.effects[key] = (fence, "done")

    async def afenced_write(self, key: str, fence: int) -> None:
        self.fenced_write(key, fence)

    def pairs(self, op: str, count: int, t: int = 0) -> None:
        if op == LOCK_OP:
            key = f"k{t}"
            for _ in range(count):
                self.release(key, "owner", self.take(key, "owner", 30.0))
            return
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key, token = f"{tag}-{t}-{i}", uuid.uuid4().hex
            fence = self.take(key, token, 300.0)
            if op == JOB_OP:
                self.fenced_write(key, fence)
            self.complete(key, token)

    def run(self, op: str) -> SyncFn:
        return lambda count: self.pairs(op, count)

    def make(self, op: str) -> Make:
        async def make(t: int, count: int) -> None:
            self.pairs(op, count, t)

        return make


class MemoryBench(Adapter):
    name = "memory"
    scale = SCALE["memory"]

    def url(self, t: dict[str, Any]) -> str:
        return "memory://"

    def raw(self, x: Ctx) -> Raw:
        return MemoryRaw()

    def effect(self, x: Ctx, url: str, aio: bool) -> Any:
        return MemoryRaw().afenced_write if aio else MemoryRaw().fenced_write

    @staticmethod
    def contender(x: Ctx) -> tuple[Any, Any]:
        """Threads of one process: a threading.Lock."""
        mu = threading.Lock()
        return (lambda key: mu.acquire()), (lambda held: mu.release())
