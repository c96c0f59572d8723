"""The coordinator lists what the store cannot read (agreement A3): a foreign or
damaged value under the prefix is one row with state "corrupt" (a lock: ``corrupt``
True), and every other row is still listed; ``keys()``/``locks()`` never fail for
everyone because of one bad value. Real corrupt data in real stores: rows written
behind the store's back into the SQLite file, foreign values SET in Redis."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import redis

import idemlock
import idemlock.aio
from idemlock import Claimed
from idemlock.stores.redis import _common as C

from .servers.redis import RedisServer

HOUR_MS = 3_600_000


async def _listed(coord: Any) -> tuple[dict[str, str], dict[str, bool]]:
    keys, locks = coord.keys(), coord.locks()
    if not isinstance(keys, list):
        keys, locks = await keys, await locks
    return {r.key: r.state for r in keys}, {r.key: r.corrupt for r in locks}


def _open(url: str, mode: str, prefix: str) -> Any:
    connect = idemlock.connect if mode == "sync" else idemlock.aio.connect
    return connect(url, key_prefix=prefix)


async def _close(coord: Any) -> None:
    result = coord.close()
    if result is not None:
        await result


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_sqlite_listing_shows_foreign_rows_as_corrupt(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "list.db"
    url = f"sqlite:///{path}"
    good = idemlock.connect(url, key_prefix="p")
    claim = good.idempotency("orders").claim("fine")
    assert isinstance(claim, Claimed)
    lease = good.lock("jobs").acquire("held")
    assert lease is not None
    ns_claims, ns_locks = good._ns("orders"), good._ns("jobs")
    good.close()
    raw = sqlite3.connect(path, isolation_level=None)
    expires = time.time_ns() // 1_000_000 + HOUR_MS
    raw.execute(
        "INSERT INTO claims (ns, key, state, token, fence, fp, expires_ms, result) "
        "VALUES (?, 'bad', 'exploded', 't', 1, NULL, ?, NULL)",
        (ns_claims, expires),
    )
    raw.execute("INSERT INTO locks VALUES (?, 'bad', 'o', 'not-a-number', ?)", (ns_locks, expires))
    raw.close()
    coord = _open(url, mode, "p")
    try:
        records, locks = await _listed(coord)
    finally:
        await _close(coord)
    assert records == {"fine": "in_flight", "bad": "corrupt"}
    assert locks == {"held": False, "bad": True}


@pytest.mark.parametrize("mode", ["sync", "async"])
async def test_redis_listing_shows_foreign_values_as_corrupt(
    redis_server: RedisServer, mode: str
) -> None:
    prefix = "p" + str(time.monotonic_ns())
    good = idemlock.connect(redis_server.url, key_prefix=prefix)
    assert isinstance(good.idempotency("orders").claim("fine"), Claimed)
    assert good.lock("jobs").acquire("held") is not None
    ns_claims, ns_locks = good._ns("orders"), good._ns("jobs")
    good.close()
    raw = redis.Redis(port=redis_server.port)
    try:
        raw.set(C.names(ns_claims, "bad").claim, b"not a record")
        raw.hset(C.names(ns_locks, "bad").lock, mapping={"o": "x", "t": "abc", "x": "1"})
        coord = _open(redis_server.url, mode, prefix)
        try:
            records, locks = await _listed(coord)
        finally:
            await _close(coord)
    finally:
        raw.close()
    assert records == {"fine": "in_flight", "bad": "corrupt"}
    assert locks == {"held": False, "bad": True}
