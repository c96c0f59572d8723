"""The pipelined Redis backend (stores/redis/_pipeline.py) over a mock stream: an
in-memory transport under the store's own :class:`Pipe`, fed scripted RESP bytes.

This is idemlock's parser and reply matching over a fake socket, not a mock of Redis
(the real servers' behaviour is the contract suite's and test_redis_pipeline.py's):
what one write carries, which caller each reply goes to whatever the chunking, what a
connection closed mid-reply, a cancelled caller, a stray reply or bytes that are not
RESP do to the calls still waiting, and the handshake a new connection sends.
Each test runs with the reader the pipe uses (hiredis when installed) and with the
pure-Python one.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis.asyncio
import redis.exceptions
from redis.exceptions import ResponseError

from idemlock import StoreCorrupt, StoreUnavailable
from idemlock.stores.redis import AsyncRedisStore, _pipeline, _resp, from_client
from idemlock.stores.redis import _common as C
from idemlock.stores.redis._calls import noscript
from idemlock.stores.redis._clients import PipelinedClient, PlainClient
from idemlock.stores.redis._compat import aclose_client
from idemlock.stores.redis._pipeline import Call, Lost, Pipe, pack

#: replies, each whole, RESP2: an integer, a bulk string, a nil, an array, a status
REPLIES = [b":7\r\n", b"$3\r\nabc\r\n", b"$-1\r\n", b"*2\r\n:1\r\n$1\r\nx\r\n", b"+OK\r\n"]
DECODED = [7, b"abc", None, [1, b"x"], b"OK"]


class Stream:
    """The transport under a pipe: keeps what the pipe writes, delivers what a test
    feeds as if read from the socket, and closes as asyncio's do (connection_lost
    follows in a later turn)."""

    def __init__(self, pipe: Pipe) -> None:
        self.pipe = pipe
        self.writes: list[bytes] = []
        self.closed = False
        self.changed = asyncio.Event()  # set on every write and on closing
        pipe.connection_made(self)

    async def until(self, done: Callable[[], bool]) -> None:
        while not done():
            self.changed.clear()
            await self.changed.wait()

    def write(self, data: bytes) -> None:
        assert not self.closed, "a write after the transport closed"
        self.writes.append(bytes(data))
        self.changed.set()

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.changed.set()
            asyncio.get_running_loop().call_soon(self.pipe.connection_lost, None)

    close = abort

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def feed(self, data: bytes, step: int = 0) -> None:
        """``data`` as the socket would give it: whole, or in chunks of ``step`` bytes."""
        step = step or len(data)
        for i in range(0, len(data), step):
            self.pipe.data_received(data[i : i + step])


@pytest.fixture(params=["installed", "python"])
def reader(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The pipe's reader: hiredis when installed (else the Python one), or the Python
    one forced."""
    if request.param == "python":
        monkeypatch.setattr(_pipeline, "new_reader", lambda: _resp.Reader(ResponseError))
    return str(request.param)


def _pipe(timeout: float = 60.0) -> tuple[Pipe, Stream, list[tuple[Call, Any]]]:
    orphans: list[tuple[Call, Any]] = []
    pipe = Pipe(
        asyncio.get_running_loop(), timeout, lambda call, reply: orphans.append((call, reply))
    )
    return pipe, Stream(pipe), orphans


async def _written(stream: Stream, n: int = 1) -> None:
    """Until the pipe has written ``n`` times (the flush runs in a later loop turn)."""
    await stream.until(lambda: len(stream.writes) >= n)


def _cmd(i: int) -> bytes:
    return pack(b"ECHO", b"%d" % i)


# ---- one write, replies in order ---------------------------------------------------------


async def test_calls_of_one_turn_go_out_in_one_write_and_replies_match_in_order(
    reader: str,
) -> None:
    pipe, stream, orphans = _pipe()
    calls = [pipe.send(_cmd(i)) for i in range(len(REPLIES))]
    await _written(stream)
    assert stream.writes == [b"".join(_cmd(i) for i in range(len(REPLIES)))]
    stream.feed(b"".join(REPLIES))
    assert [c.fut.result() for c in calls] == DECODED
    # The next turn's calls: a write of their own.
    later = [pipe.send(_cmd(9)), pipe.send(_cmd(10))]
    await _written(stream, 2)
    assert stream.writes[1] == _cmd(9) + _cmd(10)
    stream.feed(b":9\r\n:10\r\n")
    assert [c.fut.result() for c in later] == [9, 10] and not orphans


@pytest.mark.parametrize("step", [1, 2, 3, 7])
async def test_partial_reads_resolve_each_call_only_once_its_reply_is_whole(
    reader: str, step: int
) -> None:
    pipe, stream, _ = _pipe()
    calls = [pipe.send(_cmd(i)) for i in range(len(REPLIES))]
    await _written(stream)
    data = b"".join(REPLIES)
    ends = [sum(len(r) for r in REPLIES[: i + 1]) for i in range(len(REPLIES))]
    for pos in range(0, len(data), step):
        stream.feed(data[pos : pos + step])
        fed = min(pos + step, len(data))
        assert [c.fut.done() for c in calls] == [end <= fed for end in ends]
    assert [c.fut.result() for c in calls] == DECODED


async def test_error_replies_go_to_their_own_callers_and_the_pipe_stays_up(reader: str) -> None:
    pipe, stream, _ = _pipe()
    calls = [pipe.send(_cmd(i)) for i in range(4)]
    await _written(stream)
    stream.feed(
        b":1\r\n-NOSCRIPT No matching script.\r\n-IDEMLOCK_CORRUPT not a record\r\n$2\r\nok\r\n"
    )
    first, missing, corrupt, last = (c.fut.result() for c in calls)
    assert first == 1 and last == b"ok"
    assert isinstance(missing, ResponseError) and noscript(missing)
    assert isinstance(corrupt, ResponseError) and str(corrupt).startswith("IDEMLOCK_CORRUPT")
    assert isinstance(C.store_error(corrupt, "claim"), StoreCorrupt)
    assert pipe.lost is None and not stream.closed


async def test_resp3_frames_are_read_by_the_python_reader_and_drop_the_pipe_otherwise(
    reader: str,
) -> None:
    """The pipe asks for RESP2; a RESP3 frame (a blob error, a map, a null) is still
    read by the Python reader, and hiredis (which cannot read them all) drops the
    connection rather than guess: every call on it fails, none gets another's reply."""
    pipe, stream, _ = _pipe()
    calls = [pipe.send(_cmd(i)) for i in range(4)]
    await _written(stream)
    stream.feed(b"!21\r\nSYNTAX invalid syntax\r\n%1\r\n+a\r\n:1\r\n_\r\n#t\r\n")
    replies = [c.fut.result() for c in calls]
    if reader == "python" or not _pipeline.HIREDIS:
        assert isinstance(replies[0], ResponseError) and str(replies[0]) == "SYNTAX invalid syntax"
        assert replies[1:] == [{b"a": 1}, None, 1]
        assert pipe.lost is None
    else:
        assert all(isinstance(r, Lost) and not r.stalled for r in replies)
        assert "out of step" in str(replies[0]) and stream.closed


# ---- losing the connection -----------------------------------------------------------------


@pytest.mark.parametrize("cut", [0, 1, 4, 9])
async def test_a_connection_closed_mid_reply_fails_every_pending_call(
    reader: str, cut: int
) -> None:
    pipe, stream, orphans = _pipe()
    calls = [pipe.send(_cmd(i)) for i in range(3)]
    await _written(stream)
    second = b"$10\r\n0123456789\r\n"
    stream.feed(b":1\r\n" + second[:cut])
    pipe.connection_lost(None)  # Redis closed it (or a reset: connection_lost(exc))
    assert calls[0].fut.result() == 1
    for call in calls[1:]:
        lost = call.fut.result()
        assert isinstance(lost, Lost) and not lost.stalled
        assert "closed by Redis" in str(lost)
    assert pipe.lost is not None and not orphans
    # Later calls are never written on it: they fail at once.
    after = pipe.send(_cmd(5))
    assert isinstance(after.fut.result(), Lost)
    await asyncio.sleep(0)
    assert len(stream.writes) == 1


async def test_a_reply_nothing_was_sent_for_or_bytes_not_resp_drop_the_pipe(reader: str) -> None:
    for stray in (b":1\r\n:2\r\n", b":1\r\n?what\r\n"):
        pipe, stream, _ = _pipe()
        call = pipe.send(_cmd(1))
        await _written(stream)
        if stray.endswith(b":2\r\n"):
            stream.feed(stray)  # the second reply has no call: out of step
            assert call.fut.result() == 1
        else:
            other = pipe.send(_cmd(2))
            stream.feed(stray)  # the first is fine, then garbage
            assert call.fut.result() == 1
            lost = other.fut.result()
            assert isinstance(lost, Lost) and "out of step" in str(lost)
        assert stream.closed and pipe.lost is not None
        assert "out of step" in str(pipe.lost)


async def test_an_overdue_reply_drops_the_pipe_as_stalled(reader: str) -> None:
    pipe, stream, _ = _pipe(timeout=0.01)
    calls = [pipe.send(_cmd(i)) for i in range(3)]
    await _written(stream)
    stream.feed(b":0\r\n")  # the first answered, then silence
    await stream.until(lambda: stream.closed)  # the watchdog dropped it
    assert calls[0].fut.result() == 0
    for call in calls[1:]:
        lost = call.fut.result()
        assert isinstance(lost, Lost) and lost.stalled
    assert stream.closed


# ---- a caller that stops waiting -----------------------------------------------------------


async def test_a_cancelled_caller_does_not_desync_the_others(reader: str) -> None:
    pipe, stream, orphans = _pipe()
    calls = [pipe.send(_cmd(i)) for i in range(5)]

    async def wait(call: Call) -> Any:
        return await call.fut

    tasks = [asyncio.ensure_future(wait(c)) for c in calls]
    await _written(stream)
    tasks[1].cancel()
    tasks[3].cancel()
    await asyncio.gather(tasks[1], tasks[3], return_exceptions=True)
    assert calls[1].fut.cancelled() and calls[3].fut.cancelled()
    stream.feed(b":0\r\n:1\r\n:2\r\n", step=3)
    stream.feed(b":3\r\n:4\r\n")
    assert [await tasks[i] for i in (0, 2, 4)] == [0, 2, 4]
    assert [(calls.index(c), r) for c, r in orphans] == [(1, 1), (3, 3)]
    # A cancelled caller's call still has its place when the connection goes.
    more = [pipe.send(_cmd(i)) for i in range(2)]
    more[0].fut.cancel()
    pipe.close()
    assert [calls.index(c) if c in calls else more.index(c) for c, _ in orphans[2:]] == [0]
    assert isinstance(orphans[2][1], Lost) and isinstance(more[1].fut.result(), Lost)


# ---- the handshake of a new connection -----------------------------------------------------


async def test_the_handshake_sends_the_settings_in_one_write_and_maps_refusals(
    reader: str,
) -> None:
    settings = redis.asyncio.Connection(username="u", password="p", db=3, client_name="me")
    pipe, stream, _ = _pipe()
    done = asyncio.ensure_future(_pipeline._handshake(pipe, settings))
    await _written(stream)
    assert stream.writes == [
        pack(b"AUTH", b"u", b"p") + pack(b"CLIENT", b"SETNAME", b"me") + pack(b"SELECT", b"3")
    ]
    stream.feed(b"+OK\r\n+OK\r\n+OK\r\n", step=2)
    await done
    # A refused AUTH: redis-py's AuthenticationError, which the store reports.
    pipe, stream, _ = _pipe()
    settings = redis.asyncio.Connection(password="wrong")
    done = asyncio.ensure_future(_pipeline._handshake(pipe, settings))
    await _written(stream)
    assert stream.writes == [pack(b"AUTH", b"wrong")]
    stream.feed(b"-WRONGPASS invalid username-password pair\r\n")
    with pytest.raises(redis.exceptions.AuthenticationError) as info:
        await done
    assert "authentication failed" in str(C.store_error(info.value, "connect"))
    # Nothing to say (no credentials, db 0, no name): nothing written.
    pipe, stream, _ = _pipe()
    await _pipeline._handshake(pipe, redis.asyncio.Connection())
    assert stream.writes == []


# ---- which backend ------------------------------------------------------------------------


class _OwnConnection(redis.asyncio.Connection):
    """A user's connection class: it may connect otherwise (through a proxy, say)."""


async def test_the_pipe_only_where_it_stands_for_redis_py_s_connections() -> None:
    pool = redis.asyncio.ConnectionPool
    cases = [
        (redis.asyncio.Redis(port=1), PipelinedClient),
        (redis.asyncio.Redis.from_url("unix:///nowhere.sock"), PipelinedClient),
        (redis.asyncio.Redis(port=1, ssl=True), PipelinedClient),
        (
            redis.asyncio.Redis(connection_pool=pool(port=1, connection_class=_OwnConnection)),
            PlainClient,
        ),
        (
            redis.asyncio.Redis(connection_pool=redis.asyncio.BlockingConnectionPool(port=1)),
            PlainClient,
        ),
        (redis.asyncio.Redis(port=1, single_connection_client=True), PlainClient),
    ]
    for client, kind in cases:
        store, _ = from_client(client, asynchronous=True)
        try:
            assert type(store._state().backend) is kind, client
        finally:
            await store.aclose()
            await aclose_client(client)


# ---- the store's flows over the mock stream ------------------------------------------------


async def _store_on(pipe: Pipe) -> AsyncRedisStore:
    """An asyncio store whose loop state has ``pipe`` as its pipelined connection (the
    client's address is never dialled while the pipe is up)."""
    client = redis.asyncio.Redis(host="127.0.0.1", port=1)
    store, _ = from_client(client, asynchronous=True)
    assert isinstance(store, AsyncRedisStore)
    backend = store._state().backend
    assert isinstance(backend, PipelinedClient)  # chosen for a plain pool's client
    backend.pipe = pipe
    backend.retries = False  # a dropped pipe fails the call (no reconnection to port 1)
    return store


async def test_the_store_s_calls_over_the_mock_stream(reader: str) -> None:
    pipe, stream, _ = _pipe()
    store = await _store_on(pipe)
    ns = "sm" + uuid.uuid4().hex[:8]
    try:
        got = asyncio.gather(*(store.fence_current(ns, f"r{i}") for i in range(3)))
        await _written(stream)
        assert stream.writes[0].count(b"EVALSHA") == 3  # three callers, one write
        assert C.FENCE_CURRENT.sha.encode() in stream.writes[0]
        stream.feed(b":10\r\n$-1\r\n:12\r\n", step=5)
        assert await got == [10, None, 12]
        # NOSCRIPT: the call did not run; once more as EVAL behind a SCRIPT LOAD.
        again = asyncio.ensure_future(store.fence_current(ns, "r0"))
        await _written(stream, 2)
        stream.feed(b"-NOSCRIPT No matching script.\r\n")
        await stream.until(lambda: len(stream.writes) >= 3 and b"EVAL" in stream.writes[-1])
        resent = b"".join(stream.writes[2:])
        assert b"SCRIPT" in resent and C.FENCE_CURRENT.text in resent
        stream.feed(b"$40\r\n" + C.FENCE_CURRENT.sha.encode() + b"\r\n:10\r\n")
        assert await again == 10
        # Data the script refuses: the store's error, the pipe still up.
        refused = asyncio.ensure_future(store.fence_current(ns, "r0"))
        await _written(stream, len(stream.writes) + 1)
        stream.feed(b"-IDEMLOCK_CORRUPT not a fence\r\n")
        with pytest.raises(StoreCorrupt):
            await refused
        assert pipe.lost is None
        # Closed mid-reply: every pending call fails with StoreUnavailable.
        n = len(stream.writes)
        pending = [asyncio.ensure_future(store.fence_current(ns, f"r{i}")) for i in range(3)]
        await _written(stream, n + 1)
        stream.feed(b":10\r\n$5\r\nab")
        pipe.connection_lost(ConnectionResetError(104, "reset"))
        results = await asyncio.gather(*pending, return_exceptions=True)
        assert results[0] == 10
        for failed in results[1:]:
            assert isinstance(failed, StoreUnavailable)
            assert "may have been applied" in str(failed)
    finally:
        await store.aclose()
