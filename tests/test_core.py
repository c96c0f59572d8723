"""The pure domain: keys, canonical payloads, codec, specs, URLs, wiring errors."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

import idemlock
import idemlock.aio
from idemlock import (
    CanonicalizeError,
    ConfigurationError,
    IdemlockError,
    InvalidKey,
    LockSpec,
    ResultDecodeError,
    ResultEncodeError,
    canonicalize,
    fingerprint,
)
from idemlock._core.codec import ResultFormat
from idemlock._core.keys import namespace, split_namespace, validate_key
from idemlock.stores.memory import MemoryStore

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children),
    max_leaves=20,
)


def test_canonical_form() -> None:
    assert canonicalize({"b": 1, "a": [1, 2.5, None, True]}) == b'{"a":[1,2.5,null,true],"b":1}'
    assert canonicalize({"é": "ü"}) == '{"é":"ü"}'.encode()
    assert canonicalize((1, 2)) == canonicalize([1, 2])
    assert fingerprint({"a": 1}) == fingerprint({"a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
    assert len(fingerprint(None)) == 64


@given(JSON)
def test_canonical_is_stable_and_parses_back(value: object) -> None:
    data = canonicalize(value)
    assert canonicalize(json.loads(data)) == data


@given(st.dictionaries(st.text(), st.integers(), min_size=2))
def test_key_order_does_not_matter(d: dict[str, int]) -> None:
    assert fingerprint(d) == fingerprint(dict(reversed(list(d.items()))))


@pytest.mark.parametrize(
    "bad", [float("nan"), float("-inf"), {"a": {1, 2}}, b"bytes", {("t",): 1}, object()]
)
def test_canonicalize_rejects(bad: object) -> None:
    with pytest.raises(CanonicalizeError) as info:
        canonicalize(bad)
    assert isinstance(info.value, IdemlockError)


@pytest.mark.parametrize("key", ["a", "x" * 512, "ü" * 256, "a:b{c}", "😀"])
def test_valid_keys(key: str) -> None:
    assert validate_key(key) == key


@pytest.mark.parametrize(
    "key", ["", " ", "a b", "a\tb", "a\nb", "\x00", "\x7f", "\u0085", "x" * 513, "ü" * 257, 5]
)
def test_invalid_keys(key: object) -> None:
    with pytest.raises(InvalidKey):
        validate_key(key)


@given(st.text(min_size=1), st.text(min_size=1), st.text(min_size=1), st.text(min_size=1))
def test_namespaces_never_collide(a: str, b: str, c: str, d: str) -> None:
    if (a, b) != (c, d):
        assert namespace(a, b) != namespace(c, d)
    assert split_namespace(namespace(a, b)) == [a, b]


@given(JSON)
def test_result_format_round_trip(value: object) -> None:
    fmt = ResultFormat(compress_over=8)
    assert fmt.decode(fmt.encode(value)) == (value, None)


def test_result_format_errors() -> None:
    fmt = ResultFormat()
    with pytest.raises(ResultEncodeError):
        fmt.encode({"x": object()})
    with pytest.raises(ResultEncodeError):
        fmt.encode(float("nan"))
    with pytest.raises(ResultEncodeError):
        fmt.encode((1, 2))  # would come back as a list
    with pytest.raises(ResultEncodeError):
        fmt.encode({1: "int key"})  # would come back with a str key
    for corrupt in (b"", b"x{}", b"j{not json", b'j{"w":1}', b"j\xff\xfe", b"zgarbage"):
        with pytest.raises(ResultDecodeError):
            fmt.decode(corrupt)


@pytest.mark.parametrize(
    "url", ["mysql://localhost/db", "nope", "http://x", "memory://host", "memory:///path"]
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        idemlock.connect(url)
    assert "memory://" in str(info.value) or "memory store" in str(info.value)


def test_unknown_client_object() -> None:
    with pytest.raises(ConfigurationError):
        idemlock.connect(object())


def test_default_url_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDEMLOCK_URL", "memory://")
    with idemlock.connect() as coord:
        assert coord.store.kind == "memory"


def test_bad_prefix() -> None:
    with pytest.raises(InvalidKey):
        idemlock.connect("memory://", key_prefix="has space")


def test_requires_fencing_token_wires_on_every_store() -> None:
    # Every store issues fencing tokens, so the requirement always holds.
    coord = idemlock.Coordinator(MemoryStore())
    lease = coord.lock(LockSpec("x", requires_fencing_token=True)).acquire("k", owner="o")
    assert lease is not None and isinstance(lease.token, int) and lease.token > 0


def test_an_object_that_declares_no_capabilities_is_not_a_store() -> None:
    class NotAStore:
        kind = "memory"
        timeout = 5.0

    with pytest.raises(ConfigurationError, match="declares no capabilities"):
        idemlock.Coordinator(NotAStore())


@pytest.mark.parametrize(
    ("module", "names"),
    [
        ("idemlock.stores.memory", ("MemoryStore", "MemoryAsyncStore")),
        ("idemlock.stores.sqlite", ("SQLiteStore", "SQLiteAsyncStore")),
        ("idemlock.stores.redis", ("RedisStore", "AsyncRedisStore")),
        ("idemlock.stores.postgres", ("PostgresStore", "AsyncPostgresStore")),
        ("idemlock.stores.etcd._sync", ("EtcdStore",)),
        ("idemlock.stores.etcd._async", ("AsyncEtcdStore",)),
    ],
)
def test_every_store_declares_what_it_can_do(module: str, names: tuple[str, ...]) -> None:
    """Capabilities are data on the store class, and each declared optional method is
    there (the coordinator calls it without probing)."""
    import importlib

    from idemlock._core.port import Capabilities

    mod = importlib.import_module(module)
    for name in names:
        cls = getattr(mod, name)
        caps = cls.__dict__.get("capabilities") or getattr(cls, "capabilities", None)
        if caps is None:  # the async faces of sync stores take their store's
            continue
        assert isinstance(caps, Capabilities), name
        assert caps.handoff, name  # every store shipped keeps the hand-off window
        for method in ("renew_many", "complete_with", "fence_set"):
            assert callable(getattr(cls, method, None)) is getattr(caps, method), (name, method)
        if not caps.cross_process_wakeups:
            assert isinstance(cls.poll_cap, float), name


def test_async_faces_take_the_capabilities_of_their_store() -> None:
    from idemlock.stores.sqlite import SQLiteStore

    with idemlock.connect("memory://") as coord:
        assert coord.capabilities.renew_many and coord.poll_cap is None
    assert SQLiteStore.capabilities.cross_process_wakeups is False


def test_memory_max_keys() -> None:
    clock = idemlock.ManualClock()
    coord = idemlock.connect("memory://", max_keys=2, clock=clock)
    port = coord.idempotency(idemlock.IdempotencySpec("s", ttl=timedelta(seconds=10)))
    for key in ("a", "b"):
        claim = port.claim(key)
        assert isinstance(claim, idemlock.Claimed)
        port.complete(claim.token, key)
    with pytest.raises(idemlock.StoreFull) as info:
        port.claim("c")
    assert "max_keys" in str(info.value)
    # The recorded results were not evicted.
    assert isinstance(port.claim("a"), idemlock.Completed)
    clock.advance(11)
    assert isinstance(port.claim("c"), idemlock.Claimed)
    with pytest.raises(ConfigurationError):
        idemlock.connect("memory://", max_keys=0)


async def test_async_coordinator_refuses_plain_functions() -> None:
    async with idemlock.aio.connect("memory://") as coord:
        with pytest.raises(ConfigurationError):
            coord.idempotent("s")(lambda: 1)


def test_sync_coordinator_wraps_async_functions() -> None:
    import asyncio

    coord = idemlock.connect("memory://")
    calls = []

    @coord.idempotent("s")
    async def op(x: int) -> int:
        calls.append(x)
        return x + 1

    assert asyncio.run(op(1)) == 2
    assert asyncio.run(op(1)) == 2
    assert calls == [1]


def test_lease_remaining_counts_from_send_time() -> None:
    clock = idemlock.ManualClock()
    coord = idemlock.connect("memory://", clock=clock)
    lease = coord.lock(LockSpec("l", ttl=timedelta(seconds=10))).acquire("k")
    assert lease is not None
    assert lease.remaining() == timedelta(seconds=10)
    clock.advance(4)
    assert lease.remaining() == timedelta(seconds=6)
    clock.advance(7)
    assert lease.remaining() == timedelta(0)


def test_lease_deadline_moves_with_a_renewal_and_stays_when_lost() -> None:
    clock = idemlock.ManualClock()
    coord = idemlock.connect("memory://", clock=clock)
    locks = coord.lock(LockSpec("l", ttl=timedelta(seconds=10)))
    lease = locks.acquire("k")
    assert lease is not None
    start = clock.monotonic()
    assert lease.deadline() == start + 10
    clock.advance(4)
    assert locks.renew(lease, ttl=timedelta(seconds=20)) is True
    assert lease.deadline() == start + 4 + 20
    clock.advance(25)
    assert locks.renew(lease) is False and lease.lost
    # remaining() is 0 once lost; the deadline still says when it ended here.
    assert lease.remaining() == timedelta(0) and lease.deadline() == start + 24


def test_errors_are_one_hierarchy() -> None:
    for name in idemlock.__all__:
        obj = getattr(idemlock, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, IdemlockError), name


def test_result_format_advice_fits_its_caller() -> None:
    """Without a dumper the caller is the port (no return type to declare; the claim
    is kept); with one it is the decorator (declare the type; the claim is abandoned)."""
    from idemlock._core.typed import dumper, loader

    fmt = ResultFormat(max_bytes=64)
    with pytest.raises(ResultEncodeError) as port_info:
        fmt.encode((1, 2))
    assert "pass JSON data (lists instead of tuples" in str(port_info.value)
    assert "declare the return type" not in str(port_info.value)
    assert "the claim stays in flight until its lease ends" in str(port_info.value)
    with pytest.raises(ResultEncodeError) as deco_info:
        fmt.encode((1, 2), dumper(object), loader(object))
    assert "declare the return type so it can be restored" in str(deco_info.value)
    assert "the claim was abandoned" in str(deco_info.value)
    with pytest.raises(idemlock.ResultTooLarge) as large:
        fmt.encode("x" * 100)
    assert "the claim stays in flight" in str(large.value)
    with pytest.raises(ResultDecodeError) as bad:
        fmt.decode(b"j{not json")
    assert "port.forget(key)" in str(bad.value) and "forget the key" not in str(bad.value)
