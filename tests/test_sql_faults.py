"""Failure paths of the SQL stores (PostgreSQL and SQLite), on real servers and files:
late completion, silent networks, fork, cancellation, bursts, edge inputs, foreign
rows and connection failures (issue 10).
"""

from __future__ import annotations

import logging
import sqlite3
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import idemlock
from idemlock import ConfigurationError
from idemlock._core.port import Acquired, Granted
from idemlock.stores import postgres as pg
from idemlock.stores.sqlite import open_sync as sqlite_open

LONG = 60_000  # ms


def granted(reply: object) -> Granted:
    assert isinstance(reply, Granted), reply
    return reply


@pytest.fixture
def ns() -> str:
    return "t" + uuid.uuid4().hex[:10] + ":job"


@pytest.fixture(params=["sqlite", "postgres"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def url(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if kind == "sqlite":
        return f"sqlite:///{tmp_path}/faults.db"
    dsn: str = request.getfixturevalue("postgres_dsn")
    return dsn


@pytest.fixture
def store(url: str, kind: str) -> Iterator[Any]:
    s: Any = sqlite_open(url)[0] if kind == "sqlite" else pg.open_sync(url)[0]
    yield s
    s.close()


def _expire(store: Any) -> None:
    """Let a 50 ms lease run out on the store's clock."""
    time.sleep(0.12)


# ---- 4: late completion (A2) ------------------------------------------------------------


def test_complete_after_the_lease_ended_is_accepted(store: Any, ns: str) -> None:
    g = granted(store.claim(ns, "k", "fp", "tok", 50))
    _expire(store)
    assert store.complete(ns, "k", "tok", b"result", LONG) is True
    rec = store.record(ns, "k")
    assert rec is not None and rec.state == "completed" and rec.fence == g.fence


def test_abandon_after_the_lease_ended_is_accepted(store: Any, ns: str) -> None:
    g = granted(store.claim(ns, "k", None, "tok", 50))
    _expire(store)
    assert store.abandon(ns, "k", "tok") is True
    assert store.record(ns, "k") is None
    # the fence still rises for the next attempt
    assert granted(store.claim(ns, "k", None, "tok2", LONG)).fence > g.fence


def test_late_completion_is_refused_once_the_key_was_taken_over(store: Any, ns: str) -> None:
    granted(store.claim(ns, "k", None, "old", 50))
    _expire(store)
    granted(store.claim(ns, "k", None, "new", LONG))
    assert store.complete(ns, "k", "old", b"late", LONG) is False
    assert store.abandon(ns, "k", "old") is False
    assert store.complete(ns, "k", "new", b"mine", LONG) is True


def test_late_completion_is_refused_after_abandon_or_forget(store: Any, ns: str) -> None:
    granted(store.claim(ns, "a", None, "t", 50))
    assert store.abandon(ns, "a", "t") is True
    _expire(store)
    assert store.complete(ns, "a", "t", b"late", LONG) is False
    assert store.abandon(ns, "a", "t") is False

    granted(store.claim(ns, "f", None, "t", 50))
    assert store.forget(ns, "f") is True
    _expire(store)
    assert store.complete(ns, "f", "t", b"late", LONG) is False
    assert store.record(ns, "f") is None


def test_extend_and_renew_after_expiry_stay_refused(store: Any, ns: str) -> None:
    granted(store.claim(ns, "k", None, "t", 50))
    lease = store.acquire(ns, "L", "me", 50)
    assert isinstance(lease, Acquired)
    _expire(store)
    assert store.extend(ns, "k", "t", LONG) is None
    assert store.renew(ns, "L", "me", lease.token, LONG) is None


# ---- 22: a foreign or corrupt row under the prefix is listed, not fatal (A3) ----------


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


def _insert_foreign(kind: str, url: str, ns: str) -> None:
    far = _now_ms() + LONG
    if kind == "sqlite":
        raw = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        raw.execute(
            "INSERT INTO claims VALUES (?, 'bad', 'exploded', 't', 7, NULL, ?, NULL)", (ns, far)
        )
        raw.execute(
            "INSERT INTO claims VALUES (?, 'bad2', 'completed', 't', 'x', NULL, ?, NULL)", (ns, far)
        )
        raw.execute("INSERT INTO locks VALUES (?, 'bad', 'o', 'not-a-number', ?)", (ns, far))
        raw.close()
    else:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO idemlock.claims (ns, key, state, token, fence, expires_ms) "
                "VALUES (%s, 'bad', 'exploded', 't', 7, %s)",
                (ns, far),
            )


def test_listings_show_foreign_rows_as_corrupt(
    store: Any, kind: str, url: str, ns: str, caplog: pytest.LogCaptureFixture
) -> None:
    granted(store.claim(ns, "good", None, "t", LONG))
    assert isinstance(store.acquire(ns, "good", "me", LONG), Acquired)
    _insert_foreign(kind, url, ns)
    with caplog.at_level(logging.WARNING, logger="idemlock"):
        rows = {r.key: r for r in store.records(ns)}
        locks = {r.key: r for r in store.locks(ns)}
    assert rows["good"].state == "in_flight"
    assert rows["bad"].state == "corrupt" and rows["bad"].fence == 7
    assert locks["good"].corrupt is False and locks["good"].owner == "me"
    if kind == "sqlite":
        assert rows["bad2"].state == "corrupt" and rows["bad2"].fence == 0
        assert locks["bad"].corrupt is True and (locks["bad"].owner, locks["bad"].token) == ("", 0)
    warnings = [r for r in caplog.records if r.name == "idemlock" and "corrupt" in r.message]
    assert len(warnings) >= 1


# ---- 16: integers beyond 64 bits: the same ConfigurationError on both stores --------------


@pytest.mark.parametrize("token", [2**63, 2**64 + 5, -(2**63) - 1])
def test_out_of_range_tokens_are_a_configuration_error(store: Any, ns: str, token: int) -> None:
    calls = [
        lambda: store.fence_advance(ns, "res", token),
        lambda: store.release(ns, "L", "me", token),
        lambda: store.renew(ns, "L", "me", token, LONG),
    ]
    for call in calls:
        with pytest.raises(ConfigurationError):
            call()
    assert store.fence_current(ns, "res") is None
    assert store.fence_advance(ns, "res", 2**63 - 1) == (True, 2**63 - 1)


def test_out_of_range_gate_tokens_through_the_coordinator(url: str) -> None:
    coord = idemlock.connect(url, key_prefix="g" + uuid.uuid4().hex[:8])
    try:
        gate = coord.fence("res")
        for token in (2**63, 2**70):
            with pytest.raises(ConfigurationError):
                gate.check_and_advance(token)
        assert gate.check_and_advance(2**63 - 1) == 2**63 - 1
    finally:
        coord.close()


def test_out_of_range_tokens_in_fenced_writes(postgres_dsn: str) -> None:
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        name = "t_" + uuid.uuid4().hex[:10]
        conn.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v int, fence_token bigint)")
        conn.execute(f"INSERT INTO {name} (id, v) VALUES (1, 0)")
        for token in (2**63, -1):
            with pytest.raises(ConfigurationError):
                pg.fenced_update(conn, name, {"v": 1}, {"id": 1}, token)
            with pytest.raises(ConfigurationError):
                pg.fenced_upsert(conn, name, {"id": 1, "v": 1}, ["id"], token)
        assert pg.fenced_update(conn, name, {"v": 2}, {"id": 1}, 2**63 - 1) == 1
