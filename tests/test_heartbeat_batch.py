"""The batched renewal of a coordinator's renewer (issue 11): ``renew_many`` renews many
claims and leases in one round trip (memory: one critical section; SQLite: one
transaction; Redis: one pipeline; PostgreSQL: one statement), refuses what the caller no
longer holds, and the renewer uses it, sync and async."""

from __future__ import annotations

import asyncio
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import idemlock
import idemlock.aio
from idemlock import Claimed, IdempotencySpec, LockSpec

from .servers.redis import RedisServer

SPEC = IdempotencySpec("batch", lease=timedelta(seconds=30))


@pytest.fixture(params=["memory", "sqlite", "redis", "postgres"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "memory":
        return "memory://"
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'b.db'}"
    if request.param == "postgres":
        return str(request.getfixturevalue("postgres_dsn"))
    server: RedisServer = request.getfixturevalue("redis_server")
    return str(server.url)


def test_renew_many_renews_claims_and_leases_and_refuses_the_rest(url: str) -> None:
    coord = idemlock.connect(url, key_prefix="b" + str(time.monotonic_ns()))
    try:
        store: Any = coord.store
        port = coord.idempotency(SPEC)
        claims = [port.claim(f"k{i}", payload={}) for i in range(5)]
        assert all(isinstance(c, Claimed) for c in claims)
        lease = coord.lock(LockSpec("batch-lock", ttl=timedelta(seconds=30))).acquire("l")
        assert lease is not None and lease.token is not None
        gone = claims[4]
        assert isinstance(gone, Claimed)
        port.abandon(gone.token)
        items: list[tuple[Any, ...]] = [
            ("claim", port._ns, c.token._skey, c.token.token, 60_000)
            for c in claims
            if isinstance(c, Claimed)
        ]
        items.append(("lock", lease._ns, "l", lease.owner, lease.token, 60_000))
        items.append(("lock", lease._ns, "l", "someone-else", lease.token, 60_000))
        replies = store.renew_many(items)
        assert len(replies) == len(items)
        first = claims[0]
        assert isinstance(first, Claimed)
        for reply in replies[:4] + replies[5:6]:
            # Renewed to about a minute from now (the store's clock).
            assert reply is not None and reply > first.token.expires_at.timestamp() * 1000 + 20_000
        assert replies[4] is None  # abandoned: not ours any more
        assert replies[6] is None  # another owner's renewal is refused
        status = port.status("k0")
        assert status is not None and status.expires_at > first.token.expires_at
    finally:
        coord.close()


def test_renew_many_after_script_flush(redis_server: RedisServer) -> None:
    coord = idemlock.connect(redis_server.url, key_prefix="flush" + str(time.monotonic_ns()))
    try:
        port = coord.idempotency(SPEC)
        claim = port.claim("k", payload={})
        assert isinstance(claim, Claimed)
        client: Any = redis_server.client()
        with client:
            client.script_flush()
        item = ("claim", port._ns, claim.token._skey, claim.token.token, 60_000)
        (reply,) = coord.store.renew_many([item])  # type: ignore[attr-defined]
        assert reply is not None
    finally:
        coord.close()


def test_the_renewer_batches_many_claims(url: str) -> None:
    """100 live claims renewed for a while: the renewer makes a handful of round
    trips per renewal interval, not one per claim."""
    # 1.5 s: a renewal may take most of a second on a loaded CI machine; 0.9 s left
    # too little margin (one renewal interval is a third of the lease)
    short = IdempotencySpec("batch-short", lease=timedelta(seconds=1.5))
    coord = idemlock.connect(url, key_prefix="r" + str(time.monotonic_ns()))
    try:
        port = coord.idempotency(short)
        blocks = [port.run(f"k{i}", payload={}) for i in range(100)]
        attempts = [b.__enter__() for b in blocks]
        time.sleep(2.5)  # ~5 renewal intervals, past the lease
        trips = coord._renewer.round_trips
        for attempt in attempts:
            assert not attempt.lost
        # Leave in reverse order, as nested ``with`` blocks do: each exit restores the
        # current_claim() its enter replaced, so FIFO exits would leave k98 set.
        for b in reversed(blocks):
            b.__exit__(None, None, None)
        # Every claim outlived its lease, so each was renewed at least once: a renewer
        # that does not batch needs at least 100 round trips. Ideally one batch per
        # interval; a loaded machine spreads the claims over more gather windows.
        assert 0 < trips < len(blocks), trips
        other = coord.idempotency(short)
        assert all(other.status(f"k{i}").state == "completed" for i in range(100))  # type: ignore[union-attr]
    finally:
        coord.close()


def test_the_async_renewer_batches_many_claims(url: str) -> None:
    # 1.5 s: a renewal may take most of a second on a loaded CI machine; 0.9 s left
    # too little margin (one renewal interval is a third of the lease)
    short = IdempotencySpec("batch-short", lease=timedelta(seconds=1.5))

    async def main() -> None:
        coord = idemlock.aio.connect(url, key_prefix="a" + str(time.monotonic_ns()))
        try:
            port = coord.idempotency(short)

            async def one(i: int) -> None:
                async with port.run(f"k{i}", payload={}) as attempt:
                    await asyncio.sleep(2.5)  # ~5 renewal intervals
                    assert not attempt.lost
                    attempt.result = i

            await asyncio.gather(*(one(i) for i in range(100)))
            # Each claim outlived its lease (renewed at least once): unbatched renewals
            # take at least 100 round trips (see the sync test).
            assert 0 < coord._renewer.round_trips < 100, coord._renewer.round_trips
        finally:
            await coord.close()

    asyncio.run(main())
