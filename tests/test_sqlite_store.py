"""The SQLite store on real files: its port semantics, threads and processes racing on
one file, crashes, a locked or foreign file, bad URLs and wake-ups.

The contract suite covers what every store shares; this file covers what only an
embedded file store can get wrong. Processes use the ``spawn`` context (no inherited
connections), so their targets are module-level functions.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import shutil
import signal
import sqlite3
import threading
import time
import traceback
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import idemlock
import idemlock.aio
from idemlock import (
    Claim,
    Claimed,
    Completed,
    ConfigurationError,
    IdempotencySpec,
    InFlight,
    StoreCorrupt,
    StoreUnavailable,
)
from idemlock._core.port import Acquired, Busy, Channel, Done, Granted, Held, Mismatch
from idemlock.stores.sqlite import SQLiteAsyncStore, SQLiteStore, open_async, open_sync

from .servers._proc import waitpid

#: Child processes fork from a forkserver that has idemlock imported: each is a fresh
#: process of its own (nothing of the test's threads, files or connections), without a
#: new interpreter's start-up and imports each time (seconds a test on a loaded machine).
CTX = mp.get_context("forkserver")
CTX.set_forkserver_preload(["idemlock", "idemlock.stores.sqlite"])
NS = "t:job"
LOCKS = "t:lock"
LONG = 60_000  # ms: a lease that outlives the test


def url_of(path: Path | str) -> str:
    return f"sqlite:///{path}"


def open_store(path: Path | str, **options: Any) -> SQLiteStore:
    return open_sync(url_of(path), **options)[0]


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "idem.db"


@pytest.fixture
def store(db: Path) -> Iterator[SQLiteStore]:
    s = open_store(db)
    yield s
    s.close()


def granted(reply: object) -> Granted:
    assert isinstance(reply, Granted), reply
    return reply


# ---- port semantics on a file ---------------------------------------------------


def test_claim_complete_replay_and_mismatch(store: SQLiteStore) -> None:
    first = granted(store.claim(NS, "k", "fp", "tok1", LONG))
    assert first.fence >= 1 and first.ttl_ms == LONG
    # a retried request with the same token gets the same claim back
    again = granted(store.claim(NS, "k", "fp", "tok1", LONG))
    assert (again.fence, again.expires_ms) == (first.fence, first.expires_ms)
    assert isinstance(store.claim(NS, "k", "fp", "tok2", LONG), Busy)
    assert store.claim(NS, "k", "other", "tok2", LONG) == Mismatch("in_flight")
    assert store.claim(NS, "k", None, "tok2", LONG) == Mismatch("in_flight")

    assert store.complete(NS, "k", "tok2", b"nope", LONG) is False
    assert store.complete(NS, "k", "tok1", b"result", LONG) is True
    assert store.complete(NS, "k", "tok1", b"again", LONG) is False
    assert store.abandon(NS, "k", "tok1") is False
    done = store.claim(NS, "k", "fp", "tok3", LONG)
    assert isinstance(done, Done) and done.result == b"result"
    assert store.claim(NS, "k", "other", "tok3", LONG) == Mismatch("completed")

    row = store.record(NS, "k")
    assert row is not None and row.state == "completed" and row.fence == first.fence
    assert store.forget(NS, "k") is True
    assert store.record(NS, "k") is None
    assert store.forget(NS, "k") is False
    assert granted(store.claim(NS, "k", "fp", "tok4", LONG)).fence > first.fence


def test_fp_none_matches_only_none(store: SQLiteStore) -> None:
    granted(store.claim(NS, "n", None, "a", LONG))
    assert isinstance(store.claim(NS, "n", None, "b", LONG), Busy)
    assert store.claim(NS, "n", "", "b", LONG) == Mismatch("in_flight")


def test_keys_and_namespaces_are_kept_apart(store: SQLiteStore) -> None:
    granted(store.claim("x:a", "b:c", None, "t1", LONG))
    granted(store.claim("x:a:b", "c", None, "t2", LONG))
    assert store.complete("x:a", "b:c", "t1", b"1", LONG)
    row = store.record("x:a:b", "c")
    assert row is not None and row.state == "in_flight"


def test_large_binary_result_round_trips(store: SQLiteStore) -> None:
    blob = os.urandom(1 << 20) + b"\x00\xff"
    granted(store.claim(NS, "big", "fp", "t", LONG))
    assert store.complete(NS, "big", "t", blob, LONG)
    done = store.claim(NS, "big", "fp", "t2", LONG)
    assert isinstance(done, Done) and done.result == blob


def test_lock_transitions(store: SQLiteStore) -> None:
    a = store.acquire(LOCKS, "r", "alice", LONG)
    assert isinstance(a, Acquired)
    again = store.acquire(LOCKS, "r", "alice", LONG)
    assert isinstance(again, Acquired) and again.token == a.token
    assert again.expires_ms >= a.expires_ms
    assert isinstance(store.acquire(LOCKS, "r", "bob", LONG), Held)
    row = store.lock(LOCKS, "r")
    assert row is not None and (row.owner, row.token) == ("alice", a.token)

    assert store.renew(LOCKS, "r", "alice", a.token + 1, LONG) is None
    assert store.renew(LOCKS, "r", "bob", a.token, LONG) is None
    renewed = store.renew(LOCKS, "r", "alice", a.token, LONG)
    assert renewed is not None and renewed >= again.expires_ms
    assert store.release(LOCKS, "r", "bob", a.token) is False
    assert store.release(LOCKS, "r", "alice", a.token) is True
    assert store.release(LOCKS, "r", "alice", a.token) is False
    assert store.lock(LOCKS, "r") is None
    b = store.acquire(LOCKS, "r", "bob", LONG)
    assert isinstance(b, Acquired) and b.token > a.token


def test_permits_purge_counts_each_expired_one(store: SQLiteStore) -> None:
    short = [store.acquire(LOCKS, "p", f"s{i}", 1, 4) for i in range(2)]
    assert all(isinstance(a, Acquired) for a in short)
    live = store.acquire(LOCKS, "p", "long", LONG, 4)
    assert isinstance(live, Acquired)
    gone = store.acquire(LOCKS, "gone", "o", 1, 3)
    assert isinstance(gone, Acquired)
    released = store.acquire(LOCKS, "released", "o", LONG, 3)
    assert isinstance(released, Acquired)
    assert store.release(LOCKS, "released", "o", released.token)
    time.sleep(0.01)
    # two expired permits of a held key, one of a dead key, one released key
    assert store.purge(dry_run=True) == 4
    assert store.purge() == 4
    assert store.purge(dry_run=True) == 0 and store.purge() == 0
    assert [(r.key, r.owner) for r in store.locks(LOCKS)] == [("p", "long")]
    for key, before in (("p", live.token), ("gone", gone.token), ("released", released.token)):
        again = store.acquire(LOCKS, key, "next", LONG, 4)
        assert isinstance(again, Acquired) and again.token > before, key


# The previous release's schema and lock statements (before permits), verbatim: a file it
# wrote, and a process of it still running, must keep working next to this one.
_OLD_SCHEMA = (
    "CREATE TABLE meta (name TEXT PRIMARY KEY NOT NULL, value INTEGER NOT NULL) WITHOUT ROWID",
    """CREATE TABLE claims (ns TEXT NOT NULL, key TEXT NOT NULL, state TEXT NOT NULL,
        token TEXT NOT NULL, fence INTEGER NOT NULL, fp TEXT, expires_ms INTEGER NOT NULL,
        result BLOB, PRIMARY KEY (ns, key)) WITHOUT ROWID""",
    "CREATE INDEX claims_expires ON claims (expires_ms)",
    """CREATE TABLE locks (ns TEXT NOT NULL, key TEXT NOT NULL, owner TEXT NOT NULL,
        token INTEGER NOT NULL, expires_ms INTEGER NOT NULL,
        PRIMARY KEY (ns, key)) WITHOUT ROWID""",
    "CREATE INDEX locks_expires ON locks (expires_ms)",
    """CREATE TABLE fences (ns TEXT NOT NULL, resource TEXT NOT NULL, highest INTEGER NOT NULL,
        PRIMARY KEY (ns, resource)) WITHOUT ROWID""",
    """CREATE TABLE lock_waiters (ns TEXT NOT NULL, key TEXT NOT NULL, owner TEXT NOT NULL,
        seq INTEGER NOT NULL, pid INTEGER NOT NULL, host TEXT NOT NULL,
        until_ms INTEGER NOT NULL, tries INTEGER NOT NULL, window_ms INTEGER NOT NULL DEFAULT 0,
        wake TEXT NOT NULL DEFAULT '', PRIMARY KEY (ns, key, owner)) WITHOUT ROWID""",
    "INSERT INTO meta (name, value) VALUES ('schema', 1), ('floor', 0)",
)
_OLD_ACQUIRE = """
INSERT INTO locks (ns, key, owner, token, expires_ms)
VALUES (?1, ?2, ?3, (SELECT value FROM meta WHERE name = 'floor') + 1, ?4)
ON CONFLICT (ns, key) DO UPDATE SET
    token = CASE WHEN locks.expires_ms > ?5 THEN locks.token ELSE locks.token + 1 END,
    owner = excluded.owner, expires_ms = excluded.expires_ms
WHERE (locks.expires_ms > ?5 AND locks.owner = excluded.owner)
   OR (locks.expires_ms <= ?5
       AND NOT EXISTS (SELECT 1 FROM lock_waiters WHERE ns = ?1 AND key = ?2))
RETURNING token
"""
_OLD_RELEASE = """
UPDATE locks SET expires_ms = 0
WHERE ns = ?1 AND key = ?2 AND owner = ?3 AND token = ?4 AND expires_ms > ?5
"""


def _old_file(path: Path) -> sqlite3.Connection:
    raw = sqlite3.connect(path, isolation_level=None)
    raw.execute("PRAGMA journal_mode=WAL")
    for stmt in _OLD_SCHEMA:
        raw.execute(stmt)
    now = time.time_ns() // 1_000_000
    raw.executemany(
        "INSERT INTO locks VALUES (?, ?, ?, ?, ?)",
        [
            (LOCKS, "held", "old-owner", 7, now + LONG),  # held by the old release
            (LOCKS, "released", "x", 4, 0),  # a released lock's tombstone
            (LOCKS, "expired", "y", 9, now - 1),
        ],
    )
    return raw


def _old_acquire(raw: sqlite3.Connection, key: str, owner: str) -> int | None:
    now = time.time_ns() // 1_000_000
    row = raw.execute(_OLD_ACQUIRE, (LOCKS, key, owner, now + LONG, now)).fetchone()
    return None if row is None else int(row[0])


def test_a_file_of_the_release_before_permits_is_upgraded_in_place(db: Path) -> None:
    raw = _old_file(db)
    store = open_store(db)
    # The held lock stays held, with its owner and token, and is listed.
    assert isinstance(store.acquire(LOCKS, "held", "new", LONG), Held)
    row = store.lock(LOCKS, "held")
    assert row is not None and (row.owner, row.token) == ("old-owner", 7)
    # Tokens keep rising from each key's counter.
    freed = store.acquire(LOCKS, "released", "new", LONG)
    assert isinstance(freed, Acquired) and freed.token == 5
    late = store.acquire(LOCKS, "expired", "new", LONG)
    assert isinstance(late, Acquired) and late.token == 10
    indexes = {r[0] for r in raw.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert "locks_expires" not in indexes  # dropped: purge scans
    raw.close()
    store.close()
    # Opening it again changes nothing.
    again = open_store(db)
    assert [(r.key, r.token) for r in again.holders(LOCKS, "released")] == [("released", 5)]
    again.close()


def test_a_process_of_the_release_before_permits_shares_the_file(db: Path) -> None:
    """An old process keeps its lock (this release sees it held and may free or renew
    it) and never takes a lock held here; tokens never repeat between the two."""
    raw = _old_file(db)
    store = open_store(db)
    assert store.renew(LOCKS, "held", "old-owner", 7, LONG) is not None
    assert store.release(LOCKS, "held", "old-owner", 7) is True
    mine = store.acquire(LOCKS, "held", "new", LONG)
    assert isinstance(mine, Acquired) and mine.token == 8
    assert _old_acquire(raw, "held", "old-2") is None  # held here: refused
    assert store.release(LOCKS, "held", "new", mine.token)
    old = _old_acquire(raw, "held", "old-2")
    assert old == 9
    assert isinstance(store.acquire(LOCKS, "held", "new", LONG), Held)
    assert [(r.owner, r.token) for r in store.locks(LOCKS) if r.key == "held"] == [("old-2", 9)]
    now = time.time_ns() // 1_000_000
    assert raw.execute(_OLD_RELEASE, (LOCKS, "held", "old-2", 9, now)).rowcount == 1
    last = store.acquire(LOCKS, "held", "new", LONG)
    assert isinstance(last, Acquired) and last.token == 10
    # This release's break frees an old process's lock.
    assert _old_acquire(raw, "fresh", "old-3") == 1
    assert store.break_lock(LOCKS, "fresh") is True
    got = store.acquire(LOCKS, "fresh", "new", LONG)
    assert isinstance(got, Acquired) and got.token == 2
    # An old process's purge deletes a dead key's row (raising the floor) but not its
    # expired permits: the counter still rises for the same owner.
    short = store.acquire(LOCKS, "short", "same", 1)
    assert isinstance(short, Acquired)
    time.sleep(0.01)
    raw.execute(
        "UPDATE meta SET value = max(value, (SELECT max(token) FROM locks "
        "WHERE expires_ms <= ?1)) WHERE name = 'floor'",
        (time.time_ns() // 1_000_000,),
    )
    raw.execute("DELETE FROM locks WHERE expires_ms <= ?1", (time.time_ns() // 1_000_000,))
    floor = raw.execute("SELECT value FROM meta WHERE name = 'floor'").fetchone()[0]
    again = store.acquire(LOCKS, "short", "same", LONG)
    assert isinstance(again, Acquired) and again.token == floor + 1 > short.token
    other = store.acquire(LOCKS, "short", "other", LONG, 2)
    assert isinstance(other, Acquired) and other.token == again.token + 1
    raw.close()
    store.close()


def _open_old_file(out: Any, path: str, me: int, barrier: Any) -> None:
    store = open_store(path)
    barrier.wait()
    lock = store.acquire(LOCKS, "released", f"p{me}", LONG, 8)
    assert isinstance(lock, Acquired)
    out.put((me, lock.token))
    store.close()


def test_processes_upgrade_an_old_file_at_once(db: Path) -> None:
    _old_file(db).close()
    procs = 4
    barrier = CTX.Barrier(procs)
    results = run_processes(_open_old_file, [(str(db), i, barrier) for i in range(procs)], procs)
    assert sorted(t for _, t in results) == [5, 6, 7, 8]
    check = sqlite3.connect(db)
    triggers = check.execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")
    assert {name for (name,) in triggers} == {
        "lock_permits_granted",
        "lock_permits_changed",
        "lock_permits_freed",
        "claim_steps_completed",
    }
    check.close()


def test_fence_advance_and_current(store: SQLiteStore) -> None:
    assert store.fence_current("t:fence", "res") is None
    assert store.fence_advance("t:fence", "res", 5) == (True, 5)
    assert store.fence_advance("t:fence", "res", 5) == (True, 5)
    assert store.fence_advance("t:fence", "res", 4) == (False, 5)
    assert store.fence_advance("t:fence", "res", 9) == (True, 9)
    assert store.fence_advance("t:fence", "other", 1) == (True, 1)
    assert store.fence_current("t:fence", "res") == 9


def test_integers_beyond_64_bits_are_refused_cleanly(store: SQLiteStore) -> None:
    with pytest.raises(ConfigurationError, match="64-bit"):
        store.fence_advance("t:fence", "res", 2**63)
    assert store.fence_current("t:fence", "res") is None
    assert store.fence_advance("t:fence", "res", 2**63 - 1) == (True, 2**63 - 1)


def test_prefix_listings_take_the_prefix_literally(store: SQLiteStore) -> None:
    # '%' and '_' are LIKE wildcards; namespaces contain '%' (escaped ':').
    names = ["a%b:x", "a_b:x", "aXb:x", "a:x", "b:x"]
    for ns in names:
        granted(store.claim(ns, "k", None, "t", LONG))
        assert isinstance(store.acquire(ns, "k", "o", LONG), Acquired)
    assert [r.ns for r in store.records("a%")] == ["a%b:x"]
    assert [r.ns for r in store.records("a_")] == ["a_b:x"]
    assert [r.ns for r in store.locks("a%")] == ["a%b:x"]
    assert sorted(r.ns for r in store.records("")) == sorted(names)
    assert sorted(r.ns for r in store.locks("a")) == sorted(n for n in names if n[0] == "a")


def test_fences_rise_across_deletes_purge_and_reopen(db: Path) -> None:
    store = open_store(db)
    seen = [granted(store.claim(NS, "k", None, "t1", LONG)).fence]
    assert store.abandon(NS, "k", "t1")
    seen.append(granted(store.claim(NS, "k", None, "t2", LONG)).fence)
    store.forget(NS, "k")
    seen.append(granted(store.claim(NS, "k", None, "t3", 1)).fence)
    lease = store.acquire(LOCKS, "k", "o", 1)
    assert isinstance(lease, Acquired)
    tokens = [lease.token]  # fences and tokens count per key and per kind
    time.sleep(0.01)
    assert store.purge() == 2  # the expired claim and the expired lock
    assert store.record(NS, "k") is None and store.lock(LOCKS, "k") is None
    store.close()

    reopened = open_store(db)
    seen.append(granted(reopened.claim(NS, "k", None, "t4", LONG)).fence)
    lease2 = reopened.acquire(LOCKS, "k", "o", LONG)
    assert isinstance(lease2, Acquired)
    tokens.append(lease2.token)
    reopened.close()
    # purge deleted the rows but raised the floor first: both still count upwards
    assert seen == sorted(seen) and len(set(seen)) == len(seen), seen
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens), tokens


def test_expiry_uses_the_wall_clock(store: SQLiteStore) -> None:
    old = granted(store.claim(NS, "e", "fp", "old", 50))
    lock = store.acquire(LOCKS, "e", "alice", 50)
    assert isinstance(lock, Acquired)
    time.sleep(0.12)
    assert store.record(NS, "e") is None
    new = granted(store.claim(NS, "e", "fp", "new", LONG))
    assert new.fence > old.fence
    # the old attempt was taken over: its late completion is refused (A2)
    assert store.complete(NS, "e", "old", b"late", LONG) is False
    assert store.abandon(NS, "e", "old") is False
    assert store.renew(LOCKS, "e", "alice", lock.token, LONG) is None  # never revived
    assert store.lock(LOCKS, "e") is None
    bob = store.acquire(LOCKS, "e", "bob", LONG)
    assert isinstance(bob, Acquired) and bob.token > lock.token
    assert store.release(LOCKS, "e", "alice", lock.token) is False


def test_purge_keeps_live_rows(store: SQLiteStore) -> None:
    for i in range(5):
        granted(store.claim(NS, f"short{i}", None, "t", 1))
        granted(store.claim(NS, f"long{i}", None, "t", LONG))
    granted(store.claim(NS, "done", None, "t", LONG))
    assert store.complete(NS, "done", "t", b"r", 1)
    assert isinstance(store.acquire(LOCKS, "short", "o", 1), Acquired)
    assert isinstance(store.acquire(LOCKS, "long", "o", LONG), Acquired)
    time.sleep(0.01)
    assert store.purge() == 7
    assert store.purge() == 0
    assert sorted(r.key for r in store.records(NS)) == [f"long{i}" for i in range(5)]
    assert [r.key for r in store.locks(LOCKS)] == ["long"]


def test_steps_outlive_the_store_object_and_purge_drops_only_expired_ones(db: Path) -> None:
    """Steps are rows of the file: another store object on it (another process) resumes
    after them; a purge removes the steps whose until_ms passed, uncounted, and keeps
    the others."""
    first = open_store(db)
    granted(first.claim(NS, "job", None, "t1", LONG))
    assert first.step(NS, "job", "t1", "charge", b'"ch_1"', LONG, LONG) is not None
    assert first.step(NS, "job", "t1", "email", None, LONG, LONG) is not None
    assert first.abandon(NS, "job", "t1")
    granted(first.claim(NS, "short", None, "s1", LONG))
    assert first.step(NS, "short", "s1", "only", b"1", LONG, 1) is not None
    first.close()
    second = open_store(db)
    got = granted(second.claim(NS, "job", None, "t2", LONG))
    assert [(s.name, s.result) for s in got.steps] == [("charge", b'"ch_1"'), ("email", None)]
    time.sleep(0.01)
    assert second.purge() == 0  # the steps of "short" went, uncounted
    raw = sqlite3.connect(db)
    left = raw.execute("SELECT ns, key, name FROM claim_steps ORDER BY name").fetchall()
    assert left == [(NS, "job", "charge"), (NS, "job", "email")]
    # A step row the store did not write is reported, not misread.
    raw.execute("UPDATE claim_steps SET fence = 'x' WHERE name = 'email'")
    raw.commit()
    raw.close()
    with pytest.raises(StoreCorrupt, match="claim_steps"):
        second.steps(NS, "job")
    second.close()


def test_a_step_write_changes_no_other_step_row(db: Path) -> None:
    """The end of a key's steps is kept once, in its claims row: recording a step
    inserts its own row and changes no earlier one, so a step costs the same however
    many the key has (counted by a trigger of the test's, not timed)."""
    store = open_store(db)
    g = granted(store.claim(NS, "many", None, "t1", LONG))  # the schema made
    raw = sqlite3.connect(db, isolation_level=None)
    raw.execute("CREATE TABLE step_updates (name TEXT NOT NULL)")
    raw.execute(
        "CREATE TRIGGER step_updated AFTER UPDATE ON claim_steps "
        "BEGIN INSERT INTO step_updates VALUES (OLD.name); END"
    )
    for i in range(30):
        assert store.step(NS, "many", "t1", f"s{i:02d}", b"%d" % i, LONG, LONG) is not None
    assert raw.execute("SELECT name FROM step_updates").fetchall() == []
    assert [(s.name, s.fence) for s in store.steps(NS, "many")] == [
        (f"s{i:02d}", g.fence) for i in range(30)
    ]
    # Writing a step again changes its own row only.
    assert store.step(NS, "many", "t1", "s05", b"again", LONG, LONG) is not None
    assert raw.execute("SELECT name FROM step_updates").fetchall() == [("s05",)]
    raw.close()
    store.close()


def test_steps_end_together_in_the_claims_row(db: Path) -> None:
    """steps_ms of the claims row is the end of all the key's steps: once it passed
    (set back here, no waiting), none of them is read, purge drops them (the tombstone
    with them), and the next step starts a new generation without them."""
    store = open_store(db)
    g = granted(store.claim(NS, "k", None, "t1", LONG))
    assert store.step(NS, "k", "t1", "a", b"1", LONG, LONG) is not None
    assert store.step(NS, "k", "t1", "b", b"2", LONG, LONG) is not None
    raw = sqlite3.connect(db, isolation_level=None)
    (end,) = raw.execute("SELECT steps_ms FROM claims WHERE key = 'k'").fetchone()
    assert end > g.expires_ms - LONG
    # An abandoned key keeps its steps, and its tombstone, while they live.
    assert store.abandon(NS, "k", "t1")
    assert store.purge() == 0
    g2 = granted(store.claim(NS, "k", None, "t2", LONG))
    assert [s.name for s in g2.steps] == ["a", "b"] and g2.fence > g.fence
    # The key's end passed: every step ends with it, the rows' own ends do not matter.
    raw.execute("UPDATE claims SET steps_ms = 1 WHERE key = 'k'")
    raw.execute("UPDATE claim_steps SET until_ms = 1 WHERE name = 'a'")
    assert [s.name for s in store.steps(NS, "k")] == ["b"]  # its row's own end is ahead
    raw.execute("UPDATE claim_steps SET until_ms = 1")
    assert store.steps(NS, "k") == []
    assert store.step(NS, "k", "t2", "c", b"3", LONG, LONG) is not None
    assert [s.name for s in store.steps(NS, "k")] == ["c"]
    assert [r[0] for r in raw.execute("SELECT name FROM claim_steps")] == ["c"]
    # Completing ends the steps with the record; forgetting drops them.
    assert store.complete(NS, "k", "t2", b"r", 5_000)
    row = raw.execute("SELECT expires_ms, steps_ms FROM claims WHERE key = 'k'").fetchone()
    assert row[0] == row[1]
    assert store.forget(NS, "k")
    assert raw.execute("SELECT steps_ms FROM claims WHERE key = 'k'").fetchone() == (0,)
    assert raw.execute("SELECT count(*) FROM claim_steps").fetchone() == (0,)
    assert granted(store.claim(NS, "k", None, "t3", LONG)).steps == ()
    raw.close()
    store.close()


def test_a_file_with_step_rows_of_the_previous_release_upgrades(db: Path) -> None:
    """A file whose claims row has no steps_ms (the release before it) gets the column
    when opened; its step rows, which carry their own end, read as before, and the next
    step takes their end on."""
    store = open_store(db)
    g = granted(store.claim(NS, "old", None, "t1", LONG))
    store.close()
    raw = sqlite3.connect(db, isolation_level=None)
    now = time.time_ns() // 1_000_000
    raw.execute("ALTER TABLE claims DROP COLUMN steps_ms")
    raw.execute(
        "INSERT INTO claim_steps (ns, key, name, fence, result, until_ms) VALUES "
        "(?1, 'old', 'a', ?2, x'31', ?3), (?1, 'old', 'gone', ?2, NULL, 1)",
        (NS, g.fence, now + 10 * LONG),
    )
    store = open_store(db)
    assert [(s.name, s.result) for s in store.steps(NS, "old")] == [("a", b"1")]
    assert "steps_ms" in {r[1] for r in raw.execute("PRAGMA table_info(claims)")}
    assert store.step(NS, "old", "t1", "b", b"2", LONG, LONG) is not None
    assert [s.name for s in store.steps(NS, "old")] == ["a", "b"]
    (end,) = raw.execute("SELECT steps_ms FROM claims WHERE key = 'old'").fetchone()
    assert end == now + 10 * LONG  # the later end, of the row written before
    assert [r[0] for r in raw.execute("SELECT name FROM claim_steps ORDER BY 1")] == ["a", "b"]
    # An end idemlock did not write is reported, and the step changes nothing.
    raw.execute("UPDATE claims SET steps_ms = 'x' WHERE key = 'old'")
    with pytest.raises(StoreCorrupt, match="claims"):
        store.step(NS, "old", "t1", "c", b"3", LONG, LONG)
    assert [r[0] for r in raw.execute("SELECT name FROM claim_steps ORDER BY 1")] == ["a", "b"]
    raw.close()
    store.close()


def test_purge_goes_a_chunk_per_transaction_and_keeps_the_floor(
    store: SQLiteStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A purge of many dead rows holds the write lock for a chunk at a time (other
    writers go in between), and every chunk raises the floor over what it deletes."""
    from idemlock.stores.sqlite import _store

    monkeypatch.setattr(_store, "PURGE_CHUNK", 3)
    fences = {}
    for i in range(10):
        for attempt in range(i % 3):  # fences differ from key to key
            granted(store.claim(NS, f"dead{i}", None, f"a{attempt}", LONG))
            assert store.abandon(NS, f"dead{i}", f"a{attempt}")
        fences[f"dead{i}"] = granted(store.claim(NS, f"dead{i}", None, "t", 1)).fence
    tokens = {}
    for i in range(4):
        lease = store.acquire(LOCKS, f"dead{i}", "o", 1)
        assert isinstance(lease, Acquired)
        tokens[f"dead{i}"] = lease.token
    granted(store.claim(NS, "live", None, "t", LONG))
    time.sleep(0.01)
    writes: list[tuple[Any, ...]] = []
    write = store._write

    def counted(body: Any, *args: Any) -> Any:
        writes.append(args)
        return write(body, *args)

    monkeypatch.setattr(store, "_write", counted)
    assert store.purge() == 14
    assert writes == [(3,)] * 4  # claims 3+3+3+1, locks 3+1
    assert [r.key for r in store.records(NS)] == ["live"]
    for key, fence in fences.items():
        assert granted(store.claim(NS, key, None, "new", LONG)).fence > fence
    for key, token in tokens.items():
        again = store.acquire(LOCKS, key, "o2", LONG)
        assert isinstance(again, Acquired) and again.token > token


# ---- threads on one store object ---------------------------------------------------


def test_threads_race_one_store_object(store: SQLiteStore) -> None:
    n = 12
    barrier = threading.Barrier(n)
    replies: dict[int, list[object]] = {g: [] for g in range(15)}
    acquired: dict[int, list[object]] = {g: [] for g in range(15)}

    def worker(i: int) -> None:
        for g in replies:
            barrier.wait(timeout=60)
            replies[g].append(store.claim(NS, f"gen{g}", "fp", f"tok{i}", LONG))
            acquired[g].append(store.acquire(LOCKS, f"gen{g}", f"owner{i}", LONG))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "still running after 60 s"
    for g in replies:
        wins = [r for r in replies[g] if isinstance(r, Granted)]
        assert len(wins) == 1 and len(replies[g]) == n, replies[g]
        assert all(isinstance(r, Busy) for r in replies[g] if r is not wins[0])
        assert sum(isinstance(r, Acquired) for r in acquired[g]) == 1
        assert wins[0].fence == 1  # each key's first claim: no fence was spent twice


def test_threads_mutual_exclusion_through_the_file(db: Path) -> None:
    # Each thread has its own store object: the file is the only thing they share.
    inside = 0
    worst = 0
    tokens: list[int] = []
    guard = threading.Lock()
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        nonlocal inside, worst
        s = open_store(db)
        try:
            got = 0
            while got < 15:
                reply = s.acquire(LOCKS, "shared", f"w{i}", LONG)
                if not isinstance(reply, Acquired):
                    time.sleep(0.0005)
                    continue
                got += 1
                with guard:
                    inside += 1
                    worst = max(worst, inside)
                    tokens.append(reply.token)
                time.sleep(0.0002)
                with guard:
                    inside -= 1
                assert s.release(LOCKS, "shared", f"w{i}", reply.token)
        except BaseException as exc:
            errors.append(exc)
        finally:
            s.close()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "still running after 60 s"
    assert not errors, errors
    assert worst == 1
    assert tokens == sorted(tokens) and len(set(tokens)) == len(tokens) == 90


def test_close_closes_every_pooled_connection(db: Path) -> None:
    store = open_store(db)
    barrier = threading.Barrier(6)

    def worker(i: int) -> None:
        barrier.wait(timeout=60)
        for j in range(20):
            granted(store.claim(NS, f"c{i}.{j}", None, "t", LONG))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "still running after 60 s"
    assert Path(f"{db}-wal").exists()
    store.close()
    store.close()
    # SQLite removes the WAL when the last connection to the file closes.
    assert not Path(f"{db}-wal").exists()
    with pytest.raises(StoreUnavailable, match="closed"):
        store.claim(NS, "after", None, "t", LONG)


# ---- processes on one file -----------------------------------------------------------


def _in_child(target: Any, out: Any, *args: Any) -> None:
    try:
        target(out, *args)
    except BaseException:
        out.put(("error", traceback.format_exc()))
        raise


def run_processes(target: Any, arg_sets: list[tuple[Any, ...]], expected: int) -> list[Any]:
    """Run ``target(out, *args)`` in one spawned process per arg set; return the first
    ``expected`` items they put on ``out``. A failing child fails the test at once."""
    out = CTX.Queue()
    procs = [
        CTX.Process(target=_in_child, args=(target, out, *args), daemon=True) for args in arg_sets
    ]
    for p in procs:
        p.start()
    try:
        results: list[Any] = []
        deadline = time.monotonic() + 90
        while len(results) < expected:
            item = out.get(timeout=max(0.1, deadline - time.monotonic()))
            if item[0] == "error":
                pytest.fail(f"a worker process failed:\n{item[1]}")
            results.append(item)
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        return results
    finally:
        for p in procs:  # never leave a process behind, even on failure
            if p.is_alive():
                p.kill()
                p.join(timeout=60)
                assert not p.is_alive(), "still running after 60 s"


def _race_worker(
    out: Any, path: str, me: int, generations: int, barrier: Any, holders: Any
) -> None:
    store = open_store(path)
    replies: list[tuple[int, str, int | bytes | None]] = []
    for g in range(generations):
        barrier.wait(timeout=60)
        for attempt in range(3):
            reply = store.claim(NS, f"gen{g}", "fp", f"p{me}.{g}.{attempt}", LONG)
            if isinstance(reply, Granted):
                replies.append((g, "granted", reply.fence))
                assert store.complete(NS, f"gen{g}", reply.token, f"p{me}".encode(), LONG)
            elif isinstance(reply, Done):
                replies.append((g, "done", reply.result))
            else:
                replies.append((g, type(reply).__name__, None))
    # Phase two: one key, freed by abandon between generations; count overlaps.
    overlaps = 0
    fences: list[int] = []
    for attempt in range(40):
        reply = store.claim(NS, "shared", "fp", f"s{me}.{attempt}", LONG)
        if isinstance(reply, Granted):
            with holders.get_lock():
                holders.value += 1
                overlaps += holders.value != 1
            fences.append(reply.fence)
            time.sleep(0.0005)
            with holders.get_lock():
                holders.value -= 1
            assert store.abandon(NS, "shared", reply.token)
        else:
            time.sleep(0.0005)
    store.close()
    out.put((me, replies, fences, overlaps))


def test_processes_one_claim_per_generation(db: Path) -> None:
    procs, generations = 8, 20
    barrier = CTX.Barrier(procs)
    holders = CTX.Value("i", 0)
    args = [(str(db), i, generations, barrier, holders) for i in range(procs)]
    results = run_processes(_race_worker, args, procs)

    by_gen: dict[int, list[tuple[str, Any, int]]] = {g: [] for g in range(generations)}
    shared: list[int] = []
    for me, replies, fences, overlaps in results:
        assert overlaps == 0
        assert fences == sorted(fences)
        shared.extend(fences)
        for g, kind, value in replies:
            by_gen[g].append((kind, value, me))
    for g, seen in by_gen.items():
        assert len(seen) == procs * 3
        wins = [(value, me) for kind, value, me in seen if kind == "granted"]
        assert len(wins) == 1, (g, seen)
        winner = f"p{wins[0][1]}".encode()
        # everyone else saw it in flight or replayed the winner's result
        for kind, value, _ in seen:
            assert kind in ("granted", "done", "Busy"), kind
            if kind == "done":
                assert value == winner
    assert shared, "nobody ever claimed the shared key"
    assert len(set(shared)) == len(shared)  # each generation had exactly one holder


def _kill_victim(out: Any, path: str) -> None:
    coord = idemlock.connect(url_of(path), key_prefix="kill")
    port = coord.idempotency(IdempotencySpec("job", lease=timedelta(seconds=1.5)))
    claim = port.claim("order-1", payload={"n": 1})
    assert isinstance(claim, Claimed)
    out.put((claim.fence, claim.token.token))
    time.sleep(120)  # killed before it can complete


def test_sigkill_between_claim_and_complete(db: Path) -> None:
    out = CTX.Queue()
    victim = CTX.Process(target=_in_child, args=(_kill_victim, out, str(db)), daemon=True)
    victim.start()
    try:
        item = out.get(timeout=60)
        assert item[0] != "error", item[1]
        fence, token = item
        assert victim.pid is not None
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(timeout=30)
        assert victim.exitcode == -signal.SIGKILL
    finally:
        if victim.is_alive():
            victim.kill()
            victim.join(timeout=60)
            assert not victim.is_alive(), "still running after 60 s"

    coord = idemlock.connect(url_of(db), key_prefix="kill")
    port = coord.idempotency(IdempotencySpec("job", lease=timedelta(seconds=1.5)))
    try:
        # Still reserved by the dead worker until its lease ends (unless the machine
        # was slow enough for it to end already).
        first = port.claim("order-1", payload={"n": 1})
        assert isinstance(first, (InFlight, Claimed))
        taken: Claim = first
        if isinstance(first, InFlight):  # waits in short polls: the dead cannot notify
            taken = port.wait("order-1", payload={"n": 1}, timeout=30)
        assert isinstance(taken, Claimed), taken
        assert taken.fence > fence
        ns = port._ns
        assert coord.store.complete(ns, "order-1", token, b"1", LONG) is False
        port.complete(taken.token, {"ok": True})
        replay = port.claim("order-1", payload={"n": 1})
        assert isinstance(replay, Completed) and replay.result == {"ok": True}
    finally:
        coord.close()
    check = sqlite3.connect(db)
    assert check.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    check.close()


def _first_user(out: Any, paths: list[str], me: int, barrier: Any) -> None:
    # Several new files in a row, all processes at once on each: the switch to WAL
    # and the schema creation race every time.
    for path in paths:
        barrier.wait(timeout=60)
        store = open_store(path, busy_timeout=20)
        claim = store.claim(NS, f"first{me}", None, "t", LONG)
        lock = store.acquire(LOCKS, f"first{me}", "o", LONG)
        assert isinstance(claim, Granted) and isinstance(lock, Acquired)
        out.put((path, me, claim.fence, lock.token))
        store.close()


def test_concurrent_first_use_of_new_files(tmp_path: Path) -> None:
    paths = [str(tmp_path / f"new{i}.db") for i in range(8)]
    procs = 6
    barrier = CTX.Barrier(procs)
    args = [(paths, i, barrier) for i in range(procs)]
    results = run_processes(_first_user, args, procs * len(paths))
    for path in paths:
        mine = [r for r in results if r[0] == path]
        assert sorted(r[1] for r in mine) == list(range(procs))
        # Every key is new: its first fence and token start just above the floor (0).
        assert {r[2] for r in mine} == {1} and {r[3] for r in mine} == {1}
        check = sqlite3.connect(path)
        assert check.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert check.execute("SELECT count(*) FROM claims").fetchone()[0] == procs
        floor = check.execute("SELECT value FROM meta WHERE name = 'floor'").fetchone()[0]
        assert floor == 0
        check.close()


def test_a_forked_child_opens_its_own_connections(db: Path) -> None:
    # Connections must not cross fork(); the store drops inherited ones in the child.
    store = open_store(db)
    granted(store.claim(NS, "parent", None, "t", LONG))  # the pool now holds a connection
    parents = {id(conn) for conn, _ in store._idle}
    assert parents
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        status = 1
        try:
            reply = store.claim(NS, "child", None, "t", LONG)
            # The parent's connections were dropped (unclosed) at the child's first call.
            inherited = parents & {id(conn) for conn, _ in store._idle}
            fence = reply.fence if isinstance(reply, Granted) and not inherited else -1
            os.write(write, str(fence).encode())
            status = 0
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read) as pipe:
        child_fence = int(pipe.read() or "-1")
    _, status = waitpid(pid)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child_fence > 0
    # The child's claim went to the file: the parent sees it.
    row = store.record(NS, "child")
    assert row is not None and row.fence == child_fence
    store.close()


def test_a_fork_during_another_threads_transaction_leaves_the_child_a_usable_file(
    db: Path,
) -> None:
    # SQLite keeps a process's file-lock state in memory shared by its connections: a
    # child forked while another thread is inside BEGIN IMMEDIATE inherits a lock that
    # nobody in the child releases, and finds the database locked for good. The store
    # makes fork() wait for the transaction instead.
    store = open_store(db, busy_timeout=1.0)
    inside, leave = threading.Event(), threading.Event()

    def slow(cur: sqlite3.Cursor) -> None:
        inside.set()
        leave.wait(5)

    writer = threading.Thread(target=store._write, args=(slow,))
    writer.start()
    assert inside.wait(5)
    threading.Timer(0.3, leave.set).start()  # the fork below waits for this
    read, write = os.pipe()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        status = 1
        try:
            reply = store.claim(NS, "child", None, "t", LONG)
            os.write(write, str(reply.fence if isinstance(reply, Granted) else -1).encode())
            status = 0
        except BaseException as exc:
            os.write(write, repr(exc).encode())
        finally:
            os._exit(status)
    forked_after = time.monotonic() - started
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = pipe.read()
    _, status = waitpid(pid)
    writer.join(5)
    assert os.waitstatus_to_exitcode(status) == 0, answer
    assert int(answer) > 0
    assert forked_after >= 0.2  # fork() waited for the transaction to end
    store.close()


# ---- failures ------------------------------------------------------------------------


def test_locked_database_raises_and_changes_nothing(db: Path) -> None:
    store = open_store(db, busy_timeout=0.2)
    before = granted(store.claim(NS, "a", None, "t", LONG)).fence
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreUnavailable) as info:
            store.claim(NS, "b", None, "t", LONG)
        assert store.path in str(info.value) and "locked" in str(info.value)
        assert isinstance(info.value.__cause__, sqlite3.OperationalError)
        with pytest.raises(StoreUnavailable):
            store.acquire(LOCKS, "b", "o", LONG)
        with pytest.raises(StoreUnavailable):
            store.complete(NS, "a", "t", b"r", LONG)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert store.record(NS, "b") is None
    assert store.lock(LOCKS, "b") is None
    row = store.record(NS, "a")
    assert row is not None and row.state == "in_flight"
    # nothing was consumed: "b" gets the first fence of a new key, "a" its next one
    assert granted(store.claim(NS, "b", None, "t", LONG)).fence == 1
    assert before == 1
    store.close()


async def test_locked_database_async(db: Path) -> None:
    astore = open_async(url_of(db), busy_timeout=0.1)[0]
    assert isinstance(astore, SQLiteAsyncStore)
    granted(await astore.claim(NS, "a", None, "t", LONG))
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(StoreUnavailable, match="locked"):
            await astore.claim(NS, "b", None, "t", LONG)
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert await astore.record(NS, "b") is None
    await astore.aclose()


def test_a_failed_statement_changes_nothing(db: Path) -> None:
    store = open_store(db)
    granted(store.claim(NS, "a", None, "t", LONG))
    raw = sqlite3.connect(db, isolation_level=None)
    # Make each write fail after its row is written (ABORT: the statement's own
    # changes are undone; a one-statement call is a transaction of its own).
    for table in ("claims", "locks"):
        raw.execute(
            f"CREATE TRIGGER boom_{table} AFTER INSERT ON {table} "
            "BEGIN SELECT RAISE(ABORT, 'boom'); END"
        )
    with pytest.raises(StoreUnavailable, match="boom"):
        store.claim(NS, "b", None, "t", LONG)
    with pytest.raises(StoreUnavailable, match="boom"):
        store.acquire(LOCKS, "b", "o", LONG)
    assert store.record(NS, "b") is None
    assert store.lock(LOCKS, "b") is None
    raw.execute("DROP TRIGGER boom_claims")
    raw.execute("DROP TRIGGER boom_locks")
    raw.close()
    assert granted(store.claim(NS, "b", None, "t", LONG)).fence == 1
    store.close()


def test_failure_inside_a_transaction_rolls_it_back(db: Path) -> None:
    store = open_store(db)
    claim = granted(store.claim(NS, "a", None, "t", LONG))
    lease = store.acquire(LOCKS, "b", "o", LONG)
    assert isinstance(lease, Acquired)
    raw = sqlite3.connect(db, isolation_level=None)
    # FAIL keeps what its statement wrote: only the rollback of the whole transaction
    # undoes the claim's extension made by the statement before it.
    raw.execute(
        "CREATE TRIGGER boom_locks AFTER UPDATE ON locks BEGIN SELECT RAISE(FAIL, 'boom'); END"
    )
    items = [("claim", NS, "a", "t", 3 * LONG), ("lock", LOCKS, "b", "o", lease.token, LONG)]
    with pytest.raises(StoreUnavailable, match="boom"):
        store.renew_many(items)
    row = store.record(NS, "a")
    assert row is not None and row.expires_ms == claim.expires_ms
    raw.execute("DROP TRIGGER boom_locks")
    raw.close()
    assert store.renew_many(items)[0] is not None
    store.close()


def test_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_bytes(b"these are my notes, not a database\n" * 200)
    store = open_store(path)
    with pytest.raises(StoreUnavailable) as info:
        store.claim(NS, "k", None, "t", LONG)
    assert store.path in str(info.value)
    assert isinstance(info.value, StoreCorrupt)
    assert isinstance(info.value.__cause__, sqlite3.DatabaseError)
    coord = idemlock.connect(url_of(path))
    with pytest.raises(StoreUnavailable):
        coord.idempotency("x").claim("k")
    coord.close()
    assert path.read_bytes().startswith(b"these are my notes")


def test_a_directory_in_place_of_the_file(tmp_path: Path) -> None:
    store = open_store(tmp_path)
    with pytest.raises(StoreUnavailable) as info:
        store.acquire(LOCKS, "k", "o", LONG)
    assert store.path in str(info.value)


def test_rows_we_did_not_write_raise_store_corrupt(db: Path) -> None:
    store = open_store(db)
    granted(store.claim(NS, "warmup", None, "t", LONG))
    raw = sqlite3.connect(db, isolation_level=None)
    raw.execute(
        "INSERT INTO claims (ns, key, state, token, fence, fp, expires_ms, result) "
        "VALUES (?, 'bad', 'exploded', 't', 1, NULL, ?, NULL)",
        (NS, time.time_ns() // 1_000_000 + LONG),
    )
    raw.execute(
        "INSERT INTO locks VALUES (?, 'bad', 'o', 'not-a-number', ?)",
        (LOCKS, time.time_ns() // 1_000_000 + LONG),
    )
    raw.close()
    with pytest.raises(StoreCorrupt, match="exploded"):
        store.claim(NS, "bad", None, "t2", LONG)
    with pytest.raises(StoreCorrupt):
        store.record(NS, "bad")
    # a listing shows the foreign row as corrupt instead of failing (A3)
    assert {r.key: r.state for r in store.records(NS)} == {"bad": "corrupt", "warmup": "in_flight"}
    assert [(r.key, r.corrupt) for r in store.locks(LOCKS)] == [("bad", True)]
    with pytest.raises(StoreCorrupt):
        store.acquire(LOCKS, "bad", "other", LONG)
    with pytest.raises(StoreCorrupt):
        store.lock(LOCKS, "bad")
    # the failed calls left the good rows alone and the store usable
    assert store.record(NS, "warmup") is not None
    store.close()


def test_a_file_from_another_schema_version(db: Path) -> None:
    store = open_store(db)
    granted(store.claim(NS, "k", None, "t", LONG))
    store.close()
    raw = sqlite3.connect(db, isolation_level=None)
    raw.execute("UPDATE meta SET value = 99 WHERE name = 'schema'")
    raw.close()
    with pytest.raises(StoreCorrupt, match="version 99"):
        open_store(db).record(NS, "k")


# ---- URLs and options ------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "sqlite://",
        "sqlite:///",
        "sqlite:////",
        "sqlite://host/file.db",
        "sqlite://localhost/tmp/file.db",
        "sqlite:///file.db?journal=off",
        "sqlite:///file.db?busy_timeout=1&busy_timeout=2",
        "sqlite:///file.db?busy_timeout=soon",
        "sqlite:///file.db?busy_timeout=-1",
        "sqlite:///file.db?=",
        "sqlite:///:memory:",
        "sqlite:///file:x.db?mode=ro",
        "sqlite:///dir/",
    ],
)
def test_malformed_urls(url: str) -> None:
    with pytest.raises(ConfigurationError) as info:
        open_sync(url)
    assert "sqlite" in str(info.value).lower()
    with pytest.raises(ConfigurationError):
        idemlock.connect(url)
    with pytest.raises(ConfigurationError):
        idemlock.aio.connect(url)


@pytest.mark.parametrize(
    "options",
    [
        {"busy_timeout": -1},
        {"busy_timeout": True},
        {"busy_timeout": float("nan")},
        {"busy_timeout": "abc"},
        {"max_keys": 10},
        {"clock": None},
    ],
)
def test_bad_options(tmp_path: Path, options: dict[str, Any]) -> None:
    with pytest.raises(ConfigurationError, match="busy_timeout"):
        open_sync(url_of(tmp_path / "x.db"), **options)


def test_busy_timeout_given_twice(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="twice"):
        open_sync(f"{url_of(tmp_path / 'x.db')}?busy_timeout=1", busy_timeout=2)


def test_an_explicit_path_in_a_missing_directory_is_refused(tmp_path: Path) -> None:
    """As sqlite3 would: the store does not create the directories of a path it was
    given (as root, the docs' sqlite:////var/lib/app/idemlock.db made /var/lib/app/),
    it says which is missing and what to do, at once, whichever way it is opened."""
    missing = tmp_path / "var" / "lib" / "app"
    url = url_of(missing / "idemlock.db")
    openers: list[Any] = [
        lambda: idemlock.connect(url),
        lambda: idemlock.aio.connect(url),
        lambda: open_sync(url),
        lambda: open_async(url),
        lambda: SQLiteStore(str(missing / "idemlock.db")),
    ]
    for opener in openers:
        with pytest.raises(ConfigurationError) as info:
            opener()
        text = str(info.value)
        assert str(missing) in text and "does not exist" in text and "create it" in text
    assert not (tmp_path / "var").exists()

    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigurationError, match="is not a directory"):
        idemlock.connect(url_of(tmp_path / "file" / "x.db"))


def test_the_default_file_gets_its_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the default file (no URL, no $IDEMLOCK_URL: the user's state directory)
    has its directory created for it, sync and asyncio."""
    state = tmp_path / "state" / "deeper"
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    monkeypatch.delenv("IDEMLOCK_URL", raising=False)
    coord = idemlock.connect()
    assert coord.idempotency("job").claim("k") is not None
    coord.close()
    assert (state / "idemlock" / "idemlock.db").is_file()

    shutil.rmtree(state)

    async def main() -> None:
        acoord = idemlock.aio.connect()
        assert await acoord.idempotency("job").claim("k") is not None
        await acoord.close()

    asyncio.run(main())
    assert (state / "idemlock" / "idemlock.db").is_file()


def test_url_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub/dir").mkdir(parents=True)  # an explicit path's directory must exist
    rel = open_store("sub/dir/rel.db")  # sqlite:///sub/dir/rel.db: relative to the cwd
    assert rel.path == str((tmp_path / "sub/dir/rel.db").resolve())
    assert rel.busy_timeout == 5.0
    granted(rel.claim(NS, "k", None, "t", LONG))
    assert (tmp_path / "sub/dir/rel.db").is_file()
    rel.close()

    absolute = open_sync(f"sqlite:///{tmp_path}/abs.db?busy_timeout=0.5")[0]
    assert absolute.path == str((tmp_path / "abs.db").resolve()) and absolute.busy_timeout == 0.5
    absolute.close()
    td = open_sync(url_of(tmp_path / "td.db"), busy_timeout=timedelta(seconds=2))[0]
    assert td.busy_timeout == 2.0

    coord = idemlock.connect(f"SQLITE:///{tmp_path}/conn.db", busy_timeout=1)
    assert coord.store.kind == "sqlite" and coord.poll_cap == 0.02
    coord.close()
    acoord = idemlock.aio.connect(url_of(tmp_path / "conn.db"))
    assert acoord.store.kind == "sqlite" and acoord.poll_cap == 0.02
    asyncio.run(acoord.close())


# ---- wake-ups and the async face ---------------------------------------------------------


def test_freeing_a_key_wakes_waiters_in_this_process(db: Path, tmp_path: Path) -> None:
    a, b = open_store(db), open_store(db)
    elsewhere = open_store(tmp_path / "other.db")
    claim_sub = a.subscribe(Channel("claim", NS, "k"))
    lock_sub = a.subscribe(Channel("lock", LOCKS, "k"))
    far_sub = elsewhere.subscribe(Channel("claim", NS, "k"))
    try:
        g = granted(b.claim(NS, "k", None, "t", LONG))
        assert claim_sub.wait(0) is False  # a claim frees nothing
        assert b.complete(NS, "k", g.token, b"r", LONG)
        assert claim_sub.wait(5) is True
        assert b.forget(NS, "k")
        assert claim_sub.wait(5) is True
        g = granted(b.claim(NS, "k", None, "t2", LONG))
        assert b.abandon(NS, "k", g.token)
        assert claim_sub.wait(5) is True
        assert far_sub.wait(0) is False  # another file is another hub key

        lease = b.acquire(LOCKS, "k", "o", LONG)
        assert isinstance(lease, Acquired)
        assert lock_sub.wait(0) is False
        assert b.release(LOCKS, "k", "o", lease.token)
        assert lock_sub.wait(5) is True
        assert claim_sub.wait(0) is False
    finally:
        for sub in (claim_sub, lock_sub, far_sub):
            sub.close()
        for s in (a, b, elsewhere):
            s.close()


async def test_async_store_wakes_and_races(db: Path) -> None:
    astore = open_async(url_of(db))[0]
    sub = await astore.subscribe(Channel("claim", NS, "w"))
    g = granted(await astore.claim(NS, "w", None, "t", LONG))
    waiter = asyncio.ensure_future(sub.wait(10))
    await asyncio.sleep(0)
    assert await astore.complete(NS, "w", g.token, b"r", LONG)
    assert await waiter is True
    await sub.aclose()

    coord = idemlock.aio.connect(url_of(db), key_prefix="aio")
    port = coord.idempotency("job")
    for i in range(3):
        results = await asyncio.gather(*(port.claim(f"r{i}", payload={"i": i}) for _ in range(20)))
        assert sum(isinstance(r, Claimed) for r in results) == 1
        assert sum(isinstance(r, InFlight) for r in results) == 19
    await coord.close()
    await astore.aclose()


def test_a_waiter_in_this_process_is_handed_the_result(db: Path) -> None:
    coord = idemlock.connect(url_of(db), key_prefix="hand")
    other = idemlock.connect(url_of(db), key_prefix="hand")
    port, port2 = coord.idempotency("job"), other.idempotency("job")
    claim = port.claim("k", payload=1)
    assert isinstance(claim, Claimed)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(port2.wait("k", payload=1, timeout=30)))
    waiter.start()
    time.sleep(0.05)
    port.complete(claim.token, "result")
    waiter.join(timeout=60)
    assert not waiter.is_alive(), "still running after 60 s"
    assert isinstance(got[0], Completed) and got[0].result == "result"
    coord.close()
    other.close()
