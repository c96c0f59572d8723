"""Stored results on every store: typed round trips, recorded errors, limits, corrupt
records, sealing with rotation, and tenant isolation."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta, timezone
from decimal import Decimal
from typing import Any

import msgspec
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import idemlock
from idemlock import (
    Claimed,
    Completed,
    ConfigurationError,
    IdempotencySpec,
    Keyring,
    LockSpec,
    ResultDecodeError,
    ResultEncodeError,
    ResultTooLarge,
    SealError,
)

from .facade import Facade
from .harness import Harness

SPEC = IdempotencySpec("results", lease=timedelta(seconds=30))
SEALED = IdempotencySpec("sealed", lease=timedelta(seconds=30), encrypt_result=True)


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Line:
    sku: str
    qty: int
    price: Decimal


@dataclass
class Receipt:
    id: uuid.UUID
    at: datetime
    day: date
    lines: list[Line]
    tags: frozenset[str]
    colour: Colour
    blob: bytes
    pair: tuple[int, str]
    note: str | None = None
    extra: dict[str, float] = field(default_factory=dict)


class Model(pydantic.BaseModel):
    name: str
    when: datetime
    amount: Decimal


class Struct(msgspec.Struct):
    name: str
    items: list[int]


RECEIPT = Receipt(
    id=uuid.UUID("12345678-1234-5678-1234-567812345678"),
    at=datetime(2026, 11, 29, 12, 30, 1, 123456, tzinfo=timezone.utc),
    day=date(2026, 11, 29),
    lines=[Line("a", 2, Decimal("9.99")), Line("b", 1, Decimal("0.10"))],
    tags=frozenset({"x", "y"}),
    colour=Colour.BLUE,
    blob=b"\x00\xffbinary",
    pair=(1, "one"),
    extra={"ratio": 0.25},
)


def receipt() -> Receipt:
    return RECEIPT


def model() -> Model:
    return Model(name="m", when=datetime(2026, 1, 2, 3, 4, 5), amount=Decimal("1.50"))


def struct() -> Struct:
    return Struct(name="s", items=[1, 2, 3])


def naive_dt() -> datetime:
    return datetime(2026, 1, 2, 3, 4, 5, 6)


def a_time() -> time:
    return time(23, 59, 1)


def uuid_value() -> uuid.UUID:
    return uuid.UUID(int=7)


def decimal_value() -> Decimal:
    return Decimal("-0.000100")


def raw_bytes() -> bytes:
    return bytes(range(256))


def nothing() -> None:
    return None


def a_tuple() -> tuple[int, ...]:
    return (1, 2, 3)


def optional_missing() -> Line | None:
    return None


TYPED = [
    receipt,
    model,
    struct,
    naive_dt,
    a_time,
    uuid_value,
    decimal_value,
    raw_bytes,
    nothing,
    a_tuple,
    optional_missing,
]


async def test_typed_results_come_back_as_the_declared_type(api: Facade) -> None:
    # Every type on one coordinator (a test per type would open one per type on every
    # store and face, most of such a test's time); a failure names its type.
    def recording(fn: Any, calls: list[int]) -> Any:
        def op() -> Any:
            calls.append(1)
            return fn()

        op.__annotations__ = {"return": fn.__annotations__["return"]}
        return op

    for fn in TYPED:
        try:
            calls: list[int] = []
            op = recording(fn, calls)
            wrapped = api.wrap(IdempotencySpec(f"typed-{fn.__name__}"), op, key=lambda: "k")
            first = await wrapped()
            again = await wrapped()
            assert calls == [1]
            assert again == first == fn()
            assert type(again) is type(fn())
        except BaseException as exc:
            exc.add_note(f"(type of {fn.__name__})")
            raise


async def test_unfaithful_result_is_refused_and_abandoned(api: Facade) -> None:
    def op() -> dict:  # type: ignore[type-arg]
        return {"when": datetime(2026, 1, 1)}  # a datetime is not JSON data

    wrapped = api.wrap(SPEC, op, key=lambda: "unfaithful")
    with pytest.raises(ResultEncodeError):
        await wrapped()
    assert await api.idem(SPEC).status("unfaithful") is None


async def test_result_too_large(harness: Harness) -> None:
    coord = harness.sync(max_result_bytes=1000, compress_over=None)
    try:
        port = coord.idempotency(SPEC)

        @coord.idempotent(SPEC, key=lambda n: "big")
        def op(n: int) -> str:
            return "x" * n

        with pytest.raises(ResultTooLarge):
            op(2000)
        assert port.status("big") is None  # nothing stored, claim abandoned
        assert op(10) == "x" * 10
    finally:
        coord.close()


async def test_large_results_are_compressed(harness: Harness) -> None:
    coord = harness.sync(max_result_bytes=4096, compress_over=1024)
    try:
        port = coord.idempotency(SPEC)
        claim = port.claim("z")
        assert isinstance(claim, Claimed)
        big = "abc" * 10_000  # 30 kB of JSON, far less compressed
        port.complete(claim.token, big)
        replay = port.claim("z")
        assert isinstance(replay, Completed) and replay.result == big
    finally:
        coord.close()


class Declined(Exception):
    pass


class Flaky(Exception):
    pass


async def test_listed_errors_are_recorded_and_replayed(api: Facade) -> None:
    calls = []

    def pay(card: str) -> str:
        calls.append(card)
        if card == "bad":
            raise Declined("card declined", 402)
        raise Flaky("try again")

    wrapped = api.wrap(SPEC, pay, replay_errors=(Declined,))
    for _ in range(3):
        with pytest.raises(Declined) as info:
            await wrapped("bad")
        assert info.value.args == ("card declined", 402)
    assert calls == ["bad"]
    # An unlisted error abandons: every call runs again.
    for _ in range(2):
        with pytest.raises(Flaky):
            await wrapped("flaky")
    assert calls == ["bad", "flaky", "flaky"]


async def test_recorded_error_of_unlisted_type_is_not_replayed_as_success(api: Facade) -> None:
    def pay(card: str) -> str:
        raise Declined("no")

    await _expect_raises(api.wrap(SPEC, pay, replay_errors=(Declined,)), Declined)
    # The same key read by code that no longer lists the type: a clear error, not a value.
    replay = await api.idem(SPEC).claim(idemlock.fingerprint({"card": "x"}), payload={"card": "x"})
    assert isinstance(replay, Completed) and replay.error is not None
    assert replay.error.type.endswith("Declined") and replay.result is None
    with pytest.raises(ResultDecodeError):
        await api.wrap(SPEC, lambda card: card)("x")


async def _expect_raises(fn: Any, exc: type[BaseException]) -> None:
    with pytest.raises(exc):
        await fn("x")


async def test_corrupt_record_raises_decode_error(api: Facade) -> None:
    await _plant(api, SPEC, "corrupt", b"j{this is not json")
    with pytest.raises(ResultDecodeError):
        await api.idem(SPEC).claim("corrupt")
    await _plant(api, SPEC, "unknown", b"?format from the future")
    with pytest.raises(ResultDecodeError):
        await api.idem(SPEC).claim("unknown")


async def _plant(api: Facade, spec: IdempotencySpec, key: str, data: bytes) -> None:
    """Write raw bytes as the completed result of ``key`` through the store itself."""
    port = api.coord.idempotency(spec)
    store, ns, skey = api.coord.store, port._ns, port._skey(key)
    reply = await _maybe(store.claim(ns, skey, None, "planter", 60_000))
    assert reply.token == "planter"
    assert await _maybe(store.complete(ns, skey, "planter", data, 60_000))


async def _raw(api: Facade, spec: IdempotencySpec, key: str, payload: Any = None) -> bytes:
    """The stored bytes of a completed ``key``, read through the store itself."""
    port = api.coord.idempotency(spec)
    store, fp = api.coord.store, port._fp(payload)
    reply = await _maybe(store.claim(port._ns, port._skey(key), fp, "reader", 1000))
    return bytes(reply.result)


async def _maybe(value: Any) -> Any:
    import inspect

    return await value if inspect.isawaitable(value) else value


# ---- sealing ---------------------------------------------------------------------

KEYRING = Keyring({"k1": b"\x01" * 32}, "k1", b"L" * 32)


def sealed_facade(api: Facade, keyring: Keyring = KEYRING, tenant: str | None = None) -> Facade:
    h = api.harness
    opts: dict[str, Any] = {"keyring": keyring}
    if tenant is not None:
        opts["tenant"] = tenant
    coord = h.sync(**opts) if api.mode == "sync" else h.aio(**opts)
    return Facade(h, coord, api.mode)


async def test_sealed_results_round_trip_and_are_unreadable(api: Facade) -> None:
    sealed = sealed_facade(api)
    try:
        port = sealed.idem(SEALED)
        claim = await port.claim("secret-key", payload={"card": "4242"})
        assert isinstance(claim, Claimed)
        await port.complete(claim.token, {"pan": "4242424242424242"})
        replay = await port.claim("secret-key", payload={"card": "4242"})
        assert isinstance(replay, Completed) and replay.result == {"pan": "4242424242424242"}
        raw = await _raw(sealed, SEALED, "secret-key", {"card": "4242"})
        assert raw[:1] == b"s" and b"4242" not in raw
        # Keys are HMACs in the store: neither the key nor the payload hash appears.
        listed = [r.key for r in await sealed.keys()]
        assert "secret-key" not in listed and len(listed) == 1 and len(listed[0]) == 64
        assert idemlock.fingerprint({"card": "4242"}) not in listed
    finally:
        await sealed.close()


async def test_sealed_record_copied_to_another_key_or_tenant_fails_to_open(api: Facade) -> None:
    sealed = sealed_facade(api)
    other_tenant = sealed_facade(api, tenant="globex")
    try:
        port = sealed.idem(SEALED)
        claim = await port.claim("a")
        assert isinstance(claim, Claimed)
        await port.complete(claim.token, "for a only")
        raw = await _raw(sealed, SEALED, "a")
        await _plant(sealed, SEALED, "b", raw)  # copied to another key
        with pytest.raises(SealError):
            await port.claim("b")
        other_spec = IdempotencySpec("sealed2", encrypt_result=True)
        await _plant(sealed, other_spec, "a", raw)  # another spec, same key
        with pytest.raises(SealError):
            await sealed.idem(other_spec).claim("a")
        await _plant(other_tenant, SEALED, "a", raw)  # another tenant, same spec and key
        with pytest.raises(SealError):
            await other_tenant.idem(SEALED).claim("a")
    finally:
        await sealed.close()
        await other_tenant.close()


async def test_rotation_keeps_records_readable_and_findable(api: Facade) -> None:
    old = sealed_facade(api)
    rotated_ring = KEYRING.rotate("k2", b"\x02" * 32)
    new = sealed_facade(api, rotated_ring)
    without_old = sealed_facade(api, Keyring({"k2": b"\x02" * 32}, "k2", b"L" * 32))
    wrong = sealed_facade(api, Keyring({"k1": b"\x09" * 32}, "k1", b"L" * 32))
    try:
        claim = await old.idem(SEALED).claim("r", payload={"v": 1})
        assert isinstance(claim, Claimed)
        await old.idem(SEALED).complete(claim.token, "sealed by k1")
        # After rotation the same key and payload still find the record and open it.
        replay = await new.idem(SEALED).claim("r", payload={"v": 1})
        assert isinstance(replay, Completed) and replay.result == "sealed by k1"
        claim2 = await new.idem(SEALED).claim("r2")
        assert isinstance(claim2, Claimed)
        await new.idem(SEALED).complete(claim2.token, "sealed by k2")
        assert (await _raw(new, SEALED, "r2"))[2:4] == b"k2"  # sealed under the new primary
        with pytest.raises(SealError) as info:
            await without_old.idem(SEALED).claim("r", payload={"v": 1})
        assert "k1" in str(info.value)
        with pytest.raises(SealError):
            await wrong.idem(SEALED).claim("r", payload={"v": 1})
    finally:
        for f in (old, new, without_old, wrong):
            await f.close()


async def test_unsealed_record_under_a_sealed_spec_is_refused(api: Facade) -> None:
    sealed = sealed_facade(api)
    try:
        await _plant(sealed, SEALED, "forged", b'j{"v":"forged"}')
        with pytest.raises(SealError):
            await sealed.idem(SEALED).claim("forged")
    finally:
        await sealed.close()


def test_keyring_never_shows_key_material() -> None:
    ring = Keyring({"k1": b"\x07" * 32}, "k1", b"S" * 32)
    assert "\\x07" not in repr(ring) and "BwcH" not in repr(ring)
    with pytest.raises(ConfigurationError) as info:
        Keyring({"k1": b"short"}, "k1", b"S" * 32)
    assert "short" not in str(info.value)
    with pytest.raises(ConfigurationError):
        Keyring({"k1": b"\x07" * 32}, "k1", b"\x07" * 32)  # lookup secret must differ
    with pytest.raises(ConfigurationError):
        Keyring({"k1": b"\x07" * 32}, "k2", b"S" * 32)


def test_keyring_from_env_and_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    import base64

    ring = Keyring.generate()
    doc = ring.to_json()
    monkeypatch.setenv("RING_JSON", doc)
    monkeypatch.setenv("RING_B64", base64.b64encode(doc.encode()).decode())
    path = tmp_path / "ring.json"
    path.write_text(doc)
    for loaded in (
        Keyring.from_env("RING_JSON"),
        Keyring.from_env("RING_B64"),
        Keyring.from_file(path),
    ):
        assert loaded.to_json() == doc
    with pytest.raises(ConfigurationError):
        Keyring.from_env("NOT_SET_ANYWHERE")
    with pytest.raises(ConfigurationError):
        Keyring.from_json("{}")


# ---- tenants ---------------------------------------------------------------------


async def test_tenants_are_isolated(api: Facade) -> None:
    acme = Facade(api.harness, api.coord.for_tenant("acme"), api.mode)
    globex = Facade(api.harness, api.coord.for_tenant("globex"), api.mode)
    claim = await acme.idem(SPEC).claim("order-1")
    assert isinstance(claim, Claimed)
    await acme.idem(SPEC).complete(claim.token, "acme's")
    other = await globex.idem(SPEC).claim("order-1")
    assert isinstance(other, Claimed)  # not acme's record, not acme's result
    assert await api.idem(SPEC).status("order-1") is None
    lock = await acme.lock(LockSpec("l")).acquire("k")
    assert lock is not None
    assert await globex.lock(LockSpec("l")).acquire("k") is not None
    await acme.fence("r").check_and_advance(100)
    assert await globex.fence("r").current() is None
    assert {r.key for r in await acme.keys()} == {"order-1"}
    assert [r.state for r in await globex.keys()] == ["in_flight"]
    # Closing a view leaves the shared store open.
    await acme.close()
    assert await globex.idem(SPEC).status("order-1") is not None


def test_tenant_names_are_validated() -> None:
    coord = idemlock.connect("memory://")
    with pytest.raises(idemlock.InvalidKey):
        coord.for_tenant("a tenant")
    with pytest.raises(idemlock.InvalidKey):
        idemlock.connect("memory://", tenant="")


# ---- arbitrary data --------------------------------------------------------------

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**62), max_value=2**62)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
    max_leaves=12,
)
KEYS = st.text(
    st.characters(blacklist_categories=("Zs", "Zl", "Zp", "Cc", "Cs", "Cf")),
    min_size=1,
    max_size=40,
)


def test_arbitrary_results_and_keys_round_trip(harness: Harness) -> None:
    coord = harness.sync()
    port = coord.idempotency(SPEC)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(key=KEYS, result=JSON)
    def check(key: str, result: Any) -> None:
        port.forget(key)
        claim = port.claim(key, payload={"r": 1})
        assert isinstance(claim, Claimed)
        port.complete(claim.token, result)
        replay = port.claim(key, payload={"r": 1})
        assert isinstance(replay, Completed) and replay.result == result

    try:
        check()
    finally:
        coord.close()
