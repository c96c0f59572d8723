"""The idempotency contract: claim, complete, abandon, status, forget, fences."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta

import pytest

from idemlock import (
    CanonicalizeError,
    Claimed,
    Completed,
    ConfigurationError,
    IdempotencySpec,
    InFlight,
    InvalidKey,
    PayloadMismatch,
    StaleClaim,
)

from .facade import Facade, each_face
from .harness import Harness

LEASE = 0.4
#: the tests whose subject is not the lease: a lease no stall of a busy machine outlasts
SPEC = IdempotencySpec("orders", ttl=timedelta(seconds=60), lease=timedelta(seconds=30))
#: the tests of a lease running out (``harness.advance`` past it)
SHORT = IdempotencySpec("orders", ttl=timedelta(seconds=60), lease=timedelta(seconds=LEASE))
#: extend's test: the first lease must outlast the calls up to the extend
EXTEND_LEASE = 1.0
EXTEND = IdempotencySpec("orders", ttl=timedelta(seconds=60), lease=timedelta(seconds=EXTEND_LEASE))


async def test_first_claim_is_claimed_then_in_flight(api: Facade) -> None:
    port = api.idem(SPEC)
    first = await port.claim("k1", payload={"amount": 10})
    assert isinstance(first, Claimed)
    assert first.token.key == "k1" and first.token.fence > 0
    assert isinstance(first.token.expires_at, datetime)
    second = await port.claim("k1", payload={"amount": 10})
    assert isinstance(second, InFlight)
    assert second.expires_at == first.token.expires_at


async def test_complete_then_replay(api: Facade) -> None:
    port = api.idem(SPEC)
    claim = await port.claim("k", payload={"a": 1})
    assert isinstance(claim, Claimed)
    await port.complete(claim.token, {"charge": "ch_1", "items": [1, 2]})
    replay = await port.claim("k", payload={"a": 1})
    assert isinstance(replay, Completed)
    assert replay.result == {"charge": "ch_1", "items": [1, 2]}
    assert replay.expires_at is not None


@contextmanager
def case(name: object) -> Iterator[None]:
    """A failure names its case: the cases of one test share its coordinator (a test per
    case would open one per case on every store and face, most of such a test's time)."""
    try:
        yield
    except BaseException as exc:
        exc.add_note(f"(case {name!r})")
        raise


async def test_every_result_is_recorded_and_replayed(api: Facade) -> None:
    port = api.idem(SPEC)
    for i, result in enumerate([None, 0, False, "", [], {}, 0.5, "héllo ✓", [None]]):
        with case(result):
            claim = await port.claim(f"falsy-{i}")
            assert isinstance(claim, Claimed)
            await port.complete(claim.token, result)
            replay = await port.claim(f"falsy-{i}")
            assert isinstance(replay, Completed)
            assert replay.result == result
            assert type(replay.result) is type(result)


async def test_payload_mismatch_on_completed_and_in_flight(api: Facade) -> None:
    port = api.idem(SPEC)
    claim = await port.claim("k", payload={"a": 1})
    assert isinstance(claim, Claimed)
    with pytest.raises(PayloadMismatch):
        await port.claim("k", payload={"a": 2})
    await port.complete(claim.token, "done")
    with pytest.raises(PayloadMismatch) as info:
        await port.claim("k", payload={"a": 2})
    assert "different payload" in str(info.value)
    with pytest.raises(PayloadMismatch):
        await port.claim("k")  # no payload is a different payload too
    replay = await port.claim("k", payload={"a": 1})
    assert isinstance(replay, Completed) and replay.result == "done"


async def test_payload_is_canonical(api: Facade) -> None:
    port = api.idem(SPEC)
    claim = await port.claim("k", payload={"b": [1, 2], "a": {"y": 1, "x": 2}})
    assert isinstance(claim, Claimed)
    await port.complete(claim.token, 1)
    # Same content, other key order and a tuple for the list: the same payload.
    replay = await port.claim("k", payload={"a": {"x": 2, "y": 1}, "b": (1, 2)})
    assert isinstance(replay, Completed)


async def test_bad_payload_is_refused_before_anything_is_stored(api: Facade) -> None:
    port = api.idem(SPEC)
    for bad in ({"x": float("nan")}, {"x": float("inf")}, {"x": object()}, {1: "int key"}):
        with pytest.raises(CanonicalizeError):
            await port.claim("k", payload=bad)
    assert await port.status("k") is None


async def _expired_claim_is_reclaimable_with_higher_fence(api: Facade) -> None:
    port = api.idem(SHORT)
    first = await port.claim("k")
    assert isinstance(first, Claimed)
    api.harness.advance(LEASE + 0.15)
    second = await port.claim("k")
    assert isinstance(second, Claimed)
    assert second.token.fence > first.token.fence
    assert second.token.token != first.token.token
    # The old token is stale: it can neither complete nor abandon, and changes nothing.
    with pytest.raises(StaleClaim):
        await port.complete(first.token, "late")
    with pytest.raises(StaleClaim):
        await port.abandon(first.token)
    status = await port.status("k")
    assert status is not None and status.state == "in_flight"
    assert status.fence == second.token.fence
    await port.complete(second.token, "fresh")
    replay = await port.claim("k")
    assert isinstance(replay, Completed) and replay.result == "fresh"


async def test_expired_claim_is_reclaimable_with_higher_fence(harness: Harness) -> None:
    await each_face(harness, _expired_claim_is_reclaimable_with_higher_fence)


async def _expired_claim_with_other_payload_is_reclaimable(api: Facade) -> None:
    port = api.idem(SHORT)
    assert isinstance(await port.claim("k", payload={"v": 1}), Claimed)
    api.harness.advance(LEASE + 0.15)
    assert isinstance(await port.claim("k", payload={"v": 2}), Claimed)


async def test_expired_claim_with_other_payload_is_reclaimable(harness: Harness) -> None:
    await each_face(harness, _expired_claim_with_other_payload_is_reclaimable)


async def test_abandon_frees_the_key_and_keeps_the_fence_rising(api: Facade) -> None:
    port = api.idem(SPEC)
    first = await port.claim("k")
    assert isinstance(first, Claimed)
    await port.abandon(first.token)
    assert await port.status("k") is None
    second = await port.claim("k")
    assert isinstance(second, Claimed)
    assert second.token.fence > first.token.fence
    with pytest.raises(StaleClaim):
        await port.abandon(first.token)


async def test_complete_twice_is_stale(api: Facade) -> None:
    port = api.idem(SPEC)
    claim = await port.claim("k")
    assert isinstance(claim, Claimed)
    await port.complete(claim.token, 1)
    with pytest.raises(StaleClaim):
        await port.complete(claim.token, 2)
    with pytest.raises(StaleClaim):
        await port.abandon(claim.token)
    replay = await port.claim("k")
    assert isinstance(replay, Completed) and replay.result == 1


async def _completed_record_expires_after_ttl(api: Facade) -> None:
    # The ttl outlasts the calls up to the replay check, on a busy machine too.
    spec = IdempotencySpec("short", ttl=timedelta(seconds=1), lease=timedelta(seconds=5))
    port = api.idem(spec)
    claim = await port.claim("k")
    assert isinstance(claim, Claimed)
    await port.complete(claim.token, "r")
    assert isinstance(await port.claim("k"), Completed)
    api.harness.advance(1.15)
    again = await port.claim("k")
    assert isinstance(again, Claimed)
    assert again.token.fence > claim.token.fence


async def test_completed_record_expires_after_ttl(harness: Harness) -> None:
    await each_face(harness, _completed_record_expires_after_ttl)


async def test_status_and_forget(api: Facade) -> None:
    port = api.idem(SPEC)
    assert await port.status("k") is None
    claim = await port.claim("k")
    assert isinstance(claim, Claimed)
    st = await port.status("k")
    assert st is not None
    assert (st.key, st.state, st.fence) == ("k", "in_flight", claim.token.fence)
    assert st.expires_at == claim.token.expires_at
    await port.complete(claim.token, "x")
    st = await port.status("k")
    assert st is not None and st.state == "completed"
    assert st.expires_at > claim.token.expires_at
    assert await port.forget("k") is True
    assert await port.status("k") is None
    assert await port.forget("k") is False
    again = await port.claim("k")
    assert isinstance(again, Claimed) and again.token.fence > claim.token.fence


async def test_specs_and_prefixes_are_separate_namespaces(api: Facade) -> None:
    a = api.idem(IdempotencySpec("a", lease=timedelta(seconds=30)))
    b = api.idem(IdempotencySpec("b", lease=timedelta(seconds=30)))
    ca = await a.claim("same")
    assert isinstance(ca, Claimed)
    assert isinstance(await b.claim("same"), Claimed)
    await a.complete(ca.token, "from a")
    # A token of spec a cannot be used on spec b.
    with pytest.raises(ConfigurationError):
        await b.complete(ca.token, "x")


async def test_key_prefix_isolates_coordinators(api: Facade) -> None:
    port = api.idem(SPEC)
    claim = await port.claim("k")
    assert isinstance(claim, Claimed)
    await port.complete(claim.token, "mine")
    if api.mode == "sync":
        other_coord = api.harness.open_sync(api.harness.prefix + "x")
    else:
        other_coord = api.harness.open_async(api.harness.prefix + "x")
    other = Facade(api.harness, other_coord, api.mode)
    try:
        assert isinstance(await other.idem(SPEC).claim("k"), Claimed)
    finally:
        await other.close()


async def test_two_clients_share_records(api: Facade) -> None:
    other = api.other()
    try:
        port = api.idem(SPEC)
        claim = await port.claim("shared")
        assert isinstance(claim, Claimed)
        assert isinstance(await other.idem(SPEC).claim("shared"), InFlight)
        await port.complete(claim.token, [1])
        replay = await other.idem(SPEC).claim("shared")
        assert isinstance(replay, Completed) and replay.result == [1]
    finally:
        await other.close()


async def test_invalid_keys_are_refused(api: Facade) -> None:
    port = api.idem(SPEC)
    for key in ["", "a b", "tab\there", "new\nline", "nul\x00", "x" * 513, "é" * 300]:
        with case(key):
            with pytest.raises(InvalidKey):
                await port.claim(key)
            with pytest.raises(InvalidKey):
                await port.status(key)


async def test_key_of_512_bytes_and_special_characters(api: Facade) -> None:
    port = api.idem(SPEC)
    keys = ["x" * 512, "a:b", "a%3Ab", "{tag}", "}{", "ünï©ødé", "a/b?c=d&e#f", "*", "[x]"]
    claims = {}
    for key in keys:
        claim = await port.claim(key)
        assert isinstance(claim, Claimed), key
        claims[key] = claim
    for key in keys:
        await port.complete(claims[key].token, key)
    for key in keys:
        replay = await port.claim(key)
        assert isinstance(replay, Completed) and replay.result == key


def test_spec_validation() -> None:
    with pytest.raises(ConfigurationError):
        IdempotencySpec("x", ttl=timedelta(0))
    with pytest.raises(ConfigurationError):
        IdempotencySpec("x", lease=timedelta(seconds=-1))
    with pytest.raises(InvalidKey):
        IdempotencySpec("has space")


async def test_encrypt_result_without_keyring_fails_at_wiring(api: Facade) -> None:
    with pytest.raises(ConfigurationError) as info:
        api.idem(IdempotencySpec("sealed", encrypt_result=True))
    assert "keyring" in str(info.value)


async def test_listing_keys(api: Facade) -> None:
    port = api.idem(SPEC)
    c1 = await port.claim("one")
    c2 = await port.claim("two")
    assert isinstance(c1, Claimed) and isinstance(c2, Claimed)
    await port.complete(c2.token, 2)
    rows = {(r.spec, r.key): r for r in await api.keys()}
    assert rows[("orders", "one")].state == "in_flight"
    assert rows[("orders", "two")].state == "completed"
    assert len(rows) == 2


async def test_wait_returns_the_result_of_the_running_attempt(api: Facade) -> None:
    import asyncio

    port = api.idem(SPEC)
    other = api.other()
    try:
        claim = await other.idem(SPEC).claim("w")
        assert isinstance(claim, Claimed)

        async def finish() -> None:
            await asyncio.sleep(0.05)
            await other.idem(SPEC).complete(claim.token, "done by other")

        if api.mode == "sync":
            # A blocking wait needs the completer on another thread.
            import threading

            done = other.coord.idempotency(SPEC).complete
            t = threading.Timer(0.05, done, args=(claim.token, "done by other"))
            t.start()
            got = await port.wait("w", timeout=5)
            t.join(timeout=60)
            assert not t.is_alive(), "still running after 60 s"
        else:
            task = asyncio.ensure_future(finish())
            got = await port.wait("w", timeout=5)
            await task
        assert isinstance(got, Completed) and got.result == "done by other"
    finally:
        await other.close()


async def _extend_keeps_a_long_claim_alive(api: Facade) -> None:
    port = api.idem(EXTEND)
    claim = await port.claim("long-job")
    assert isinstance(claim, Claimed)
    extended = await port.extend(claim.token, lease=60)
    assert extended.fence == claim.token.fence and extended.token == claim.token.token
    assert extended.expires_at > claim.token.expires_at
    api.harness.advance(EXTEND_LEASE + 0.15)  # past the first lease: still ours
    assert isinstance(await port.claim("long-job"), InFlight)
    await port.complete(extended, "done")
    replay = await port.claim("long-job")
    assert isinstance(replay, Completed) and replay.result == "done"


async def test_extend_keeps_a_long_claim_alive(harness: Harness) -> None:
    await each_face(harness, _extend_keeps_a_long_claim_alive)


async def _extend_never_revives_an_expired_claim(api: Facade) -> None:
    port = api.idem(SHORT)
    claim = await port.claim("late")
    assert isinstance(claim, Claimed)
    api.harness.advance(LEASE + 0.15)
    with pytest.raises(StaleClaim):
        await port.extend(claim.token)
    assert await port.status("late") is None


async def test_extend_never_revives_an_expired_claim(harness: Harness) -> None:
    await each_face(harness, _extend_never_revives_an_expired_claim)
