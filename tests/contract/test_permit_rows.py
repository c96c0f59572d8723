"""The lock rows with a limit, on every store's port, sync and async: a lock is the
one-permit case of the same rows (``docs/states.md``), so these calls go straight to
``store.acquire(..., limit=N)`` and friends. The public faces (``coord.semaphore()``)
are covered in ``test_permits.py``."""

from __future__ import annotations

import time
import uuid

from idemlock._core.port import Acquired, Channel, Held

from .facade import Facade, Proxy

LONG_MS = 30_000


def _store(api: Facade) -> Proxy:
    return Proxy(api.coord.store, api.mode)


def _ns() -> str:
    return "tp" + uuid.uuid4().hex[:10] + ":sem"


async def test_up_to_limit_holders_each_with_a_higher_token(api: Facade) -> None:
    store, ns = _store(api), _ns()
    got = [await store.acquire(ns, "k", f"o{i}", LONG_MS, 3) for i in range(3)]
    assert all(isinstance(g, Acquired) for g in got), got
    tokens = [g.token for g in got]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    full = await store.acquire(ns, "k", "o3", LONG_MS, 3)
    assert isinstance(full, Held) and 0 < full.ttl_ms <= LONG_MS
    rows = await store.holders(ns, "k")
    assert [(r.owner, r.token) for r in rows] == [(f"o{i}", tokens[i]) for i in range(3)]
    first = await store.lock(ns, "k")
    assert first is not None and (first.owner, first.token) == ("o0", tokens[0])
    listed = [r for r in await store.locks(ns) if r.key == "k"]
    assert sorted(r.token for r in listed) == tokens
    # Another key is apart.
    assert isinstance(await store.acquire(ns, "other", "o3", LONG_MS, 3), Acquired)


async def test_release_frees_one_permit_and_tokens_keep_rising(api: Facade) -> None:
    store, ns = _store(api), _ns()
    a = await store.acquire(ns, "k", "a", LONG_MS, 2)
    b = await store.acquire(ns, "k", "b", LONG_MS, 2)
    assert isinstance(a, Acquired) and isinstance(b, Acquired)
    assert await store.release(ns, "k", "a", a.token) is True
    assert await store.release(ns, "k", "a", a.token) is False  # a second release
    c = await store.acquire(ns, "k", "c", LONG_MS, 2)
    assert isinstance(c, Acquired) and c.token > b.token > a.token
    assert [r.owner for r in await store.holders(ns, "k")] == ["b", "c"]
    # A release naming the wrong token frees nothing.
    assert await store.release(ns, "k", "b", c.token) is False
    assert len(await store.holders(ns, "k")) == 2


async def test_same_owner_reacquires_its_permit(api: Facade) -> None:
    store, ns = _store(api), _ns()
    first = await store.acquire(ns, "k", "w", LONG_MS, 2)
    again = await store.acquire(ns, "k", "w", LONG_MS, 2)
    assert isinstance(first, Acquired) and isinstance(again, Acquired)
    assert again.token == first.token
    assert len(await store.holders(ns, "k")) == 1  # one permit per owner
    assert isinstance(await store.acquire(ns, "k", "x", LONG_MS, 2), Acquired)
    # The holder itself is answered even when the key is full.
    assert isinstance(await store.acquire(ns, "k", "w", LONG_MS, 2), Acquired)


async def test_limit_is_the_callers_and_a_lowered_limit_drains(api: Facade) -> None:
    store, ns = _store(api), _ns()
    held = [await store.acquire(ns, "k", f"o{i}", LONG_MS, 3) for i in range(3)]
    assert all(isinstance(h, Acquired) for h in held)
    # A caller with limit 2 counts the same three holders: no room.
    assert isinstance(await store.acquire(ns, "k", "low", LONG_MS, 2), Held)
    for i in (0, 1):
        h = held[i]
        assert isinstance(h, Acquired)
        assert await store.release(ns, "k", f"o{i}", h.token) is True
    # One holder left: below 2.
    assert isinstance(await store.acquire(ns, "k", "low", LONG_MS, 2), Acquired)
    # A limit-1 caller (a lock) sees the key held.
    assert isinstance(await store.acquire(ns, "k", "one", LONG_MS, 1), Held)


async def test_a_lock_is_the_one_permit_case(api: Facade) -> None:
    store, ns = _store(api), _ns()
    a = await store.acquire(ns, "k", "a", LONG_MS)
    assert isinstance(a, Acquired)
    assert isinstance(await store.acquire(ns, "k", "b", LONG_MS, 1), Held)
    # A caller allowing two shares the key with the lock's holder.
    b = await store.acquire(ns, "k", "b", LONG_MS, 2)
    assert isinstance(b, Acquired) and b.token > a.token


async def test_break_one_permit_or_all_and_the_counter_stays(api: Facade) -> None:
    store, ns = _store(api), _ns()
    got = [await store.acquire(ns, "k", f"o{i}", LONG_MS, 3) for i in range(3)]
    tokens = [g.token for g in got if isinstance(g, Acquired)]
    assert len(tokens) == 3
    assert await store.break_lock(ns, "k", tokens[1]) is True
    assert await store.break_lock(ns, "k", tokens[1]) is False
    assert [r.token for r in await store.holders(ns, "k")] == [tokens[0], tokens[2]]
    # The broken holder's renew and release fail.
    assert await store.renew(ns, "k", "o1", tokens[1], LONG_MS) is None
    assert await store.release(ns, "k", "o1", tokens[1]) is False
    assert await store.break_lock(ns, "k") is True
    assert await store.holders(ns, "k") == []
    assert await store.break_lock(ns, "k") is False
    nxt = await store.acquire(ns, "k", "o1", LONG_MS, 3)
    assert isinstance(nxt, Acquired) and nxt.token > max(tokens)


async def test_renew_one_permit_and_publish_a_value(api: Facade) -> None:
    store, ns = _store(api), _ns()
    a = await store.acquire(ns, "k", "a", 5_000, 2, b"host-a:1")
    b = await store.acquire(ns, "k", "b", 5_000, 2)
    assert isinstance(a, Acquired) and isinstance(b, Acquired)
    rows = {r.owner: r for r in await store.holders(ns, "k")}
    assert rows["a"].value == b"host-a:1" and rows["b"].value is None
    exp = await store.renew(ns, "k", "a", a.token, LONG_MS, b"host-a:2")
    assert exp is not None and exp > a.expires_ms
    exp_b = await store.renew(ns, "k", "b", b.token, LONG_MS)
    assert exp_b is not None
    rows = {r.owner: r for r in await store.holders(ns, "k")}
    assert rows["a"].value == b"host-a:2" and rows["a"].token == a.token
    assert rows["a"].expires_ms == exp and rows["b"].value is None
    # A renew without a value keeps the published one.
    assert await store.renew(ns, "k", "a", a.token, LONG_MS) is not None
    assert (await store.lock(ns, "k")).value == b"host-a:2"  # type: ignore[union-attr]
    # A re-sent acquire with a value replaces it.
    again = await store.acquire(ns, "k", "a", LONG_MS, 2, b"host-a:3")
    assert isinstance(again, Acquired) and again.token == a.token
    assert {r.owner: r.value for r in await store.holders(ns, "k")}["a"] == b"host-a:3"


async def test_each_permit_expires_on_its_own(api: Facade) -> None:
    store, ns = _store(api), _ns()
    short = await store.acquire(ns, "k", "short", 300, 2)
    long = await store.acquire(ns, "k", "long", LONG_MS, 2)
    assert isinstance(short, Acquired) and isinstance(long, Acquired)
    assert isinstance(await store.acquire(ns, "k", "new", LONG_MS, 2), Held)
    api.harness.advance(0.35)
    deadline = time.monotonic() + 20
    while len(await store.holders(ns, "k")) != 1:
        assert time.monotonic() < deadline, "the short permit did not expire"
        api.harness.advance(0.05)
    assert await store.renew(ns, "k", "short", short.token, LONG_MS) is None
    got = await store.acquire(ns, "k", "new", LONG_MS, 2)
    assert isinstance(got, Acquired) and got.token > long.token
    assert [r.owner for r in await store.holders(ns, "k")] == ["long", "new"]


async def test_renew_many_renews_permits(api: Facade) -> None:
    if not api.coord.store.capabilities.renew_many:
        assert api.harness.name in ("etcd", "etcd_cluster"), "which stores batch renewals is data"
        return
    store, ns = _store(api), _ns()
    a = await store.acquire(ns, "k", "a", 5_000, 2)
    b = await store.acquire(ns, "k", "b", 5_000, 2)
    assert isinstance(a, Acquired) and isinstance(b, Acquired)
    out = await store.renew_many(
        [
            ("lock", ns, "k", "a", a.token, LONG_MS),
            ("lock", ns, "k", "b", b.token + 100, LONG_MS),
        ]
    )
    assert out[0] is not None and out[0] > a.expires_ms and out[1] is None


async def test_a_release_wakes_a_waiter_of_a_full_key(api: Facade) -> None:
    store, ns = _store(api), _ns()
    a = await store.acquire(ns, "k", "a", LONG_MS, 2)
    b = await store.acquire(ns, "k", "b", LONG_MS, 2)
    assert isinstance(a, Acquired) and isinstance(b, Acquired)
    sub = Proxy(await store.subscribe(Channel("lock", ns, "k")), api.mode)
    try:
        assert isinstance(await store.acquire(ns, "k", "w", LONG_MS, 2), Held)
        assert await store.release(ns, "k", "a", a.token) is True
        assert await sub.wait(20.0) is True
        deadline = time.monotonic() + 20
        while not isinstance(got := await store.acquire(ns, "k", "w", LONG_MS, 2), Acquired):
            assert time.monotonic() < deadline, got
            await sub.wait(0.2)
        assert got.token > b.token
    finally:
        await (sub.close() if api.mode == "sync" else sub.aclose())
