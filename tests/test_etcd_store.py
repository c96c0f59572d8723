"""What only the etcd store has: expiry by etcd's own lease clock, watches that wake
waiters, re-sent transactions after a lost reply, URLs, user/password auth, TLS,
corrupt values, fork, purge. The store's contract (tests/contract/) runs on the
single member and the 3-member cluster; the failover is tests/test_etcd_failover.py."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import grpc
import pytest

import idemlock
import idemlock.aio
from idemlock import (
    Claimed,
    Completed,
    ConfigurationError,
    IdempotencySpec,
    LockSpec,
    StoreUnavailable,
)
from idemlock.stores.etcd import _codec as K
from idemlock.stores.etcd._pb.etcdserverpb import rpc_pb2 as pb
from idemlock.stores.etcd._pb.etcdserverpb import rpc_pb2_grpc as stubs
from idemlock.stores.etcd._sync import EtcdStore

from .servers._proc import waitpid
from .servers.etcd import EtcdCluster, start_etcd
from .servers.tls import certs

LONG = LockSpec("e", ttl=timedelta(seconds=30))


def prefix() -> str:
    return "e" + uuid.uuid4().hex[:10]


# ---- expiry on etcd's clock --------------------------------------------------------------


def test_a_lease_ends_on_etcds_clock_never_before_its_ttl(etcd_server: EtcdCluster) -> None:
    p = prefix()
    a, b = (
        idemlock.connect(etcd_server.url, key_prefix=p),
        idemlock.connect(etcd_server.url, key_prefix=p),
    )
    try:
        spec = LockSpec("short", ttl=timedelta(seconds=1))
        holder = a.lock(spec).acquire("k")
        assert holder is not None and holder.token is not None
        t0 = time.monotonic()
        # Nobody releases and nothing in the test expires it: etcd's lessor does.
        taken = b.lock(spec).acquire("k", wait=10)
        waited = time.monotonic() - t0
        assert taken is not None and taken.token is not None and taken.token > holder.token
        # Mutual exclusion: the store freed it no earlier than the holder was told.
        assert waited >= 0.95, waited
        assert a.lock(spec).renew(holder) is False and holder.lost
    finally:
        a.close()
        b.close()


def test_late_completion_after_the_real_lease_ended(etcd_server: EtcdCluster) -> None:
    coord = idemlock.connect(etcd_server.url, key_prefix=prefix())
    try:
        port = coord.idempotency(IdempotencySpec("late", lease=timedelta(seconds=1)))
        claim = port.claim("k")
        assert isinstance(claim, Claimed)
        deadline = time.monotonic() + 10
        while port.status("k") is not None:  # the lease marker goes with etcd's lease
            assert time.monotonic() < deadline, "the claim's etcd lease did not end"
            time.sleep(0.1)
        port.complete(claim.token, {"ok": 1})  # accepted: nobody took the key over (A2)
        again = port.claim("k")
        assert isinstance(again, Completed) and again.result == {"ok": 1}
    finally:
        coord.close()


def test_purge_removes_in_flight_records_whose_lease_ended(etcd_server: EtcdCluster) -> None:
    p = prefix()
    coord = idemlock.connect(etcd_server.url, key_prefix=p)
    try:
        port = coord.idempotency(IdempotencySpec("purge", lease=timedelta(seconds=1)))
        claim = port.claim("gone")
        assert isinstance(claim, Claimed)
        live = port.claim("kept", lease=30)
        assert isinstance(live, Claimed)
        deadline = time.monotonic() + 10
        while port.status("gone") is not None:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert coord.purge() >= 1
        from idemlock import StaleClaim

        with pytest.raises(StaleClaim):  # the expired record is gone now
            port.complete(claim.token, 1)
        assert port.status("kept") is not None
    finally:
        coord.close()


# ---- watches ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_waiter_is_woken_by_the_watch(etcd_server: EtcdCluster, mode: str) -> None:
    p = prefix()
    holder_c = idemlock.connect(etcd_server.url, key_prefix=p)
    try:
        holder = holder_c.lock(LONG).acquire("k")
        assert holder is not None
        released: list[float] = []

        def release() -> None:
            time.sleep(0.3)
            released.append(time.monotonic())
            holder_c.lock(LONG).release(holder)

        timer = threading.Thread(target=release)
        timer.start()
        if mode == "sync":
            waiter = idemlock.connect(etcd_server.url, key_prefix=p)
            lease = waiter.lock(LONG).acquire("k", wait=10)
            got = time.monotonic()
            waiter.close()
        else:
            import asyncio

            async def wait() -> tuple[Any, float]:
                c = idemlock.aio.connect(etcd_server.url, key_prefix=p)
                try:
                    lease = await c.lock(LONG).acquire("k", wait=10)
                    return lease, time.monotonic()
                finally:
                    await c.close()

            lease, got = asyncio.run(wait())
        timer.join(timeout=60)
        assert not timer.is_alive(), "still running after 60 s"
        assert lease is not None and lease.token > holder.token
        # A waiter re-checks the store once a second at most; only the watch on the
        # lock's key wakes it sooner than that after the release.
        assert got - released[0] < 0.9, got - released[0]
    finally:
        holder_c.close()


# ---- a reply lost in a failover: the Txn is sent again ------------------------------------


def drive_twice(store: EtcdStore, op: Any, method: str = "Txn") -> Any:
    """Run an op, sending its first ``method`` call twice and throwing the first answer
    away: what a reply lost to a failover looks like (the driver then re-sends)."""
    deadline = time.monotonic() + 10
    value: Any = None
    first = True
    while True:
        try:
            rpc = op.send(value)
        except StopIteration as stop:
            return stop.value
        if rpc.background:
            store.client.background(rpc)
            value = None
            continue
        if first and rpc.method == method:
            store.client.call(rpc, deadline)  # applied; its reply "lost"
            rpc.retried = True
            first = False
        value = store.client.call(rpc, deadline)


def test_a_resent_transaction_is_recognised_never_applied_twice(
    etcd_server: EtcdCluster,
) -> None:
    store, _ = idemlock.stores.etcd.open_sync(etcd_server.url)
    ns = prefix()
    try:
        got = drive_twice(store, store.ops.acquire(ns, "k", "me", 30_000))
        assert isinstance(got, idemlock._core.port.Acquired)
        row = store.lock(ns, "k")
        assert row is not None and row.token == got.token and row.owner == "me"
        assert drive_twice(store, store.ops.release(ns, "k", "me", got.token)) is True
        assert store.lock(ns, "k") is None

        claim = drive_twice(store, store.ops.claim(ns, "c", "fp", "tok1", 30_000))
        assert isinstance(claim, idemlock._core.port.Granted)
        rec = store.record(ns, "c")
        assert rec is not None and rec.fence == claim.fence
        store.ops._claims.clear()  # also without the fence this process remembers
        assert drive_twice(store, store.ops.complete(ns, "c", "tok1", b"r", 60_000)) is True
        rec = store.record(ns, "c")
        assert rec is not None and rec.state == "completed" and rec.fence == claim.fence
        # The caller sending the same complete again is the table's complete.resend (it
        # succeeds, changing nothing); with another result it is stale (complete.stale).
        assert store.complete(ns, "c", "tok1", b"r", 60_000) is True
        assert store.complete(ns, "c", "tok1", b"other", 60_000) is False
        rec = store.record(ns, "c")
        assert rec is not None and rec.state == "completed" and rec.fence == claim.fence

        claim = drive_twice(store, store.ops.claim(ns, "d", None, "tok2", 30_000))
        assert drive_twice(store, store.ops.abandon(ns, "d", "tok2")) is True
        assert store.record(ns, "d") is None
    finally:
        store.close()


# ---- URLs and options -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "url, options",
    [
        ("etcd://", {}),
        ("etcd://127.0.0.1:notaport", {}),
        ("etcd://127.0.0.1:2379/path", {}),
        ("etcd://127.0.0.1:2379?bogus=1", {}),
        ("etcd://127.0.0.1:2379", {"bogus": 1}),
        ("etcd://127.0.0.1:2379?timeout=nan", {}),
        ("etcd://127.0.0.1:2379", {"timeout": -1}),
        ("etcd://127.0.0.1:2379", {"timeout": float("inf")}),
        ("etcd://127.0.0.1:2379?ca=/x", {}),
        ("etcd://user@127.0.0.1:2379", {}),
        ("etcds://127.0.0.1:2379?ca=/nonexistent/ca.pem", {}),
    ],
)
def test_bad_urls_and_options_are_configuration_errors(url: str, options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError):
        idemlock.connect(url, **options)


def test_timeout_option_and_several_endpoints(etcd_server: EtcdCluster) -> None:
    dead = "127.0.0.1:1"  # nothing listens: the store fails over to the next endpoint
    coord = idemlock.connect(f"etcd://{dead},{etcd_server.endpoints[0]}?timeout=2.5")
    try:
        assert coord.store.timeout == 2.5
        for _ in range(4):
            lease = coord.lock(LONG).acquire(prefix())
            assert lease is not None
    finally:
        coord.close()


def test_a_dead_store_is_unavailable_within_its_timeout() -> None:
    coord = idemlock.connect("etcd://127.0.0.1:1?timeout=0.5")
    try:
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):
            coord.lock(LONG).acquire("k")
        assert time.monotonic() - t0 < 2.0
    finally:
        coord.close()


def test_closing_after_failed_retries_leaves_no_grpc_thread_failing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The waits between retries poll the channel's readiness on a thread of gRPC's;
    closing the store right after (here: a member that answers every connection with
    a TLS alert) used to make that thread raise "Channel closed!"."""
    failed: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: failed.append(args.exc_value))
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def refuse() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = srv.accept()
                with conn:
                    conn.recv(100)
                    conn.sendall(b"\x15\x03\x01\x00\x02\x02\x28")  # TLS: handshake failure

    threading.Thread(target=refuse, daemon=True).start()
    # Only this test's: an earlier test of this worker may have left a poll of its own.
    before = {t for t in threading.enumerate() if t.name.endswith("(_run)")}
    try:
        for _ in range(2):
            coord = idemlock.connect(f"etcd://127.0.0.1:{port}?timeout=1")
            with pytest.raises(StoreUnavailable):
                coord.lock(LONG).acquire("k")
            coord.close()
        deadline = time.monotonic() + 10
        while any(t.name.endswith("(_run)") and t not in before for t in threading.enumerate()):
            assert time.monotonic() < deadline, "gRPC's polling threads never ended"
            time.sleep(0.02)
    finally:
        srv.close()
    assert failed == []


# ---- auth and TLS -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def auth_etcd() -> Iterator[EtcdCluster]:
    cluster = start_etcd(1)
    try:
        with grpc.insecure_channel(cluster.endpoints[0]) as ch:
            auth = stubs.AuthStub(ch)
            auth.UserAdd(pb.AuthUserAddRequest(name="root", password="s3cret"), timeout=10)
            auth.UserGrantRole(pb.AuthUserGrantRoleRequest(user="root", role="root"), timeout=10)
            auth.AuthEnable(pb.AuthEnableRequest(), timeout=10)
        yield cluster
    finally:
        cluster.destroy()


def test_user_and_password(auth_etcd: EtcdCluster) -> None:
    host = auth_etcd.endpoints[0]
    coord = idemlock.connect(f"etcd://root:s3cret@{host}", key_prefix=prefix())
    try:
        assert "s3cret" not in coord.url
        lease = coord.lock(LONG).acquire("k")
        assert lease is not None

        # a waiter's watch stream carries the token too
        def release() -> None:
            time.sleep(0.2)
            coord.lock(LONG).release(lease)

        t = threading.Thread(target=release)
        t.start()
        other = idemlock.connect(
            f"etcd://{host}", key_prefix=coord.key_prefix, user="root", password="s3cret"
        )
        try:
            assert other.lock(LONG).acquire("k", wait=5) is not None
        finally:
            other.close()
            t.join(timeout=60)
            assert not t.is_alive(), "still running after 60 s"
    finally:
        coord.close()
    bad = idemlock.connect(f"etcd://root:wrong@{host}?timeout=1", key_prefix=prefix())
    try:
        with pytest.raises(StoreUnavailable) as info:
            bad.lock(LONG).acquire("k")
        assert "wrong" not in str(info.value)
    finally:
        bad.close()
    anonymous = idemlock.connect(f"etcd://{host}?timeout=1", key_prefix=prefix())
    try:
        with pytest.raises(StoreUnavailable):
            anonymous.lock(LONG).acquire("k")
    finally:
        anonymous.close()


def test_tls(tmp_path: Path) -> None:
    files = certs(tmp_path)
    cluster = start_etcd(1, tls=files)
    try:
        url = f"etcds://{cluster.endpoints[0]}?ca={files[0]}"
        coord = idemlock.connect(url, key_prefix=prefix())
        try:
            port = coord.idempotency(IdempotencySpec("tls"))
            claim = port.claim("k")
            assert isinstance(claim, Claimed)
            port.complete(claim.token, "over TLS")
        finally:
            coord.close()
        # Plain text to a TLS member fails (bounded), it is never silently accepted.
        plain = idemlock.connect(f"etcd://{cluster.endpoints[0]}?timeout=1")
        try:
            with pytest.raises(StoreUnavailable):
                plain.lock(LONG).acquire("k")
        finally:
            plain.close()
    finally:
        cluster.destroy()


# ---- corrupt values, fork --------------------------------------------------------------------


def test_corrupt_values_are_listed_as_corrupt(etcd_server: EtcdCluster) -> None:
    p = prefix()
    coord = idemlock.connect(etcd_server.url, key_prefix=p)
    try:
        port = coord.idempotency(IdempotencySpec("c"))
        claim = port.claim("good")
        assert isinstance(claim, Claimed)
        assert coord.lock(LONG).acquire("good") is not None
        ns = claim.token._ns
        lock_ns = ns.rsplit(":", 1)[0] + ":e"
        with grpc.insecure_channel(etcd_server.endpoints[0]) as ch:
            kv = stubs.KVStub(ch)
            names = K.claim_names(K.ROOT, ns, "bad")
            kv.Put(pb.PutRequest(key=names.record, value=b"not ours"), timeout=5)
            kv.Put(pb.PutRequest(key=K.lock_name(K.ROOT, lock_ns, "bad"), value=b"\xff"), timeout=5)
        states = sorted(r.state for r in coord.keys())  # noqa: SIM118  (not a dict)
        assert states == ["corrupt", "in_flight"], states
        locks = coord.locks()
        assert len(locks) == 2 and sum(1 for x in locks if x.owner) == 1
        with pytest.raises(idemlock.StoreCorrupt):
            port.claim("bad")
    finally:
        coord.close()


def test_fork_child_opens_its_own_channels(etcd_server: EtcdCluster) -> None:
    p = prefix()
    coord = idemlock.connect(etcd_server.url, key_prefix=p)
    try:
        port = coord.idempotency(IdempotencySpec("fork"))
        assert isinstance(port.claim("parent-before"), Claimed)
        pid = os.fork()
        if pid == 0:  # the child: use the inherited coordinator, then leave at once
            code = 1
            try:
                got = port.claim("child")
                code = 0 if isinstance(got, Claimed) else 2
                port.complete(got.token, "from the child")  # type: ignore[union-attr]
            finally:
                os._exit(code)
        _, status = waitpid(pid)
        assert os.waitstatus_to_exitcode(status) == 0
        # The parent goes on working on its own channels.
        again = port.claim("child")
        assert isinstance(again, Completed) and again.result == "from the child"
        assert isinstance(port.claim("parent-after"), Claimed)
    finally:
        coord.close()


_FORK_SCRIPT = """
import os, sys, time
if sys.argv[2] == "idemlock-first":
    import idemlock.stores.etcd
import grpc
import idemlock.stores.etcd
print(os.environ.get("GRPC_ENABLE_FORK_SUPPORT"), flush=True)
channel = grpc.insecure_channel(sys.argv[1])
# a thread inside gRPC at the fork (connecting to a closed port), as the store's watch
# and retry threads often are
ready = grpc.channel_ready_future(channel)
try:
    ready.result(timeout=0.2)
except grpc.FutureTimeoutError:
    pass
codes = set()
for _ in range(20):  # the thread is inside gRPC at most forks, not at every one
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    codes.add(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    time.sleep(0.01)
print(*codes, flush=True)
"""


@pytest.mark.parametrize(
    ("order", "given", "shown"),
    [("idemlock-first", None, "false"), ("idemlock-first", "1", "1"), ("grpc-first", None, None)],
)
def test_grpc_fork_handlers_are_off_unless_the_user_or_grpc_decided(
    order: str, given: str | None, shown: str | None
) -> None:
    """gRPC's core runs its fork handlers by default (its Python layer does not); with
    a thread inside gRPC at a fork it skips them half-way, and a child could abort in
    them (one did, in the child of a Popen with user=, before its exec). The package
    turns them off at import, unless the user chose or gRPC was loaded first (the
    last case shows that this check sees the half-run handlers)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRPC_")}
    env |= {"GRPC_VERBOSITY": "debug", "GRPC_TRACE": "fork"}
    if given is not None:
        env["GRPC_ENABLE_FORK_SUPPORT"] = given
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        target = f"127.0.0.1:{s.getsockname()[1]}"
    done = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT, target, order],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    setting, *codes = done.stdout.split()
    assert setting == str(shown), done.stdout
    if given is None:  # the user's own choice is gRPC's to honour (grpcio 1.51's
        assert codes == ["7"], done.stdout  # children then exit 64, not 7)
    skipped = "skipping fork() handlers" in done.stderr
    assert skipped == (order == "grpc-first"), done.stderr[-2000:]


# ---- fair hand-off -------------------------------------------------------------------------


@pytest.mark.parametrize("url_of", ["etcd_server", "etcd_cluster"])
def test_waiters_get_the_lock_in_arrival_order(request: pytest.FixtureRequest, url_of: str) -> None:
    url = request.getfixturevalue(url_of).url
    p = prefix()
    holder_c = idemlock.connect(url, key_prefix=p)
    order: list[str] = []
    errors: list[BaseException] = []

    def wait_for_it(name: str) -> None:
        c = idemlock.connect(url, key_prefix=p)  # a process of its own: its own store
        try:
            lease = c.lock(LONG).acquire("fair", wait=20)
            assert lease is not None
            order.append(name)
            time.sleep(0.05)
            assert c.lock(LONG).release(lease)
        except BaseException as exc:
            errors.append(exc)
        finally:
            c.close()

    try:
        holder = holder_c.lock(LONG).acquire("fair")
        assert holder is not None
        threads = []
        for name in "ABCD":
            t = threading.Thread(target=wait_for_it, args=(name,))
            t.start()
            threads.append(t)
            time.sleep(0.4)  # each arrives (and queues) well after the one before
        # A newcomer that does not wait cannot barge in ahead of the queue, even when
        # the lock is free for a moment.
        assert holder_c.lock(LONG).release(holder)
        assert holder_c.lock(LONG).acquire("fair") is None
        for t in threads:
            t.join(30)
        assert not errors, errors
        assert order == list("ABCD"), order
    finally:
        holder_c.close()


def test_a_cancelled_waiter_whose_attempt_lands_late_gives_its_queue_place_back(
    fault_etcd_server: EtcdCluster,
) -> None:
    """A waiter cancelled while its first queued attempt is on the wire: its caller has
    already left the lock's watch (no place known to give back) when the attempt lands
    and queues the process. The attempt's undo gives that place back; else every other
    process's acquire of the free lock is refused until the place expires (seconds)."""
    import asyncio

    from idemlock._core.port import Acquired, Channel, Held
    from idemlock.stores.etcd import open_async

    from .servers.etcd import EtcdFaults

    faults = EtcdFaults(fault_etcd_server)
    p = prefix() + "/"

    async def scenario() -> float:
        waiter, _ = open_async(faults.url, prefix=p)
        other, _ = open_async(fault_etcd_server.url, prefix=p)
        try:
            held = await other.acquire("ns", "k", "holder:1", 30_000)
            assert isinstance(held, Acquired)
            sub = await waiter.subscribe(Channel("lock", "ns", "k"))
            with faults.stall():
                attempt = asyncio.ensure_future(waiter.acquire("ns", "k", "waiter:1", 30_000))
                await asyncio.sleep(0.3)  # its Txn waits in the silent proxy
                assert not attempt.done()
                attempt.cancel()
                await sub.aclose()  # the caller's flow leaves the watch as it unwinds
            # Healed: the Txn lands, finds the lock held and queues this process.
            with pytest.raises(asyncio.CancelledError):
                await attempt
            await asyncio.sleep(0.5)  # the shielded attempt goes on and ends meanwhile
            assert await other.release("ns", "k", "holder:1", held.token)
            start = time.monotonic()
            while True:
                got = await other.acquire("ns", "k", "checker:1", 30_000)
                if isinstance(got, Acquired):
                    return time.monotonic() - start
                assert isinstance(got, Held)
                assert time.monotonic() - start < 5, "the free lock stayed refused"
                await asyncio.sleep(0.02)
        finally:
            await waiter.aclose()
            await other.aclose()
            faults.close()

    # Without the undo the stranded place refuses it for WAITER_S (3 s).
    took = asyncio.run(scenario())
    assert took < 1.0, took


def test_a_cancelled_subscribe_does_not_leave_the_process_waiting(
    fault_etcd_server: EtcdCluster,
) -> None:
    """A caller cancelled while its watch waits to be confirmed (a silent network): its
    subscription is removed. Kept, it would count the process as waiting on the lock for
    good, and every one-shot try would queue it, refusing other processes the free lock
    for seconds."""
    import asyncio

    from idemlock._core.port import Acquired, Channel, Held
    from idemlock.stores.etcd import open_async

    from .servers.etcd import EtcdFaults

    faults = EtcdFaults(fault_etcd_server)
    p = prefix() + "/"

    async def scenario() -> float:
        store, _ = open_async(faults.url, prefix=p)
        other, _ = open_async(fault_etcd_server.url, prefix=p)
        try:
            held = await other.acquire("ns", "k", "holder:1", 30_000)
            assert isinstance(held, Acquired)
            assert isinstance(await store.acquire("ns", "k", "warm:1", 30_000), Held)
            with faults.stall():
                task = asyncio.ensure_future(store.subscribe(Channel("lock", "ns", "k")))
                await asyncio.sleep(0.3)  # waiting for the watch's confirmation
                assert not task.done()
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            # Healed: a one-shot try, refused; it must not queue this process.
            assert isinstance(await store.acquire("ns", "k", "try-once:1", 30_000), Held)
            assert await other.release("ns", "k", "holder:1", held.token)
            start = time.monotonic()
            while not isinstance(await other.acquire("ns", "k", "next:1", 30_000), Acquired):
                assert time.monotonic() - start < 5, "the free lock stayed refused"
                await asyncio.sleep(0.02)
            return time.monotonic() - start
        finally:
            await store.aclose()
            await other.aclose()
            faults.close()

    took = asyncio.run(scenario())
    assert took < 1.0, took


class _RpcError(Exception):
    """What grpc raises: a status code and details (an error value, not a store)."""

    def __init__(self, code: object, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> object:
        return self._code

    def details(self) -> str:
        return self._details


def test_a_members_own_request_timeout_is_an_unknown_outcome_sent_again() -> None:
    """Under load a member answers UNKNOWN "context deadline exceeded" when its own wait
    for the apply runs out: the write may have landed, so it is re-sent (with the
    outcome-unknown re-read), not failed (a 1,000-call burst lost 3 calls to it)."""
    import grpc

    from idemlock.stores.etcd import _conf

    unknown = grpc.StatusCode.UNKNOWN
    assert _conf.classify(_RpcError(unknown, "context deadline exceeded")) == _conf.RETRY
    assert _conf.classify(_RpcError(unknown, "etcdserver: request timed out")) == _conf.RETRY
    assert _conf.classify(_RpcError(unknown, "some answer")) == _conf.FAIL
    invalid = grpc.StatusCode.INVALID_ARGUMENT
    assert _conf.classify(_RpcError(invalid, "deadline exceeded")) == _conf.FAIL


# ---- permits: a key many may hold (counted leases) -----------------------------------------


def _events(endpoint: str, name: bytes, start: int, until: bytes) -> list[Any]:
    """Every event on the permits of the lock key ``name`` from revision ``start`` on,
    up to the put of the key ``until`` (a marker written last), from etcd's history."""
    from idemlock.stores.etcd._pb.mvccpb import kv_pb2

    stop = threading.Event()
    create = pb.WatchCreateRequest(key=name, range_end=K.lock_end(name), start_revision=start)

    def requests() -> Iterator[Any]:
        yield pb.WatchRequest(create_request=create)
        stop.wait(60)

    out: list[Any] = []
    with grpc.insecure_channel(endpoint) as ch:
        stream = stubs.WatchStub(ch).Watch(requests(), timeout=60)
        try:
            for resp in stream:
                for ev in resp.events:
                    if ev.kv.key == until and ev.type == kv_pb2.Event.PUT:
                        return out
                    out.append(ev)
        finally:
            stop.set()
            stream.cancel()
    raise AssertionError("the marker was not seen")


def test_racing_callers_with_mixed_limits_never_over_grant(etcd_server: EtcdCluster) -> None:
    """Threads, each with a store of its own (a process each), take and give back
    permits of one key with limits 1, 2 and 3 at once. etcd's history of the key's
    permits is then replayed: no grant ever found as many live holders as its caller's
    limit (a limit-1 caller counts the permits of limit-3 callers too), and no owner
    ever held two permits."""
    from idemlock._core.port import Acquired, Held
    from idemlock.stores.etcd import open_sync
    from idemlock.stores.etcd._pb.mvccpb import kv_pb2

    ns, rounds = prefix(), 25
    limits = [1, 2, 2, 3, 3, 3, 3, 3, 3]
    stores = [open_sync(etcd_server.url)[0] for _ in limits]
    name = K.lock_name(K.ROOT, ns, "k")
    with grpc.insecure_channel(etcd_server.endpoints[0]) as ch:
        kv = stubs.KVStub(ch)
        first = int(kv.Range(pb.RangeRequest(key=name), timeout=5).header.revision) + 1
    barrier = threading.Barrier(len(limits))
    grants = [0] * len(limits)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        store, owner = stores[i], f"L{limits[i]}-t{i}"
        try:
            barrier.wait(30)
            for _ in range(rounds):
                got = store.acquire(ns, "k", owner, 30_000, limits[i])
                if isinstance(got, Acquired):
                    grants[i] += 1
                    assert len(store.holders(ns, "k")) <= 3
                    assert store.release(ns, "k", owner, got.token)
                else:
                    assert isinstance(got, Held)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(limits))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "still running after 120 s"
        assert not errors, errors
        marker = name + b"\0~marker"
        with grpc.insecure_channel(etcd_server.endpoints[0]) as ch:
            stubs.KVStub(ch).Put(pb.PutRequest(key=marker, value=b""), timeout=5)
        live: dict[bytes, str] = {}
        peak = created = 0
        for ev in _events(etcd_server.endpoints[0], name, first, marker):
            if ev.type == kv_pb2.Event.DELETE:
                live.pop(ev.kv.key, None)
                continue
            if ev.kv.version != 1:
                continue  # a permit written again (renewed), not a new one
            owner = K.parse_lock(ev.kv.value).owner
            limit = int(owner.split("-")[0][1:])
            assert len(live) < limit, (owner, sorted(live.values()))
            assert owner not in live.values(), owner
            live[ev.kv.key] = owner
            created += 1
            peak = max(peak, len(live))
        assert created == sum(grants) and not live
        # Permits were held side by side (a limit-1 caller, which needs the key empty,
        # may get none while the others keep it busy).
        assert sum(grants) > 0 and peak >= 2, (grants, peak)
    finally:
        for s in stores:
            s.close()


def _old_lock_value(owner: str, ttl_ms: int) -> bytes:
    """A lock value as the previous releases write it (kind, owner, NUL, 3 times)."""
    raw = owner.encode()
    return (
        b"L"
        + len(raw).to_bytes(2, "big")
        + raw
        + b"\0"
        + (K.now_ms()).to_bytes(8, "big")
        + (ttl_ms.to_bytes(8, "big") + (30).to_bytes(8, "big"))
    )


def test_a_lock_of_the_previous_release_and_of_this_one_exclude_each_other(
    etcd_server: EtcdCluster,
) -> None:
    """During an upgrade both releases run: a lock is the same etcd key with the same
    value in both, so each sees the other's holder (the previous release took a lock
    with a Txn that requires the lock key not to exist)."""
    from idemlock._core.port import Acquired, Held
    from idemlock.stores.etcd import open_sync

    store, _ = open_sync(etcd_server.url)
    ns = prefix()
    name = K.lock_name(K.ROOT, ns, "k")

    def old_acquire(kv: Any, owner: str) -> bool:
        put = pb.RequestOp(
            request_put=pb.PutRequest(key=name, value=_old_lock_value(owner, 30_000))
        )
        txn = pb.TxnRequest(
            compare=[pb.Compare(key=name, target=pb.Compare.CREATE, create_revision=0)],
            success=[put],
        )
        return bool(kv.Txn(txn, timeout=5).succeeded)

    try:
        with grpc.insecure_channel(etcd_server.endpoints[0]) as ch:
            kv = stubs.KVStub(ch)
            # The previous release holds it: this one's lock is refused, a semaphore's
            # permit counts it as one holder.
            assert old_acquire(kv, "old:1")
            assert isinstance(store.acquire(ns, "k", "new:1", 30_000), Held)
            row = store.lock(ns, "k")
            assert row is not None and row.owner == "old:1"
            two = store.acquire(ns, "k", "sem:1", 30_000, 2)
            assert isinstance(two, Acquired) and two.token > row.token
            assert [r.owner for r in store.holders(ns, "k")] == ["old:1", "sem:1"]
            assert store.release(ns, "k", "sem:1", two.token)
            assert store.release(ns, "k", "old:1", row.token)  # same key, same value shape
            # This release holds it: the very key and value the previous one writes.
            mine = store.acquire(ns, "k", "new:1", 30_000)
            assert isinstance(mine, Acquired)
            got = kv.Range(pb.RangeRequest(key=name, range_end=K.lock_end(name)), timeout=5).kvs
            assert [x.key for x in got] == [name] and int(got[0].create_revision) == mine.token
            old = _old_lock_value("new:1", 30_000)
            assert len(got[0].value) == len(old) and got[0].value[:-24] == old[:-24]
            assert not old_acquire(kv, "old:2")
            assert store.release(ns, "k", "new:1", mine.token)
            assert old_acquire(kv, "old:2")
            kv.DeleteRange(pb.DeleteRangeRequest(key=name), timeout=5)
    finally:
        store.close()


def test_a_freed_permit_goes_to_the_process_waiting_longest(etcd_server: EtcdCluster) -> None:
    from idemlock._core.port import Acquired, Channel, Held
    from idemlock.stores.etcd import open_sync

    holder, waiter, newcomer = (open_sync(etcd_server.url)[0] for _ in range(3))
    ns = prefix()
    try:
        a = holder.acquire(ns, "k", "a", 30_000, 2)
        b = holder.acquire(ns, "k", "b", 30_000, 2)
        assert isinstance(a, Acquired) and isinstance(b, Acquired)
        sub = waiter.subscribe(Channel("lock", ns, "k"))
        try:
            for _ in range(2):  # as a waiting acquire does: it queues the process
                assert isinstance(waiter.acquire(ns, "k", "w", 30_000, 2), Held)
            assert holder.release(ns, "k", "a", a.token)
            assert sub.wait(10)  # the watch of the key's permits saw one freed
            # Room for one, kept for the process that waited: a newcomer is refused.
            assert isinstance(newcomer.acquire(ns, "k", "n", 30_000, 2), Held)
            got = waiter.acquire(ns, "k", "w", 30_000, 2)
            assert isinstance(got, Acquired) and got.token > b.token
        finally:
            sub.close()
        assert holder.release(ns, "k", "b", b.token)
        # Nobody queues any more: the newcomer gets the freed permit.
        deadline = time.monotonic() + 10
        while not isinstance(newcomer.acquire(ns, "k", "n", 30_000, 2), Acquired):
            assert time.monotonic() < deadline, "the queue kept the permit"
            time.sleep(0.05)
    finally:
        for s in (holder, waiter, newcomer):
            s.close()


def test_a_resent_permit_transaction_is_recognised(etcd_server: EtcdCluster) -> None:
    from idemlock._core.port import Acquired

    store, _ = idemlock.stores.etcd.open_sync(etcd_server.url)
    ns = prefix()
    try:
        other = store.acquire(ns, "k", "other", 30_000, 3)
        assert isinstance(other, Acquired)
        got = drive_twice(store, store.ops.acquire(ns, "k", "me", 30_000, 3, b"v1"))
        assert isinstance(got, Acquired) and got.token > other.token
        rows = {r.owner: r for r in store.holders(ns, "k")}
        assert set(rows) == {"other", "me"} and rows["me"].token == got.token
        assert rows["me"].value == b"v1"
        # A renew without a value keeps the published one (read, then written back).
        exp = drive_twice(store, store.ops.renew(ns, "k", "me", got.token, 60_000))
        assert exp is not None and exp > got.expires_ms
        rows = {r.owner: r for r in store.holders(ns, "k")}
        assert rows["me"].value == b"v1" and rows["me"].expires_ms == exp
        assert drive_twice(store, store.ops.release(ns, "k", "me", got.token)) is True
        assert [r.owner for r in store.holders(ns, "k")] == ["other"]
    finally:
        store.close()


# ---- steps inside a claim ---------------------------------------------------------------------


def _under(etcd: EtcdCluster, base: bytes) -> dict[bytes, bytes]:
    """Every etcd key under ``base`` and its value, read past the store."""
    with grpc.insecure_channel(etcd.endpoints[0]) as ch:
        resp = stubs.KVStub(ch).Range(
            pb.RangeRequest(key=base, range_end=K.prefix_end(base)), timeout=5
        )
    return {bytes(kv.key): bytes(kv.value) for kv in resp.kvs}


def test_steps_are_keys_beside_the_claim_record(etcd_server: EtcdCluster) -> None:
    store, _ = idemlock.stores.etcd.open_sync(etcd_server.url)
    ns = prefix()
    n = K.claim_names(K.ROOT, ns, "k")
    try:
        g = store.claim(ns, "k", None, "t1", 30_000)
        assert isinstance(g, idemlock._core.port.Granted) and g.steps == ()
        assert store.step(ns, "k", "t1", "charge", b"ch_1", 30_000, 60_000) is not None
        assert store.step(ns, "k", "t1", "mail/x", None, 30_000, 60_000) is not None
        # One key per step under the claim's prefix, and their end beside them.
        keys = _under(etcd_server, n.base)
        assert set(keys) == {n.record, n.marker, n.steps, n.step("charge"), n.step("mail/x")}
        assert keys[n.step("charge")] == K.step_value(g.fence, b"ch_1")
        assert K.parse_step(keys[n.step("mail/x")]) == (g.fence, None)
        assert K.parse_steps_end(keys[n.steps]) > K.now_ms() + 30_000
        # A listing sees one record, not the steps as corrupt keys of their own.
        assert [(r.key, r.state) for r in store.records(ns)] == [("k", "in_flight")]
        # A re-sent step (its reply lost) is applied once: the same step.
        op = store.ops.step(ns, "k", "t1", "charge", b"ch_1", 30_000, 60_000)
        assert drive_twice(store, op) is not None
        assert sorted(s.name for s in store.steps(ns, "k")) == ["charge", "mail/x"]
        # forget drops the steps with the record, in its one Txn.
        assert store.forget(ns, "k")
        assert _under(etcd_server, n.base) == {}
    finally:
        store.close()


def test_steps_whose_end_passed_are_never_revived_and_purge_drops_them(
    etcd_server: EtcdCluster,
) -> None:
    store, _ = idemlock.stores.etcd.open_sync(etcd_server.url)
    ns = prefix()
    n = K.claim_names(K.ROOT, ns, "k")
    try:
        assert isinstance(store.claim(ns, "k", None, "t1", 30_000), idemlock._core.port.Granted)
        assert store.step(ns, "k", "t1", "old", b"1", 30_000, 1) is not None  # ends at once
        deadline = time.monotonic() + 10
        while store.steps(ns, "k"):
            assert time.monotonic() < deadline, "a step outlived its end"
            time.sleep(0.01)
        # The next step starts afresh: the old one is deleted, not carried along.
        assert store.step(ns, "k", "t1", "new", b"2", 30_000, 60_000) is not None
        assert [s.name for s in store.steps(ns, "k")] == ["new"]
        assert n.step("old") not in _under(etcd_server, n.base)
        # The next attempt's grant carries the live ones.
        assert store.abandon(ns, "k", "t1")
        g = store.claim(ns, "k", None, "t2", 30_000)
        assert isinstance(g, idemlock._core.port.Granted) and [s.name for s in g.steps] == ["new"]
        # Steps that ended (here after an abandon) are dropped by purge, with their end.
        p = K.claim_names(K.ROOT, ns, "p")
        assert isinstance(store.claim(ns, "p", None, "t3", 30_000), idemlock._core.port.Granted)
        assert store.step(ns, "p", "t3", "s", b"1", 30_000, 1) is not None
        assert store.abandon(ns, "p", "t3")
        deadline = time.monotonic() + 10
        while store.steps(ns, "p"):
            assert time.monotonic() < deadline, "a step outlived its end"
            time.sleep(0.01)
        assert set(_under(etcd_server, p.base)) == {p.steps, p.step("s")}
        store.purge()
        assert _under(etcd_server, p.base) == {}
        assert [s.name for s in store.steps(ns, "k")] == ["new"]  # live ones are kept
    finally:
        store.close()


def test_a_foreign_step_value_is_store_corrupt(etcd_server: EtcdCluster) -> None:
    store, _ = idemlock.stores.etcd.open_sync(etcd_server.url)
    ns = prefix()
    n = K.claim_names(K.ROOT, ns, "k")
    try:
        assert isinstance(store.claim(ns, "k", None, "t1", 30_000), idemlock._core.port.Granted)
        assert store.step(ns, "k", "t1", "a", b"1", 30_000, 60_000) is not None
        with grpc.insecure_channel(etcd_server.endpoints[0]) as ch:
            stubs.KVStub(ch).Put(pb.PutRequest(key=n.step("a"), value=b"not ours"), timeout=5)
        with pytest.raises(idemlock.StoreCorrupt):
            store.steps(ns, "k")
        assert store.abandon(ns, "k", "t1")
        with pytest.raises(idemlock.StoreCorrupt):
            store.claim(ns, "k", None, "t2", 30_000)  # a grant carries the steps
        # The listing still reads the record (the steps are not listed).
        assert [r.key for r in store.records(ns)] == ["k"]
        with grpc.insecure_channel(etcd_server.endpoints[0]) as ch:
            stubs.KVStub(ch).Put(pb.PutRequest(key=n.steps, value=b"E"), timeout=5)
        with pytest.raises(idemlock.StoreCorrupt):
            store.steps(ns, "k")
    finally:
        store.close()


def test_a_step_write_does_not_wake_the_claims_waiters(etcd_server: EtcdCluster) -> None:
    from idemlock._core.port import Channel

    store, _ = idemlock.stores.etcd.open_sync(etcd_server.url)
    ns = prefix()
    try:
        assert isinstance(store.claim(ns, "k", None, "t1", 30_000), idemlock._core.port.Granted)
        assert isinstance(store.claim(ns, "other", None, "t2", 30_000), idemlock._core.port.Granted)
        # Both waits on the one watch stream of this store: etcd sends its events in
        # revision order, so once the later write on "other" woke its waiter, any
        # event of the step writes before it has been handled too.
        waiter = store.subscribe(Channel("claim", ns, "k"))
        later = store.subscribe(Channel("claim", ns, "other"))
        try:
            assert store.step(ns, "k", "t1", "a", b"1", 30_000, 60_000) is not None
            assert store.step(ns, "k", "t1", "b", None, 30_000, 60_000) is not None
            assert store.drop_step(ns, "k", "t1", "b", 30_000) is not None
            assert store.complete(ns, "other", "t2", b"1", 60_000)
            assert later.wait(10)
            assert not waiter.wait(0), "a step write woke the claim's waiter"
            # A freeing of the claim does wake it.
            assert store.abandon(ns, "k", "t1")
            assert waiter.wait(10)
        finally:
            waiter.close()
            later.close()
    finally:
        store.close()


def test_the_gateway_watch_also_ignores_the_claims_marker_puts(etcd_server: EtcdCluster) -> None:
    """A forked child watches over the JSON gateway: the replies etcd sends there for a
    step (a put of the claim's marker) wake nobody, a freeing does."""
    import base64
    import http.client
    import json

    from idemlock._core.port import Channel
    from idemlock.stores.etcd._gateway import json_wakes
    from idemlock.stores.etcd._watches import quiet_key, watch_range

    store, _ = idemlock.stores.etcd.open_sync(etcd_server.url)
    ns = prefix()
    key, end = watch_range(K.ROOT, Channel("claim", ns, "k"))
    quiet = quiet_key(Channel("claim", ns, "k"), end)
    assert quiet == K.claim_names(K.ROOT, ns, "k").marker
    b64 = base64.b64encode
    host, port = etcd_server.endpoints[0].rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        create = {"create_request": {"key": b64(key).decode(), "range_end": b64(end).decode()}}
        conn.request("POST", "/v3/watch", body=json.dumps(create).encode())
        resp = conn.getresponse()
        assert json.loads(resp.readline())["result"]["created"]
        assert isinstance(store.claim(ns, "k", None, "t1", 30_000), idemlock._core.port.Granted)
        claimed = json.loads(resp.readline())["result"]["events"]
        assert json_wakes(b64(quiet).decode(), claimed)  # the record written: a change
        assert store.step(ns, "k", "t1", "a", b"1", 30_000, 60_000) is not None
        stepped = json.loads(resp.readline())["result"]["events"]
        assert [base64.b64decode(e["kv"]["key"]) for e in stepped] == [quiet]
        assert not json_wakes(b64(quiet).decode(), stepped)
        assert store.abandon(ns, "k", "t1")
        freed = json.loads(resp.readline())["result"]["events"]
        assert json_wakes(b64(quiet).decode(), freed)
    finally:
        conn.close()
        store.close()
