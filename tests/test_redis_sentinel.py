"""The Redis store behind Sentinel, through a failover (issue 26).

A primary, a replica and three Sentinels are started per test (tests/servers/sentinel);
the store connects by a ``redis+sentinel://`` URL. While clients hold a lock, an
in-flight claim and completed records, the primary is SIGKILLed; after the Sentinels
promote the replica:

* no fencing token is issued twice or goes backwards, even for tokens the old primary
  issued and never replicated (the replica was stopped meanwhile);
* a holder whose lease cannot be renewed is told (``on_lost``, ``LockLost``);
* calls resume on the new primary (waited for, with a generous bound);
* with ``durability=replicas:1`` a completed record survives and its retry replays it;
  with ``durability=none`` a completion the replica never received is lost (the
  documented loss: the key can be claimed again).

Also: URL and option errors, ``durability=aof`` refused at connect on a server
without WAITAOF, and an unmet ``durability=replicas:N`` raising ``StoreUnavailable``.
Every wait is bounded; nothing sleeps a fixed time.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import redis

import idemlock
import idemlock.aio
from idemlock import ConfigurationError, LockLost, LockSpec, StoreUnavailable
from idemlock._core.port import Acquired, Done, Granted, Held
from idemlock.stores.redis._compat import aclose_client

from .servers._proc import tempdir
from .servers.redis import RedisServer
from .servers.sentinel import SentinelGroup, start_sentinel_group

LONG = 3_600_000  # ms: outlives every bound below, however loaded the machine
#: the bound on waiting for the store to work again after the SIGKILL: Sentinel's
#: failover (down-after 500 ms + election + promotion, ~2 s here) plus the store's
#: timeout, with a wide margin for a loaded machine
RESUME_BOUND = 60.0
#: the store timeout of the unmet-replicas tests: the WAIT is given 80 % of it less 100 ms,
#: the rest is the margin for its reply (0.2 s at a 0.5 s timeout, outrun at load 23:
#: "no reply within timeout" instead of the replicas' count); each write waits 2.3 s
UNMET_TIMEOUT = 3.0
#: what each test measured: seconds from the SIGKILL to the first successful call
FAILOVER_TIMES: list[float] = []


@pytest.fixture
def group() -> Iterator[SentinelGroup]:
    with tempdir("il-sentinel-") as tmp:
        g = start_sentinel_group(Path(tmp))
        try:
            yield g
        finally:
            g.stop()


def _ns() -> str:
    return "s" + uuid.uuid4().hex[:8]


# ---- URLs and options ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://127.0.0.1:26379", "/SERVICE[/DB]"),
        ("redis+sentinel://127.0.0.1:26379/", "/SERVICE[/DB]"),
        ("redis+sentinel://127.0.0.1:26379/svc/x", "/SERVICE[/DB]"),
        ("redis+sentinel://127.0.0.1:26379/svc/1/2", "/SERVICE[/DB]"),
        ("redis+sentinel:///svc", "/SERVICE[/DB]"),
        ("redis+sentinel://127.0.0.1:port/svc", "host:port[,host:port...]"),
        ("redis+sentinel://127.0.0.1:26379/svc?bogus=1", "unknown option"),
        ("redis+sentinel://127.0.0.1:26379/svc?durability=replicas", "replicas:N"),
        ("redis+sentinel://127.0.0.1:26379/svc?durability=aof+aof", "aof+replicas:N"),
        ("redis+sentinel://127.0.0.1:26379/svc?durability=replicas:0", "replicas:N"),
        ("redis://127.0.0.1:1/0?sentinel_password=s3cr3tpw", "unknown option"),
        ("redis+cluster://127.0.0.1:1?durability=replicas:1", "not supported on Redis Cluster"),
    ],
)
def test_bad_urls_say_what_to_write(url: str, says: str) -> None:
    for opener in (idemlock.connect, idemlock.aio.connect):
        with pytest.raises(ConfigurationError) as err:
            opener(url)
        assert says in str(err.value)


def test_passwords_never_shown() -> None:
    url = "redis+sentinel://u:pw-s3cret@127.0.0.1:1,127.0.0.1:x/svc?sentinel_password=sp-s3cret"
    with pytest.raises(ConfigurationError) as err:
        idemlock.connect(url)
    text = str(err.value)
    assert "Sentinel" in text and "127.0.0.1:x" in text
    assert "pw-s3cret" not in text and "sp-s3cret" not in text
    ok = "redis+sentinel://u:pw-s3cret@127.0.0.1:1/svc?sentinel_password=sp-s3cret&timeout=0.2"
    coord = idemlock.connect(ok)
    try:
        assert "pw-s3cret" not in coord.url and "sp-s3cret" not in coord.url
        with pytest.raises(StoreUnavailable) as down:
            coord.lock("l").acquire("k")
        assert "Sentinel" in str(down.value)
        assert "pw-s3cret" not in str(down.value) and "sp-s3cret" not in str(down.value)
    finally:
        coord.close()


def test_durability_keyword_and_url_agree() -> None:
    from idemlock.stores.redis._common import Durability, parse_durability

    assert parse_durability("none") == Durability()
    assert parse_durability("replicas:2") == Durability(2, False)
    assert parse_durability("aof") == Durability(0, True)
    assert parse_durability("AOF+replicas:1") == Durability(1, True)
    assert str(parse_durability("aof+replicas:3")) == "aof+replicas:3"
    for bad in ("", "replicas:", "replicas:-1", "aof+none", 1, None, "replicas:1+aof+x"):
        with pytest.raises(ConfigurationError, match="durability must be"):
            parse_durability(bad)


# ---- durability on one server ----------------------------------------------------------


def _has_waitaof(port: int) -> tuple[bool, str]:
    with redis.Redis(port=port, decode_responses=True) as r:
        try:
            r.execute_command("WAITAOF", 0, 0, 1)
            has = True
        except redis.ResponseError as exc:
            has = "unknown command" not in str(exc).lower()
        return has, str(r.info("server")["redis_version"])


@pytest.mark.parametrize("mode", ["aof", "aof+replicas:1"])
def test_aof_refused_at_connect_without_waitaof(redis_server: RedisServer, mode: str) -> None:
    has, version = _has_waitaof(redis_server.port)
    url = f"{redis_server.url}?durability={mode}&timeout=1"
    if has:  # a server with WAITAOF: connect works, and a write waits for its AOF
        idemlock.connect(url).close()
        return
    for opener in (idemlock.connect, idemlock.aio.connect):
        with pytest.raises(ConfigurationError) as err:
            opener(url)
        assert f"Redis {version}" in str(err.value) and "7.2" in str(err.value)
    client = redis.Redis(port=redis_server.port)
    try:
        with pytest.raises(ConfigurationError, match=version):
            idemlock.connect(client, durability=mode)
    finally:
        client.close()


def test_unmet_replicas_raise_store_unavailable(redis_server: RedisServer) -> None:
    """No replica: each write is made, then reported as not acknowledged, within the
    call's bound."""
    coord = idemlock.connect(redis_server.url, durability="replicas:1", timeout=UNMET_TIMEOUT)
    store: Any = coord._store
    ns = _ns()
    try:
        with pytest.raises(StoreUnavailable) as err:
            store.claim(ns, "k", None, "aa", LONG)
        assert "1 replica(s) (0 acknowledged)" in str(err.value)
        assert "durability=replicas:1" in str(err.value)
        with pytest.raises(StoreUnavailable, match="replica"):
            store.acquire(ns, "l", "me", LONG)
        assert store.record(ns, "k") is not None  # a peek waits for nothing
        with pytest.raises(StoreUnavailable, match="replica"):
            store.renew_many([("lock", ns, "l", "me", 1, LONG)])
    finally:
        coord.close()


async def test_unmet_replicas_raise_store_unavailable_async(redis_server: RedisServer) -> None:
    coord = idemlock.aio.connect(
        f"{redis_server.url}?durability=replicas:2&timeout={UNMET_TIMEOUT}", key_prefix="x"
    )
    store: Any = coord._store
    ns = _ns()
    try:
        with pytest.raises(StoreUnavailable) as err:
            await store.claim(ns, "k", None, "aa", LONG)
        assert "2 replica(s) (0 acknowledged)" in str(err.value)
        with pytest.raises(StoreUnavailable, match="replica"):
            await store.complete(ns, "k", "aa", b"r", LONG)
        assert (await store.record(ns, "k")) is not None
    finally:
        await coord.close()


# ---- failover ----------------------------------------------------------------------------


class Seen:
    """Every fencing token and claim fence observed, per key."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def add(self, key: str, token: int) -> None:
        got = self.tokens.setdefault(key, [])
        assert not got or token > got[-1], f"{key}: token {token} after {got[-1]}"
        got.append(token)


def _until(what: str, call: Any, bound: float = RESUME_BOUND) -> Any:
    """``call()`` again until it stops raising StoreUnavailable, within ``bound``."""
    deadline = time.monotonic() + bound
    while True:
        try:
            return call()
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: still unavailable after {bound:g}s") from None
            time.sleep(0.05)


async def _until_async(what: str, call: Any, bound: float = RESUME_BOUND) -> Any:
    deadline = time.monotonic() + bound
    while True:
        try:
            return await call()
        except StoreUnavailable:
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: still unavailable after {bound:g}s") from None
            await asyncio.sleep(0.05)


def test_failover_sync(group: SentinelGroup) -> None:
    ns = _ns()
    durable = idemlock.connect(group.url("durability=replicas:1&timeout=2"))
    plain = idemlock.connect(group.url("timeout=2"))
    ds: Any = durable._store
    ps: Any = plain._store
    seen = Seen()
    lost = threading.Event()
    try:
        # A completed record, durably; an in-flight claim; tokens on a lock.
        g = ds.claim(ns, "kept", None, "aa01", LONG)
        assert isinstance(g, Granted)
        seen.add("kept", g.fence)
        assert ds.complete(ns, "kept", "aa01", b"result-kept", LONG)
        kept_at = time.monotonic()
        flying = ds.claim(ns, "flying", None, "bb01", LONG)
        assert isinstance(flying, Granted)
        for _ in range(3):
            a = ds.acquire(ns, "t", "me", LONG)
            seen.add("t", a.token)
            assert ds.release(ns, "t", "me", a.token)
        # A lease held by a renewing holder, with a ttl shorter than any failover here
        # (down-after-milliseconds 500, then the Sentinels' election: over 1 s).
        locks = plain.lock(LockSpec(ns, ttl=timedelta(seconds=0.6)))
        holder = locks.hold("held", renew_every=0.15, on_lost=lambda lease: lost.set())
        lease = holder.__enter__()
        seen.add("held", lease.token)
        # From here the replica receives nothing: what the old primary acknowledges
        # now (tokens, a completion under durability=none) never reaches it.
        group.wait_in_sync()
        group.pause_replica()
        for _ in range(3):
            a = ps.acquire(ns, "t", "me", LONG)
            seen.add("t", a.token)
            assert ps.release(ns, "t", "me", a.token)
        g = ps.claim(ns, "gone", None, "cc01", LONG)
        assert isinstance(g, Granted)
        seen.add("gone", g.fence)
        assert ps.complete(ns, "gone", "cc01", b"result-gone", LONG)
        killed_at = time.monotonic()
        old = group.kill_primary()
        group.resume_replica()
        group.wait_failover(old)

        first = _until("acquire", lambda: ps.acquire(ns, "t", "me", LONG))
        FAILOVER_TIMES.append(time.monotonic() - killed_at)
        assert isinstance(first, Acquired)
        # Above every token issued before, the unreplicated ones included.
        seen.add("t", first.token)
        # The holder is told: its lease could not be renewed before it ran out.
        assert lost.wait(RESUME_BOUND)
        with pytest.raises(LockLost):
            holder.__exit__(None, None, None)
        other = _until("acquire held", lambda: ps.acquire(ns, "held", "other", LONG))
        assert isinstance(other, Acquired)
        seen.add("held", other.token)
        # durability=replicas:N needs N replicas: the old primary comes back as one.
        group.rejoin(old, promotable=False)
        # A durable call may still meet the replica resyncing (Sentinel reconfigures the
        # server it sees come back): it is then unavailable, and the same call re-sent
        # is safe (the table's resend rows); what it answers is what is checked.
        # durability=replicas:1: the completed record survived; its retry replays it.
        again = _until("replay", lambda: ds.claim(ns, "kept", None, "aa02", LONG))
        assert isinstance(again, Done) and again.result == b"result-kept", (
            f"{again!r}, {time.monotonic() - kept_at:.1f} s after the completion; "
            f"failovers: {group.switches()}"
        )
        # The in-flight claim (replicated) is still its holder's to complete.
        assert _until("complete", lambda: ds.complete(ns, "flying", "bb01", b"late", LONG))
        # durability=none: the completion the replica never got is lost; the key can
        # be claimed again, with a higher fence.
        retry = ps.claim(ns, "gone", None, "cc02", LONG)
        assert isinstance(retry, Granted)
        seen.add("gone", retry.fence)  # above the lost claim's fence
        # Claims and durable writes work on the new primary.
        fresh = _until("claim", lambda: ds.claim(ns, "fresh", None, "dd01", LONG))
        assert isinstance(fresh, Granted)
        assert _until("complete", lambda: ds.complete(ns, "fresh", "dd01", b"x", LONG))
    finally:
        durable.close()
        plain.close()


async def test_failover_async(group: SentinelGroup) -> None:
    ns = _ns()
    durable = idemlock.aio.connect(group.url("durability=replicas:1&timeout=2"))
    plain = idemlock.aio.connect(group.url("timeout=2"))
    ds: Any = durable._store
    ps: Any = plain._store
    seen = Seen()
    lost = asyncio.Event()
    try:
        g = await ds.claim(ns, "kept", None, "aa01", LONG)
        assert isinstance(g, Granted)
        assert await ds.complete(ns, "kept", "aa01", b"result-kept", LONG)
        kept_at = time.monotonic()
        for _ in range(3):
            a = await ds.acquire(ns, "t", "me", LONG)
            seen.add("t", a.token)
            assert await ds.release(ns, "t", "me", a.token)
        locks = plain.lock(LockSpec(ns, ttl=timedelta(seconds=0.6)))
        holder = locks.hold(
            "held", renew_every=0.15, on_lost=lambda lease: lost.set(), cancel_on_lost=False
        )
        lease = await holder.__aenter__()
        seen.add("held", lease.token)
        await asyncio.to_thread(group.wait_in_sync)
        group.pause_replica()
        for _ in range(3):
            a = await ps.acquire(ns, "t", "me", LONG)
            seen.add("t", a.token)
            assert await ps.release(ns, "t", "me", a.token)
        g = await ps.claim(ns, "gone", None, "cc01", LONG)
        assert isinstance(g, Granted)
        seen.add("gone", g.fence)
        assert await ps.complete(ns, "gone", "cc01", b"result-gone", LONG)
        killed_at = time.monotonic()
        old = group.kill_primary()
        group.resume_replica()
        await asyncio.to_thread(group.wait_failover, old)

        first = await _until_async("acquire", lambda: ps.acquire(ns, "t", "me", LONG))
        FAILOVER_TIMES.append(time.monotonic() - killed_at)
        seen.add("t", first.token)
        await asyncio.wait_for(lost.wait(), RESUME_BOUND)
        with pytest.raises(LockLost):
            await holder.__aexit__(None, None, None)
        other = await _until_async("acquire held", lambda: ps.acquire(ns, "held", "o", LONG))
        seen.add("held", other.token)
        await asyncio.to_thread(group.rejoin, old, False)
        # As in test_failover_sync: a durable call may meet the replica resyncing.
        again = await _until_async("replay", lambda: ds.claim(ns, "kept", None, "aa02", LONG))
        assert isinstance(again, Done) and again.result == b"result-kept", (
            f"{again!r}, {time.monotonic() - kept_at:.1f} s after the completion; "
            f"failovers: {group.switches()}"
        )
        retry = await ps.claim(ns, "gone", None, "cc02", LONG)
        assert isinstance(retry, Granted)
        seen.add("gone", retry.fence)
        fresh = await _until_async("claim", lambda: ds.claim(ns, "fresh", None, "dd01", LONG))
        assert isinstance(fresh, Granted)
        assert await _until_async("complete", lambda: ds.complete(ns, "fresh", "dd01", b"x", LONG))
    finally:
        await durable.close()
        await plain.close()


def _coordinated_failover(group: SentinelGroup) -> int:
    """SENTINEL FAILOVER: the replica is promoted and the old primary, still running,
    becomes its replica (connections to it then meet READONLY, or are closed)."""
    old = group.primary_port
    with group.sentinels[0].client() as r:
        r.execute_command("SENTINEL", "FAILOVER", "ilsvc")
    group.wait_failover(old)
    # Until the Sentinels reconfigure the old primary it still takes writes (and loses
    # them when it is demoted: Sentinel's window, see docs/guarantees.md).
    group.wait_demoted(old)
    return old


def test_store_connections_follow_a_coordinated_failover(group: SentinelGroup) -> None:
    """The store's own connections (blocking free list; asyncio: one pipelined
    connection) reach the new primary after the old one is demoted, not killed."""
    ns = _ns()
    coord = idemlock.connect(group.url("timeout=2"))
    store: Any = coord._store
    assert store._direct  # the store's own connections, not redis-py's command layer

    async def on_loop() -> list[int]:
        acoord = idemlock.aio.connect(group.url("timeout=2"))
        astore: Any = acoord._store
        try:
            tokens = []
            for _ in range(3):  # several at once share the pipelined connection
                got = await asyncio.gather(
                    *(astore.acquire(ns, f"a{i}", "me", LONG) for i in range(5))
                )
                tokens += [g.token for g in got]
            assert astore._last.backend.pipe is not None  # the pipelined connection was used
            old = await asyncio.to_thread(_coordinated_failover, group)
            assert old != group.primary_port
            for i in range(5):
                a = await _until_async("acquire", lambda i=i: astore.acquire(ns, f"a{i}", "o", 1))
                assert isinstance(a, Held) or a.token > max(tokens)
            b = await _until_async("acquire", lambda: astore.acquire(ns, "b", "me", LONG))
            assert isinstance(b, Acquired) and b.token > max(tokens)
            return tokens
        finally:
            await acoord.close()

    try:
        first = store.acquire(ns, "k", "me", LONG)
        # The connection went where the Sentinels said (redis-py 8's send_packed_command
        # alone would connect to its default address, localhost:6379).
        assert [c.port for c in store._free] == [group.primary_port]
        asyncio.run(on_loop())
        # Demoted once already: the blocking store's pooled connection went to the
        # old primary; the next call reaches the new one.
        again = _until("acquire", lambda: store.acquire(ns, "k", "me", LONG))
        assert isinstance(again, Acquired) and again.token == first.token  # kept (replicated)
        other = _until("acquire", lambda: store.acquire(ns, "k2", "me", LONG))
        assert other.token > first.token
        assert {c.port for c in store._free} == {group.primary_port}
        with redis.Redis(port=group.primary_port) as r:
            assert r.info("replication")["role"] == "master"
    finally:
        coord.close()


def test_a_demoted_server_drops_the_pipelined_connection(group: SentinelGroup) -> None:
    """READONLY (a connection that reached a primary demoted since: here, straight to
    the replica) is StoreUnavailable within the bound, and the asyncio store drops its
    pipelined connection so the next call connects anew (to the primary the Sentinels
    name, with a Sentinel URL)."""
    url = f"redis://127.0.0.1:{group.replica.port}/0?timeout=2"

    async def on_loop() -> None:
        coord = idemlock.aio.connect(url)
        store: Any = coord._store
        try:
            with pytest.raises(StoreUnavailable, match="read-only replica"):
                await store.acquire(_ns(), "k", "me", LONG)
            pipe = store._last.backend.pipe
            assert pipe is not None and "READONLY" in str(pipe.lost)
        finally:
            await coord.close()

    asyncio.run(on_loop())
    coord = idemlock.connect(url)
    try:
        with pytest.raises(StoreUnavailable, match="read-only replica"):
            coord._store.acquire(_ns(), "k", "me", LONG)
    finally:
        coord.close()


def test_a_sentinel_client_passed_in(group: SentinelGroup) -> None:
    """redis-py's own Sentinel clients work as the store's client, sync and asyncio
    (and an asyncio one is refused on a second loop, with what to do instead)."""
    import redis.asyncio.sentinel
    import redis.sentinel

    ns = _ns()
    nodes = [("127.0.0.1", s.port) for s in group.sentinels]
    client = redis.sentinel.Sentinel(nodes, socket_timeout=2).master_for("ilsvc")
    coord = idemlock.connect(client)
    store: Any = coord._store
    try:
        a = store.acquire(ns, "k", "me", LONG)
        assert isinstance(a, Acquired)
        assert [c.port for c in store._free] == [group.primary_port]
    finally:
        coord.close()
        client.close()

    aclient = redis.asyncio.sentinel.Sentinel(nodes, socket_timeout=2).master_for("ilsvc")
    acoord = idemlock.aio.connect(aclient)

    async def use() -> Any:
        return await acoord._store.acquire(ns, "k", "me", LONG)

    async def close() -> None:
        await acoord.close()
        await aclose_client(aclient)

    b = asyncio.run(use())
    assert isinstance(b, Acquired) and b.token == a.token  # the same lease, the same owner
    with pytest.raises(ConfigurationError, match="redis\\+sentinel://"):
        asyncio.run(use())
    asyncio.run(close())


def test_durable_write_unmet_while_replica_stopped(group: SentinelGroup) -> None:
    """With the replica stopped, a durable completion is reported unacknowledged
    (StoreUnavailable naming the replica) within the bound; once the replica is back
    the same call is acknowledged."""
    ns = _ns()
    coord = idemlock.connect(group.url("durability=replicas:1&timeout=1"))
    store: Any = coord._store
    try:
        g = store.claim(ns, "k", None, "aa01", LONG)
        group.pause_replica()
        try:
            with pytest.raises(StoreUnavailable, match=r"1 replica\(s\) \(0 acknowledged\)"):
                store.complete(ns, "k", "aa01", b"r", LONG)
        finally:
            group.resume_replica()
        assert isinstance(g, Granted)
        # Re-sent (the same token and result): recognised, and now acknowledged.
        assert _until("complete", lambda: store.complete(ns, "k", "aa01", b"r", LONG))
    finally:
        coord.close()


def test_report_failover_times() -> None:
    """Not a check: prints what the failover tests above measured (pytest -s)."""
    if FAILOVER_TIMES:
        print(f"\nfailover, SIGKILL to first call: {[round(t, 2) for t in FAILOVER_TIMES]} s")
    assert all(t < RESUME_BOUND for t in FAILOVER_TIMES)
