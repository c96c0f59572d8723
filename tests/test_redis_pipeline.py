"""The asyncio Redis store's pipelined connection (stores/redis/_pipeline.py): many
concurrent calls share one connection, are written together and matched to their
replies by order. What must hold: every caller gets its own reply, whatever happens
mid-batch (a cancelled caller, a silent network, a restart, SCRIPT FLUSH, an error
reply); a connection whose replies can no longer be matched is dropped, failing the
calls on it with StoreUnavailable. Real servers throughout; run this file also with
``-p tests.no_hiredis`` (the pure-Python reply parser).
"""

from __future__ import annotations

import asyncio
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.exceptions

from idemlock import StoreCorrupt, StoreUnavailable
from idemlock._core.port import Acquired
from idemlock.stores.redis import AsyncRedisStore, _pipeline, _resp, from_client, open_async
from idemlock.stores.redis import _common as C
from idemlock.stores.redis._compat import aclose_client

from .servers.proxy import TcpProxy
from .servers.redis import RedisServer, free_port, start_redis, start_unix_redis
from .servers.tls import certs

LONG = 60_000


def _ns() -> str:
    return "pl" + uuid.uuid4().hex[:10]


def _store(url: str, **options: Any) -> AsyncRedisStore:
    store, _ = open_async(url, **options)
    assert isinstance(store, AsyncRedisStore)
    return store


def _pipe(store: AsyncRedisStore) -> _pipeline.Pipe:
    pipe = store._state().backend.pipe
    assert pipe is not None and pipe.lost is None
    return pipe


async def _fences(store: AsyncRedisStore, ns: str, n: int) -> None:
    """Resource ``r{i}`` with fence ``1000 + i``: a reply that names its caller."""
    got = await asyncio.gather(*(store.fence_advance(ns, f"r{i}", 1000 + i) for i in range(n)))
    assert got == [(True, 1000 + i) for i in range(n)]


def _count_writes(pipe: _pipeline.Pipe) -> list[int]:
    """Sizes of the pipe's socket writes, from now on."""
    sizes: list[int] = []
    transport: Any = pipe.transport
    write = transport.write

    def counted(data: bytes) -> None:
        sizes.append(len(data))
        write(data)

    transport.write = counted
    return sizes


@pytest.fixture
def own_server(tmp_path: Path) -> Any:
    server = start_redis(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()


# ---- many calls, one connection ------------------------------------------------------


@pytest.mark.parametrize("n", [100, 1000])
async def test_concurrent_calls_share_one_connection_and_get_their_own_replies(
    redis_server: RedisServer, n: int
) -> None:
    name = "pl" + uuid.uuid4().hex[:8]
    store, ns = _store(redis_server.url, client_name=name), _ns()
    try:
        await _fences(store, ns, n)
        await store.fence_current(ns, "r0")  # its script loaded
        writes = _count_writes(_pipe(store))
        got = await asyncio.gather(*(store.fence_current(ns, f"r{i}") for i in range(n)))
        assert got == [1000 + i for i in range(n)]
        # Queued in one event-loop turn, written in one go (the transport may still
        # split it on the wire: that is TCP's business).
        assert len(writes) == 1
        raw: Any = redis_server.client()
        try:
            assert sum(1 for c in raw.client_list() if c.get("name") == name) == 1
        finally:
            raw.close()
        # Mixed calls with replies of different shapes, interleaved.
        leases = await asyncio.gather(
            *(store.acquire(ns, f"k{i}", f"o{i}", LONG) for i in range(n))
        )
        assert all(isinstance(a, Acquired) for a in leases)
        rows = await asyncio.gather(
            *(
                store.lock(ns, f"k{i}") if i % 2 else store.fence_current(ns, f"r{i}")
                for i in range(n)
            )
        )
        for i, row in enumerate(rows):
            if i % 2:
                assert row is not None and not isinstance(row, int)
                assert row.owner == f"o{i}"
                assert row.token == leases[i].token  # type: ignore[union-attr]
            else:
                assert row == 1000 + i
    finally:
        await store.aclose()


async def test_a_unix_socket_url_and_a_passed_client_with_resp3_and_a_password() -> None:
    """The pipe takes redis-py's settings: a unix socket; a client of the user's with
    RESP3, decoded replies, a password and a database (the pipe speaks RESP2, raw)."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="pl") as tmp:
        server, url = start_unix_redis(Path(tmp))
        try:
            store, ns = _store(url), _ns()
            try:
                await _fences(store, ns, 50)
            finally:
                await store.aclose()
            raw: Any = server.client()
            raw.config_set("requirepass", "s3cret")
            raw.close()
            client = redis.asyncio.Redis(
                port=server.port, password="s3cret", db=3, protocol=3, decode_responses=True
            )
            passed, _ = from_client(client, asynchronous=True)
            assert isinstance(passed, AsyncRedisStore)
            try:
                await _fences(passed, ns, 50)
                assert _pipe(passed) is not None
                assert await client.exists(C.gate_name(ns, "r7").decode()) == 1  # db 3
            finally:
                await passed.aclose()
                await aclose_client(client)
        finally:
            server.stop()


async def test_a_rediss_url_with_a_password_a_database_and_a_name(tmp_path: Path) -> None:
    """The pipe opens its own TLS socket with the URL's settings: the CA it names
    (a server it cannot verify is refused), the password, the database, the name."""
    ca, cert, key = certs(tmp_path)
    tls_port = free_port()
    server = RedisServer(
        tmp_path / "redis",
        free_port(),
        ("--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file",
         str(key), "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no"),
    )  # fmt: skip
    server.start()
    try:
        raw: Any = server.client()
        raw.config_set("requirepass", "s3cret")
        raw.close()
        name = "pl" + uuid.uuid4().hex[:8]
        url = f"rediss://:s3cret@localhost:{tls_port}/2?ssl_ca_certs={ca}&client_name={name}"
        store, ns = _store(url), _ns()
        try:
            await _fences(store, ns, 50)
            assert _pipe(store).transport.get_extra_info("ssl_object") is not None
            check: Any = redis.Redis(port=server.port, password="s3cret", db=2)
            try:
                assert check.exists(C.gate_name(ns, "r7")) == 1
                names = [(c.get("name"), c.get("db")) for c in check.client_list()]
                assert names.count((name, "2")) == 1  # the pipe's connection
            finally:
                check.close()
        finally:
            await store.aclose()
        unverified = _store(f"rediss://:s3cret@localhost:{tls_port}/2")
        try:
            with pytest.raises(StoreUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
                await unverified.fence_current(ns, "r7")
        finally:
            await unverified.aclose()
    finally:
        server.stop()


async def test_a_cancelled_caller_mid_batch_leaves_the_others_their_replies(
    redis_server: RedisServer,
) -> None:
    store, ns = _store(redis_server.url), _ns()
    try:
        await _fences(store, ns, 300)
        tasks = [asyncio.ensure_future(store.fence_current(ns, f"r{i}")) for i in range(300)]
        await asyncio.sleep(0)  # all queued: the batch is being written
        for t in tasks[1::7]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for i, t in enumerate(tasks):
            if i % 7 == 1:
                assert t.cancelled()
            else:
                assert t.result() == 1000 + i
        # The cancelled callers' replies were read in turn: the next batch is in step.
        again = await asyncio.gather(*(store.fence_current(ns, f"r{i}") for i in range(300)))
        assert again == [1000 + i for i in range(300)]
    finally:
        await store.aclose()


async def test_acquires_cancelled_mid_batch_are_undone(redis_server: RedisServer) -> None:
    store, ns = _store(redis_server.url), _ns()
    try:
        await store.fence_current(ns, "warm")  # the pipe is open
        tasks = [
            asyncio.ensure_future(store.acquire(ns, f"k{i}", f"o{i}", LONG)) for i in range(200)
        ]
        await asyncio.sleep(0)
        for t in tasks[::2]:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for t in tasks[1::2]:
            assert isinstance(t.result(), Acquired)
        cancelled = [i for i, t in enumerate(tasks) if t.cancelled()]
        assert cancelled
        for _ in range(250):  # the undo runs in the background
            rows = await asyncio.gather(*(store.lock(ns, f"k{i}") for i in cancelled))
            if all(r is None for r in rows):
                break
            await asyncio.sleep(0.02)
        assert all(r is None for r in rows), "a cancelled acquire left its lock held"
        held = await asyncio.gather(*(store.lock(ns, f"k{i}") for i in range(1, 200, 2)))
        assert [r.owner if r else None for r in held] == [f"o{i}" for i in range(1, 200, 2)]
    finally:
        await store.aclose()


# ---- the connection dropped mid-batch --------------------------------------------------


async def test_a_silent_network_mid_batch_fails_every_pending_call_and_drops_it(
    redis_server: RedisServer,
) -> None:
    ns = _ns()
    with TcpProxy(redis_server.port) as proxy:
        # The timeout is what the blackholed calls wait; the others are answered in
        # milliseconds, and 2 s leaves them a wide margin on a busy machine.
        store = _store(f"redis://127.0.0.1:{proxy.port}/0", timeout=2)
        try:
            await _fences(store, ns, 100)
            pipe = _pipe(store)
            answered = [asyncio.ensure_future(store.fence_current(ns, "r1")) for _ in range(5)]
            assert await asyncio.gather(*answered) == [1001] * 5
            proxy.blackhole()
            got = await asyncio.gather(
                *(store.fence_current(ns, f"r{i}") for i in range(100)), return_exceptions=True
            )
            assert all(isinstance(g, StoreUnavailable) for g in got), got[:3]
            assert "timeout" in str(got[0])
            assert pipe.lost is not None and pipe.lost.stalled  # dropped, not reused
            proxy.heal()
            # A new connection: its replies are its own (the old one's late replies,
            # if any, died with it).
            again = await asyncio.gather(*(store.fence_current(ns, f"r{i}") for i in range(100)))
            assert again == [1000 + i for i in range(100)]
            assert _pipe(store) is not pipe
        finally:
            await store.aclose()


async def test_a_restart_mid_batch_never_gives_a_caller_another_s_reply(
    own_server: RedisServer,
) -> None:
    store, ns = _store(own_server.url, timeout=2), _ns()
    try:
        await _fences(store, ns, 500)
        pipe = _pipe(store)
        tasks = [asyncio.ensure_future(store.fence_current(ns, f"r{i}")) for i in range(500)]
        await asyncio.sleep(0)  # written: some answered, some not, when Redis dies
        own_server.stop()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        for i, out in enumerate(outcomes):
            assert out == 1000 + i or isinstance(out, StoreUnavailable), (i, out)
        assert pipe.lost is not None
        own_server.start()  # back, empty
        for _ in range(100):
            try:
                await store.fence_current(ns, "r0")
                break
            except StoreUnavailable:
                await asyncio.sleep(0.05)
        await _fences(store, ns, 200)
        got = await asyncio.gather(*(store.fence_current(ns, f"r{i}") for i in range(200)))
        assert got == [1000 + i for i in range(200)]
    finally:
        await store.aclose()


# ---- replies that refuse ---------------------------------------------------------------


async def test_script_flush_mid_batch_reloads_and_every_caller_gets_its_reply(
    redis_server: RedisServer,
) -> None:
    store, ns = _store(redis_server.url), _ns()
    try:
        await _fences(store, ns, 200)
        leases = await asyncio.gather(*(store.acquire(ns, f"k{i}", "o", LONG) for i in range(100)))
        pipe = _pipe(store)
        first = [asyncio.ensure_future(store.fence_current(ns, f"r{i}")) for i in range(100)]
        await asyncio.sleep(0)  # queued ahead of the flush
        pipe.send(_pipeline.pack(b"SCRIPT", b"FLUSH"))
        second = [asyncio.ensure_future(store.fence_current(ns, f"r{i}")) for i in range(100, 200)]
        # Releases after the flush, half of them cancelled before their NOSCRIPT comes
        # back: a release runs to its end anyway (loaded and sent again).
        releases = [
            asyncio.ensure_future(store.release(ns, f"k{i}", "o", lease.token))  # type: ignore[union-attr]
            for i, lease in enumerate(leases)
        ]
        await asyncio.sleep(0)
        for t in releases[::2]:
            t.cancel()
        assert await asyncio.gather(*first, *second) == [1000 + i for i in range(200)]
        done = await asyncio.gather(*releases, return_exceptions=True)
        assert all(d is True for d in done[1::2])
        for _ in range(250):
            rows = await asyncio.gather(*(store.lock(ns, f"k{i}") for i in range(100)))
            if all(r is None for r in rows):
                break
            await asyncio.sleep(0.02)
        assert all(r is None for r in rows), "a cancelled release did not run to its end"
    finally:
        await store.aclose()


async def test_error_replies_go_to_their_own_callers(redis_server: RedisServer) -> None:
    store, ns = _store(redis_server.url), _ns()
    raw: Any = redis_server.client()
    try:
        await _fences(store, ns, 200)
        bad = set(range(3, 200, 10))
        for i in bad:  # a gate holding a list: the script's GET is refused (WRONGTYPE)
            gate = C.gate_name(ns, f"r{i}")
            raw.delete(gate)
            raw.rpush(gate, b"x")
        pipe = _pipe(store)
        tasks = []
        raw_errs = []
        for i in range(200):
            tasks.append(asyncio.ensure_future(store.fence_current(ns, f"r{i}")))
            if i % 50 == 7:  # plain -ERR replies queued between the scripts
                raw_errs.append(pipe.send(_pipeline.pack(b"NO-SUCH-COMMAND", b"%d" % i)))
        got = await asyncio.gather(*tasks, return_exceptions=True)
        for i, out in enumerate(got):
            if i in bad:
                assert isinstance(out, StoreCorrupt), (i, out)
            else:
                assert out == 1000 + i, (i, out)
        for call in raw_errs:
            err = await call.fut
            assert isinstance(err, redis.exceptions.ResponseError)
            assert str(err).startswith("ERR unknown command")
        assert _pipe(store) is pipe  # error replies keep the connection in step
    finally:
        raw.close()
        await store.aclose()


# ---- the reply parser ------------------------------------------------------------------


RESP = (
    b"+OK\r\n:42\r\n$5\r\nhello\r\n$0\r\n\r\n$-1\r\n*-1\r\n*0\r\n"
    b"*3\r\n:1\r\n*2\r\n$1\r\na\r\n$-1\r\n-ERR nested\r\n"
    b"-NOSCRIPT No matching script\r\n:-7\r\n"
)
EXPECTED: list[Any] = [
    b"OK", 42, b"hello", b"", None, None, [], [1, [b"a", None], "ERR nested"],
    "NOSCRIPT No matching script", -7,
]  # fmt: skip
RESP3 = (
    b"_\r\n#t\r\n#f\r\n,1.5\r\n(123456789012345678901\r\n=8\r\ntxt:abcd\r\n"
    b"%1\r\n+k\r\n:1\r\n~2\r\n:1\r\n:2\r\n|1\r\n+a\r\n+b\r\n:9\r\n!3\r\nERR\r\n"
)
EXPECTED3: list[Any] = [
    None, 1, 0, 1.5, 123456789012345678901, b"abcd", {b"k": 1}, [1, 2], 9, "ERR",
]  # fmt: skip


def _plain(reply: Any) -> Any:
    if isinstance(reply, list):
        return [_plain(r) for r in reply]
    if isinstance(reply, Exception):
        assert isinstance(reply, redis.exceptions.ResponseError)
        return str(reply)
    return reply


def _all(reader: Any, data: bytes, step: int) -> list[Any]:
    out: list[Any] = []
    for i in range(0, len(data), step):
        reader.feed(data[i : i + step])
        while (r := reader.gets()) is not False:
            out.append(_plain(r))
    return out


@pytest.mark.parametrize("step", [1, 3, 1000])
def test_the_python_parser_reads_resp2_and_resp3_in_any_chunks(step: int) -> None:
    reader = _resp.Reader(redis.exceptions.ResponseError)
    assert _all(reader, RESP, step) == EXPECTED
    assert _all(reader, RESP3, step) == EXPECTED3
    with pytest.raises(_resp.ProtocolError):
        _all(_resp.Reader(redis.exceptions.ResponseError), b"?what\r\n", step)


def test_the_pipe_s_parser_reads_resp2_as_the_python_one() -> None:
    """hiredis when installed (the run with -p tests.no_hiredis uses the Python one)."""
    assert _all(_pipeline.new_reader(), RESP, 2) == EXPECTED
    try:
        import hiredis  # noqa: F401
    except ImportError:
        assert not _pipeline.HIREDIS
    else:
        assert _pipeline.HIREDIS
