"""One contender of the contention scenario, per store and subject: its acquire and
release (idemlock, the raw baselines, the peers)."""

from __future__ import annotations

import hashlib
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
from common import BASE, LOCK, OURS, PRL, RPY, new_prefix

import idemlock
import idemlock.aio
from subjects.redis import UNLOCK_LUA, redis_client
from subjects.sqlite import SQ_DELETE_LOCK, SQ_INSERT_LOCK, SQ_NS, sq_open_raw


def _lock_id(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big", signed=True)


def lock_pair(
    store: str, kind: str, t: dict[str, Any]
) -> tuple[Callable[[str], Any], Callable[[Any], Any], Callable[[], Any]]:
    """(acquire(key) -> handle, release(handle), close) of one contender."""
    prefix = t["prefix"]
    if (store, kind) == ("memory", BASE):  # threads of one process: a threading.Lock
        mu = threading.Lock()
        return (lambda key: mu.acquire()), (lambda held: mu.release()), (lambda: None)
    if kind == OURS:
        coord = idemlock.connect(t["url"], key_prefix=prefix or new_prefix())
        locks = coord.lock(LOCK)

        def acquire(key: str) -> Any:
            lease = locks.acquire(key, wait=30)
            if lease is None:
                raise RuntimeError("idemlock: no lease within 30 s")
            return lease

        return acquire, locks.release, coord.close
    if store == "sqlite":
        cur = sq_open_raw(t["path"])
        owner = uuid.uuid4().hex

        def acquire_row(key: str) -> Any:
            while True:
                try:
                    now = time.time_ns() // 1_000_000
                    cur.execute(SQ_INSERT_LOCK, (SQ_NS, key, owner, 0, now + 30_000))
                    return key
                except sqlite3.IntegrityError:
                    time.sleep(0.001)

        def release_row(key: str) -> None:
            cur.execute(SQ_DELETE_LOCK, (SQ_NS, key))

        return acquire_row, release_row, cur.connection.close
    if store == "postgres":
        conn = psycopg.connect(t["dsn"], autocommit=True)

        def acquire_adv(key: str) -> Any:
            conn.execute("SELECT pg_advisory_lock(%s)", (_lock_id(prefix + key),))
            return key

        def release_adv(key: str) -> None:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_lock_id(prefix + key),))

        return acquire_adv, release_adv, conn.close
    r = redis_client(t)
    cluster = t["cluster"]
    if kind == BASE:
        unlock = r.register_script(UNLOCK_LUA)

        def acquire_nx(key: str) -> Any:
            name, token = f"{prefix}:raw:{key}", uuid.uuid4().hex
            while not r.set(name, token, nx=True, px=30_000):
                time.sleep(0.001)
            return name, token

        def release_nx(h: Any) -> None:
            unlock(keys=[h[0]], args=[h[1]])

        return acquire_nx, release_nx, r.close
    if kind == RPY:

        def acquire_rpy(key: str) -> Any:
            lock = r.lock(f"{prefix}:{key}", timeout=30)
            assert lock.acquire(blocking=True, blocking_timeout=30)
            return lock

        return acquire_rpy, lambda lock: lock.release(), r.close
    if kind == PRL:
        import redis_lock

        def acquire_prl(key: str) -> Any:
            name = "{" + f"{prefix}:{key}" + "}" if cluster else f"{prefix}:{key}"
            lock = redis_lock.Lock(r, name, expire=30, strict=not cluster)
            assert lock.acquire(blocking=True, timeout=30)
            return lock

        return acquire_prl, lambda lock: lock.release(), r.close
    import fencekit

    dl = fencekit.DistributedLock(r, prefix="{" + prefix + "}" if cluster else prefix)

    def acquire_fk(key: str) -> Any:
        return dl.acquire(key, ttl=timedelta(seconds=30), blocking=True,
                          wait=timedelta(seconds=30))  # fmt: skip

    return acquire_fk, dl.release, r.close
