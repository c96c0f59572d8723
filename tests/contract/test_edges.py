"""Input at the edge, on every store, sync and async: durations that are NaN, infinite
or longer than ``MAX_TTL``, and fencing tokens at the ends of their range. Every one
gets a ``ConfigurationError`` (or is handled), never a raw error or a spinning wait."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest

import idemlock
from idemlock import (
    Claimed,
    Completed,
    ConfigurationError,
    FencedOut,
    IdempotencySpec,
    LockSpec,
)

from .facade import Facade

BAD_DURATIONS = [
    pytest.param(math.nan, id="nan"),
    pytest.param(math.inf, id="inf"),
    pytest.param(-math.inf, id="-inf"),
    pytest.param(-1, id="negative"),
    pytest.param(10**400, id="huge-int"),
    pytest.param(timedelta.max, id="timedelta.max"),
    pytest.param(idemlock.MAX_TTL + timedelta(days=1), id="over-MAX_TTL"),
]

MAX_TOKEN = 2**63 - 1


@contextmanager
def case(name: object) -> Iterator[None]:
    """A failure names its case: the cases of one test share its coordinator (a test per
    case would open one per case on every store and face, most of such a test's time)."""
    try:
        yield
    except BaseException as exc:
        exc.add_note(f"(case {name})")
        raise


# ---- item 14: waits on a held key -----------------------------------------------------
# The key is held by someone else, so an unchecked NaN deadline would never be reached
# and the call would spin on the store (the timeout marker turns a spin into a failure).


@pytest.mark.timeout(60)
async def test_acquire_wait_refused_while_held(api: Facade) -> None:
    locks = api.lock(LockSpec("edge", ttl=timedelta(seconds=30)))
    for bad in BAD_DURATIONS:
        with case(bad.id):
            (value,) = bad.values
            key = f"k-{bad.id}"
            held = await locks.acquire(key)
            assert held is not None
            with pytest.raises(ConfigurationError, match="wait"):
                await locks.acquire(key, wait=value)
            with pytest.raises(ConfigurationError, match="wait"):
                async with locks.hold(key, wait=value):
                    pass  # pragma: no cover
            assert await locks.release(held)


@pytest.mark.timeout(60)
async def test_claim_wait_refused_while_in_flight(api: Facade) -> None:
    port = api.idem(IdempotencySpec("edge", lease=timedelta(seconds=30)))
    for bad in BAD_DURATIONS:
        with case(bad.id):
            (value,) = bad.values
            key = f"k-{bad.id}"
            first = await port.claim(key)
            assert isinstance(first, Claimed)
            with pytest.raises(ConfigurationError, match=r"wait|timeout"):
                await port.wait(key, timeout=value)
            with pytest.raises(ConfigurationError, match="wait"):
                api.wrap("edge", lambda x: x, on_in_flight="wait", wait=value)
            await port.abandon(first.token)


async def test_per_call_durations_refused(api: Facade) -> None:
    port = api.idem(IdempotencySpec("edge"))
    for bad in BAD_DURATIONS:
        with case(bad.id):
            (value,) = bad.values
            key = f"k-{bad.id}"
            with pytest.raises(ConfigurationError, match="lease"):
                await port.claim(key, lease=value)
            claim = await port.claim(key)
            assert isinstance(claim, Claimed)
            with pytest.raises(ConfigurationError, match="lease"):
                await port.extend(claim.token, lease=value)
            await port.complete(claim.token, 1)

    locks = api.lock(LockSpec("edge"))
    lease = await locks.acquire("k")
    assert lease is not None
    with pytest.raises(ConfigurationError, match="ttl"):
        await locks.renew(lease, ttl=bad)
    for option in ("renew_every", "max_hold"):
        with pytest.raises(ConfigurationError, match=option):
            async with locks.hold("other", **{option: bad}):
                pass  # pragma: no cover
    assert await locks.release(lease)


# ---- item 15: MAX_TTL ------------------------------------------------------------------


async def test_max_ttl_is_kept_and_replayed(api: Facade) -> None:
    """The longest accepted ttl and lease work on every store (no wrapped expiry, no
    raw error) and a completed record replays."""
    spec = IdempotencySpec("forever", ttl=idemlock.MAX_TTL, lease=idemlock.MAX_TTL)
    port = api.idem(spec)
    claim = await port.claim("k", payload={"a": 1})
    assert isinstance(claim, Claimed)
    await port.complete(claim.token, {"done": True})
    again = await port.claim("k", payload={"a": 1})
    assert isinstance(again, Completed) and again.result == {"done": True}
    assert again.expires_at is not None
    assert again.expires_at.year >= 2100  # not wrapped, not already expired
    status = await port.status("k")
    assert status is not None and status.state == "completed"

    locks = api.lock(LockSpec("forever", ttl=idemlock.MAX_TTL))
    lease = await locks.acquire("k")
    assert lease is not None and lease.expires_at.year >= 2100
    assert await locks.renew(lease, ttl=idemlock.MAX_TTL)
    assert await locks.release(lease)


@pytest.mark.parametrize("what", ["ttl", "lease"])
def test_longer_than_max_ttl_refused_at_the_spec(what: str) -> None:
    too_long = idemlock.MAX_TTL + timedelta(seconds=1)
    with pytest.raises(ConfigurationError, match="maximum of 100 years"):
        IdempotencySpec("s", **{what: too_long})  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="maximum of 100 years"):
        LockSpec("s", ttl=too_long)
    IdempotencySpec("s", **{what: idemlock.MAX_TTL})  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", BAD_DURATIONS)
def test_bad_spec_durations(bad: Any) -> None:
    for build in (
        lambda: IdempotencySpec("s", ttl=bad),
        lambda: IdempotencySpec("s", lease=bad),
        lambda: LockSpec("s", ttl=bad),
    ):
        with pytest.raises(ConfigurationError):
            build()


# ---- item 16: fencing tokens -------------------------------------------------------


async def test_gate_token_range_is_the_same_everywhere(api: Facade) -> None:
    gate = api.fence("edge-range")
    for bad in (2**63, 2**64, 10**30, -1):
        with pytest.raises(ConfigurationError, match="2\\*\\*63"):
            await gate.check_and_advance(bad)
    assert await gate.current() is None  # a refused token changes nothing
    assert await gate.check_and_advance(0) == 0
    assert await gate.check_and_advance(MAX_TOKEN) == MAX_TOKEN
    assert await gate.current() == MAX_TOKEN
    assert await gate.check_and_advance(MAX_TOKEN) == MAX_TOKEN  # equal passes
    with pytest.raises(FencedOut) as info:
        await gate.check_and_advance(MAX_TOKEN - 1)
    assert info.value.current == MAX_TOKEN
    with pytest.raises(ConfigurationError):
        await gate.check_and_advance(2**63)


# ---- audit: keys at the length limit ------------------------------------------------

LONG_KEYS = [
    pytest.param("k" * 512, id="512-ascii"),
    pytest.param("é" * 256, id="512-bytes-2-byte-chars"),
    pytest.param("€" * 170 + "kk", id="512-bytes-3-byte-chars"),
    pytest.param("🔑" * 128, id="512-bytes-4-byte-chars"),
]


async def test_keys_of_512_bytes_work(api: Facade) -> None:
    port = api.idem(IdempotencySpec("edge-long"))
    locks = api.lock(LockSpec("edge-long"))
    for param in LONG_KEYS:
        with case(param.id):
            (key,) = param.values
            assert isinstance(key, str) and len(key.encode("utf-8")) == 512
            claim = await port.claim(key, payload={"k": key})
            assert isinstance(claim, Claimed)
            await port.complete(claim.token, {"k": key})
            again = await port.claim(key, payload={"k": key})
            assert isinstance(again, Completed) and again.result == {"k": key}
            assert (await port.status(key)) is not None
            assert await port.forget(key)

            lease = await locks.acquire(key, owner=key)
            assert lease is not None and lease.key == key and lease.owner == key
            assert await locks.renew(lease)
            assert key in {info.key for info in await api.locks()}
            assert await locks.release(lease)

            gate = api.fence(key)
            assert await gate.check_and_advance(1) == 1


async def test_keys_over_512_bytes_are_refused(api: Facade) -> None:
    port = api.idem(IdempotencySpec("edge-long"))
    for key in ["k" * 513, "é" * 256 + "k", "🔑" * 129]:
        with case(f"{key[0]!r} x {len(key)}"):
            with pytest.raises(idemlock.InvalidKey, match="512"):
                await port.claim(key)
            with pytest.raises(idemlock.InvalidKey, match="512"):
                await api.lock(LockSpec("edge-long")).acquire(key)
            with pytest.raises(idemlock.InvalidKey, match="512"):
                api.fence(key)
