"""A SQLite lock waiter in another process is woken when the lock is reserved for it,
instead of finding out at its next poll; and what another local user can do to those
wake-ups (docs/threat-model.md): send the listener anything (it survives and drops it),
squat the name a waiter would use (it cannot be guessed), read a wake-up (it carries
only a keyed tag).

The waiters here are processes whose polls are pushed past their whole wait (and the
holder's lease outlives it): only a wake-up can hand them the lock while their turn's
window is open, so without wake-ups they time out and the test fails. No timing
asserts: the waits are long, and only who got the lock, in which order, is checked.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import sqlite3
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import idemlock
from idemlock import LockSpec
from idemlock.stores.sqlite import _wake

pytestmark = pytest.mark.skipif(not _wake.SUPPORTED, reason="abstract sockets are Linux's")

SPEC = "L"
WAIT = 15.0  # each waiter's whole wait: far longer than a hand-off
#: ms a released lock stays reserved for the next waiter, in these tests' processes: a
#: woken waiter on a loaded machine may be scheduled later than the 200 ms default
WINDOW_MS = 10_000


def _waiter(
    url: str,
    name: str,
    out: Any,
    gate: Any = None,
    tenant: str | None = None,
    spec: str = SPEC,
    key: str = "k",
) -> None:
    from idemlock._core import flows
    from idemlock.stores.sqlite import SQLiteStore

    if gate is not None:
        gate.wait(60)  # until the test has done what it does before this waiter listens
    # After the attempt that queues it a second time (so it may be chosen), no poll
    # before the wait ends: every later wait chunk lasts the whole wait.
    flows._backoff = lambda attempt, cap: 0.001 if attempt == 0 else WAIT
    flows.MAX_WAIT_CHUNK = WAIT
    SQLiteStore.poll_cap = WAIT
    # The window this waiter's release keeps for the next outlasts a busy machine's
    # stall before the next is scheduled (the order of turns is what these tests check).
    from idemlock.stores.sqlite import _store

    _store.HANDOFF_MS = WINDOW_MS
    coord = idemlock.connect(url, tenant=tenant)
    locks = coord.lock(spec)
    lease = locks.acquire(key, owner=name, wait=WAIT)
    out.put((name, None if lease is None else lease.token))
    if lease is not None:
        locks.release(lease)  # came through the queue: reserves the lock for the next
    coord.close()


def _wait_queued(path: Path, owner: str) -> None:
    """Until ``owner`` is queued (it asked twice, so it may be chosen)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with sqlite3.connect(path) as raw:
            row = raw.execute("SELECT tries FROM lock_waiters WHERE owner = ?", (owner,)).fetchone()
        if row is not None and row[0] > 1:
            return
        time.sleep(0.01)
    raise AssertionError(f"{owner} never queued")


@pytest.mark.parametrize("start", ["spawn", "fork"])
def test_waiters_in_other_processes_are_woken_in_turn(
    start: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forked waiters too: a child does not answer to its parent's name, it binds its
    own (the parent here listens before forking)."""
    from idemlock.stores.sqlite import _store as sqlite_store

    monkeypatch.setattr(sqlite_store, "HANDOFF_MS", WINDOW_MS)
    if start == "fork":
        from idemlock.stores.sqlite import _store

        _store._DOORBELL.listen()
    ctx: Any = mp.get_context(start)
    path = tmp_path / "wake.db"
    url = f"sqlite:///{path}"
    coord = idemlock.connect(url)
    locks = coord.lock(LockSpec(SPEC, ttl=timedelta(seconds=120)))  # outlives the waits
    lease = locks.acquire("k")
    assert lease is not None
    out = ctx.Queue()
    procs = []
    for name in ("first", "second"):
        proc = ctx.Process(target=_waiter, args=(url, name, out))
        proc.start()
        procs.append(proc)
        _wait_queued(path, name)
    try:
        assert locks.release(lease)
        # A one-shot try finds the lock reserved for the oldest waiter, and wakes it.
        assert locks.acquire("k") is None
        got = [out.get(timeout=60), out.get(timeout=60)]
    finally:
        for proc in procs:
            proc.join(60)
        coord.close()
    # "first" was woken by the reservation, "second" by first's release. The tokens
    # say who went first: the queue's order need not (each child's put is sent by a
    # feeder thread, and first releases right after its put).
    assert dict(got) == {"first": lease.token + 1, "second": lease.token + 2}
    assert [p.exitcode for p in procs] == [0, 0]


# ---- what another local user can do ---------------------------------------------------


def _names_of(pid: int) -> list[str]:
    """The abstract socket names process ``pid`` holds, as any user of its own finds
    them: its descriptors, and the machine's table of Unix sockets."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    names = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        parts = line.split()
        if len(parts) >= 8 and parts[6] in inodes and parts[7].startswith("@idemlock-"):
            names.append("\0" + parts[7][1:])
    return names


class _Holder:
    """This process holding the lock ``k`` (leased past the waits) of a file for the
    waiters of other processes, then handing it to the first."""

    def __init__(self, path: Path, tenant: str | None = None, spec: str = SPEC) -> None:
        self.path = path
        self.url = f"sqlite:///{path}"
        self.coord = idemlock.connect(self.url, tenant=tenant)
        self.locks = self.coord.lock(LockSpec(spec, ttl=timedelta(seconds=120)))
        self.ctx: Any = mp.get_context("spawn")
        self.out = self.ctx.Queue()
        self.procs: list[Any] = []

    def acquire(self, key: str = "k") -> None:
        lease = self.locks.acquire(key)
        assert lease is not None
        self.lease = lease

    def start(self, name: str, *args: Any) -> Any:
        proc = self.ctx.Process(target=_waiter, args=(self.url, name, self.out, *args))
        proc.start()
        self.procs.append(proc)
        return proc

    def hand_off(self, key: str = "k") -> Any:
        """Release, and wake the oldest waiter (the one-shot try that finds the lock
        reserved for it rings it); what the waiter got."""
        assert self.locks.release(self.lease)
        assert self.locks.acquire(key) is None
        return self.out.get(timeout=60)

    def close(self) -> None:
        for proc in self.procs:
            proc.join(60)
        self.coord.close()
        assert [p.exitcode for p in self.procs] == [0] * len(self.procs)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[_Holder]:
    h = _Holder(tmp_path / "wake.db")
    yield h
    h.close()


def test_no_datagram_stops_the_listener(holder: _Holder) -> None:
    """60,000 '[' (which once made the reader's JSON parser raise RecursionError and
    end the thread for the life of the process), garbage, an empty and an oversize
    datagram, things that look like wake-ups: all dropped, and a real wake-up sent
    after them still arrives."""
    holder.acquire()
    proc = holder.start("first")
    _wait_queued(holder.path, "first")
    names = _names_of(proc.pid)
    assert len(names) == 1  # the waiter's listener
    bad = [
        b"[" * 60_000,
        b"{" * 60_000,
        b"",
        os.urandom(20),
        os.urandom(4096),
        b"x" * ((1 << 16) + 100),
        b'"abc"',
        b'["/elsewhere.db", "ns", "k"]',
        b"1" * 10_000,
        b"ILW1" + os.urandom(16),  # the layout of a wake-up, a tag of no lock it waits for
        b"ILW1" + os.urandom(17),
        b"ILW1",
    ]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as attacker:
        for data in bad:
            attacker.sendto(data, names[0])
    assert holder.hand_off() == ("first", holder.lease.token + 1)


def test_a_squatter_on_a_guessed_name_receives_nothing(holder: _Holder) -> None:
    """Bound before the waiter starts listening, on the name it once used (its pid):
    the waiter binds another name nobody could guess, and is still woken."""
    holder.acquire()
    gate = holder.ctx.Event()
    proc = holder.start("first", gate)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as squatter:
        squatter.bind(f"\0idemlock-sqlite-wake-{proc.pid}")
        squatter.setblocking(False)
        gate.set()
        _wait_queued(holder.path, "first")
        names = _names_of(proc.pid)
        assert len(names) == 1 and str(proc.pid) not in names[0]
        assert holder.hand_off() == ("first", holder.lease.token + 1)
        with pytest.raises(BlockingIOError):
            squatter.recv(1 << 17)


def _squatted_waiter(url: str, taken: str, out: Any) -> None:
    """A waiter whose process cannot bind the name it draws (taken by the test)."""
    from idemlock.stores.sqlite import _wake as wake

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logger = logging.getLogger("idemlock")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Keep())
    wake._random_name = lambda: taken  # the name it draws is taken
    coord = idemlock.connect(url)
    lease = coord.lock(SPEC).acquire("k", owner="polls", wait=60)
    out.put((None if lease is None else lease.token, records))
    coord.close()


def test_a_taken_name_means_polling_and_a_debug_log(holder: _Holder) -> None:
    """A bind that fails is not ignored: the process says so in a debug log, queues its
    waiters without a name, and they poll (and get the lock)."""
    taken = "\0idemlock-sqlite-wake-" + "ab" * 16
    holder.acquire()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as squatter:
        squatter.bind(taken)
        squatter.setblocking(False)
        proc = holder.ctx.Process(target=_squatted_waiter, args=(holder.url, taken, holder.out))
        proc.start()
        holder.procs.append(proc)
        _wait_queued(holder.path, "polls")
        with sqlite3.connect(holder.path) as raw:
            assert raw.execute("SELECT wake FROM lock_waiters").fetchall() == [("",)]
        assert holder.locks.release(holder.lease)
        token, records = holder.out.get(timeout=60)
        assert token == holder.lease.token + 1
        assert any("wake-ups are off" in r and "poll" in r for r in records), records
        with pytest.raises(BlockingIOError):
            squatter.recv(1 << 17)


def test_a_wake_up_carries_no_key_tenant_spec_or_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every datagram the waker sends, as it leaves: none holds the key, the tenant,
    the spec, the namespace or the file's path (or a piece of them)."""
    secret_dir = tmp_path / "dir-of-payroll"
    secret_dir.mkdir()
    tenant, spec, key = "tenant-acme", "spec-payroll", "key-4111111111111111"
    sent: list[bytes] = []
    real = socket.socket.sendto

    def spy(self: socket.socket, data: Any, *args: Any) -> Any:
        if self.family == socket.AF_UNIX:
            sent.append(bytes(data))
        return real(self, data, *args)

    monkeypatch.setattr(socket.socket, "sendto", spy)
    h = _Holder(secret_dir / "wake.db", tenant=tenant, spec=spec)
    try:
        h.acquire(key)
        h.start("first", None, tenant, spec, key)
        _wait_queued(h.path, "first")
        assert h.hand_off(key) == ("first", h.lease.token + 1)
    finally:
        h.close()
    assert sent  # the wake-up went out (and arrived)
    pieces = [tenant, spec, key, "payroll", "acme", "4111", str(tmp_path), "wake.db", "lock"]
    for data in sent:
        for piece in pieces:
            assert piece.encode() not in data
        assert len(data) == _wake.SIZE


def test_tags_are_keyed_per_file(tmp_path: Path) -> None:
    """Each file has its own random secret: one lock's tag differs between two files,
    so who cannot read a file cannot confirm a guessed key from a tag."""
    keys = []
    for name in ("a.db", "b.db"):
        coord = idemlock.connect(f"sqlite:///{tmp_path / name}")
        assert coord.lock(SPEC).acquire("k") is not None
        coord.close()
        with sqlite3.connect(tmp_path / name) as raw:
            (secret,) = raw.execute("SELECT value FROM meta WHERE name = 'wake_key'").fetchone()
        assert isinstance(secret, bytes) and len(secret) == 32
        keys.append(secret)
    assert keys[0] != keys[1]
    assert _wake.tag(keys[0], "ns", "k") != _wake.tag(keys[1], "ns", "k")
    assert _wake.tag(keys[0], "ns", "k") != _wake.tag(keys[0], "ns", "k2")
    assert _wake.tag(keys[0], "n", "sk") != _wake.tag(keys[0], "ns", "k")  # no ambiguity


@pytest.fixture
def debug_records() -> Iterator[list[logging.LogRecord]]:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("idemlock")
    handler, level = Keep(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_the_reader_counts_what_it_drops_and_survives_its_own_failures(
    debug_records: list[logging.LogRecord],
) -> None:
    """In one process: malformed datagrams are counted in a debug log; a wake-up whose
    handling raises is logged too, and the reader goes on."""
    rung: list[tuple[str, str, str]] = []
    event = threading.Event()

    def on_ring(path: str, ns: str, key: str) -> None:
        if key == "boom":
            raise RuntimeError("a failing hub")
        rung.append((path, ns, key))
        event.set()

    bell = _wake.Doorbell(on_ring)
    name = bell.listen()
    try:
        assert _wake.valid_name(name)
        secret = os.urandom(32)
        boom = bell.route(secret, "/f.db", "ns", "boom")
        good = bell.route(secret, "/f.db", "ns", "k")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as attacker:
            for data in (b"[" * 60_000, b"", os.urandom(64), b"junk"):
                attacker.sendto(data, name)
        bell.ring(name, boom)
        bell.ring(name, good)
        assert event.wait(30)
        assert rung == [("/f.db", "ns", "k")]
        assert bell.dropped == 4
        messages = [r.getMessage() for r in debug_records]
        assert sum("dropped a datagram" in m for m in messages) == 3  # at 1, 2 and 4
        assert any("4 dropped so far" in m for m in messages)
        assert any("handling a datagram failed" in m for m in messages)
        # names read from the file that are not ours are never sent to
        bell.ring("\0some-other-service", good)
        bell.ring(name + "0", good)
    finally:
        bell.close()


def test_a_file_from_before_the_wake_column_gets_it(tmp_path: Path) -> None:
    """A file whose lock_waiters was made by an idemlock without wake names is given
    the column, its old rows kept (they have no name: their waiters poll), and the
    wake-ups work on it."""
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as raw:
        raw.execute(
            """CREATE TABLE lock_waiters (
                ns TEXT NOT NULL, key TEXT NOT NULL, owner TEXT NOT NULL,
                seq INTEGER NOT NULL, pid INTEGER NOT NULL, host TEXT NOT NULL,
                until_ms INTEGER NOT NULL, tries INTEGER NOT NULL,
                window_ms INTEGER NOT NULL DEFAULT 0,
                PRIMARY KEY (ns, key, owner)
            ) WITHOUT ROWID"""
        )
        raw.execute(
            "INSERT INTO lock_waiters (ns, key, owner, seq, pid, host, until_ms, tries) "
            "VALUES ('n', 'k', 'o', 1, 1, 'h', 1, 1)"
        )
    raw.close()
    h = _Holder(path)
    try:
        h.acquire()
        h.start("first")
        _wait_queued(path, "first")
        assert h.hand_off() == ("first", h.lease.token + 1)
    finally:
        h.close()
    with sqlite3.connect(path) as raw:
        assert raw.execute("SELECT wake FROM lock_waiters WHERE owner = 'o'").fetchone() == ("",)
    raw.close()
