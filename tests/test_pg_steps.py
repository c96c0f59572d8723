"""Steps inside a claim on PostgreSQL (table ``claim_steps``, layout 4; their end in
the claims row, layout 5): what the
contract (tests/contract/test_steps.py, the step.* rows of test_table.py) cannot see.
A schema of the previous layout upgrades in place and keeps its records; a step row
changed by something else is reported as StoreCorrupt; complete (also in the caller's
transaction), forget and purge treat the steps as the table says, judged in the rows
themselves. No waiting on the clock: where a step must have ended, the test ends it
in its rows (a step is over when both its key's ``steps_ms`` and its own ``until_ms``
are behind the database clock).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import idemlock
import idemlock.aio
from idemlock import IdempotencySpec, StoreCorrupt
from idemlock._core.port import Granted, StepRow
from idemlock.stores import postgres as pg
from idemlock.stores.postgres._sql import (
    bootstrap_statements,
    migration_statements,
    record_version,
)

LEASE = 60_000
TTL = 600_000


@pytest.fixture
def schema() -> str:
    return "st_" + uuid.uuid4().hex[:10]


@pytest.fixture
def coord(postgres_dsn: str, schema: str) -> Iterator[idemlock.Coordinator]:
    coord = idemlock.connect(postgres_dsn, key_prefix="steps", schema=schema)
    yield coord
    coord.close()


def _sql(dsn: str, query: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


def _steps_rows(dsn: str, schema: str, key: str) -> list[tuple[Any, ...]]:
    return _sql(
        dsn,
        f"SELECT name, fence, result, until_ms FROM {schema}.claim_steps "
        "WHERE key = %s ORDER BY name",
        (key,),
    )


def _end(dsn: str, schema: str, key: str) -> int:
    """The end of the key's steps, kept in its claims row."""
    return int(_sql(dsn, f"SELECT steps_ms FROM {schema}.claims WHERE key = %s", (key,))[0][0])


def _end_steps(dsn: str, schema: str, key: str) -> None:
    """The key's steps over: their end and every row's own set behind the clock."""
    _sql(dsn, f"UPDATE {schema}.claims SET steps_ms = 1 WHERE key = %s", (key,))
    _sql(dsn, f"UPDATE {schema}.claim_steps SET until_ms = 1 WHERE key = %s", (key,))


def _granted(store: Any, key: str, token: str) -> Granted:
    got = store.claim("ns", key, None, token, LEASE)
    assert isinstance(got, Granted)
    return got


def _schema_v3(dsn: str, schema: str, last: int = 3) -> None:
    """A schema made by an earlier release: layouts 1 to ``last``, as it ran them."""
    with psycopg.connect(dsn) as conn:
        for stmt in bootstrap_statements(schema):
            conn.execute(stmt)
        for version in range(1, last + 1):
            for stmt in migration_statements(schema, version):
                conn.execute(stmt)
            conn.execute(record_version(schema), {"v": version})


def test_a_version_3_schema_upgrades_in_place_and_keeps_its_records(
    postgres_dsn: str, schema: str
) -> None:
    _schema_v3(postgres_dsn, schema)
    # Records of the previous release: one completed, one in flight (its claim lives on).
    _sql(
        postgres_dsn,
        f"INSERT INTO {schema}.claims (ns, key, state, token, fence, fp, expires_ms, result) "
        f"VALUES ('ns', 'done', 'completed', 't-old', nextval('{schema}.fence_seq'), NULL, "
        "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint + 600000, 'r'::bytea), "
        f"('ns', 'running', 'in_flight', 't-run', nextval('{schema}.fence_seq'), NULL, "
        "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint + 600000, NULL)",
    )
    assert _sql(postgres_dsn, f"SELECT to_regclass('{schema}.claim_steps')") == [(None,)]
    old = dict(_sql(postgres_dsn, f"SELECT key, fence FROM {schema}.claims"))
    # A store of this release refuses the old layout unless it may migrate...
    refused = idemlock.connect(postgres_dsn, key_prefix="up", schema=schema, auto_migrate=False)
    try:
        with pytest.raises(idemlock.ConfigurationError, match="idemlock migrate"):
            refused.store.steps("ns", "running")
    finally:
        refused.close()
    # ...and `idemlock migrate` (pg.migrate) upgrades it.
    assert pg.migrate(postgres_dsn, schema=schema) == pg.SCHEMA_VERSION == 5
    versions = _sql(postgres_dsn, f"SELECT version FROM {schema}.schema_version ORDER BY 1")
    assert versions == [(v,) for v in range(1, pg.SCHEMA_VERSION + 1)]
    assert _sql(postgres_dsn, f"SELECT count(*) FROM {schema}.claim_steps") == [(0,)]
    coord = idemlock.connect(postgres_dsn, key_prefix="up", schema=schema, auto_migrate=False)
    try:
        store = coord.store
        # The old records read as before.
        done = store.record("ns", "done")
        assert done is not None and (done.state, done.fence) == ("completed", old["done"])
        running = store.record("ns", "running")
        assert running is not None and running.fence == old["running"]
        # The claim of the previous release records steps under the new layout.
        assert store.step("ns", "running", "t-run", "a", b"1", LEASE, TTL) is not None
        assert store.steps("ns", "running") == [StepRow("a", old["running"], b"1")]
        assert store.abandon("ns", "running", "t-run") is True
        again = _granted(store, "running", "t-new")
        assert again.steps == (StepRow("a", old["running"], b"1"),)
        assert again.fence > old["running"]
    finally:
        coord.close()


def test_a_corrupt_step_row_is_store_corrupt(
    coord: idemlock.Coordinator, postgres_dsn: str, schema: str
) -> None:
    store = coord.store
    _granted(store, "k", "t1")
    assert store.step("ns", "k", "t1", "a", b"1", LEASE, TTL) is not None
    assert store.abandon("ns", "k", "t1") is True
    # Something other than idemlock writes a fence no claim ever had.
    _sql(postgres_dsn, f"UPDATE {schema}.claim_steps SET fence = 0 WHERE key = 'k'")
    with pytest.raises(StoreCorrupt, match="fence 0"):
        store.steps("ns", "k")
    with pytest.raises(StoreCorrupt, match="fence 0"):
        store.claim("ns", "k", None, "t2", LEASE)  # the grant carries the steps
    # Forgetting the key recovers it.
    store.forget("ns", "k")
    assert _granted(store, "k", "t3").steps == ()


def test_complete_forget_and_purge_end_the_steps_in_their_rows(
    coord: idemlock.Coordinator, postgres_dsn: str, schema: str
) -> None:
    store = coord.store
    g = _granted(store, "k", "t1")
    assert store.step("ns", "k", "t1", "a", b"1", LEASE, TTL) is not None
    assert store.step("ns", "k", "t1", "b", None, LEASE, 2 * TTL) is not None
    rows = _steps_rows(postgres_dsn, schema, "k")
    # One end for the key's steps, in its claims row: the later of theirs and now + ttl;
    # a row keeps the end it was written with (a later step leaves it alone).
    assert [r[:3] for r in rows] == [("a", g.fence, b"1"), ("b", g.fence, None)]
    assert rows[0][3] < rows[1][3] == _end(postgres_dsn, schema, "k")
    # Steps whose end passed are dropped by the next write, never revived.
    _end_steps(postgres_dsn, schema, "k")
    assert store.steps("ns", "k") == []
    assert store.step("ns", "k", "t1", "c", b"3", LEASE, TTL) is not None
    assert [r[0] for r in _steps_rows(postgres_dsn, schema, "k")] == ["c"]
    assert store.steps("ns", "k") == [StepRow("c", g.fence, b"3")]
    # Completing moves the steps' end to the record's end, in the same statement.
    assert store.complete("ns", "k", "t1", b"r", 5_000) is True
    (expires,) = _sql(postgres_dsn, f"SELECT expires_ms FROM {schema}.claims WHERE key = 'k'")
    assert _end(postgres_dsn, schema, "k") == expires[0]
    assert {r[3] for r in _steps_rows(postgres_dsn, schema, "k")} == {expires[0]}
    # Forgetting the key drops them with the record.
    assert store.forget("ns", "k") is True
    assert _steps_rows(postgres_dsn, schema, "k") == []
    assert _end(postgres_dsn, schema, "k") == 0
    # Purge deletes ended steps and does not count them; live ones stay.
    _granted(store, "p", "t1")
    assert store.step("ns", "p", "t1", "live", b"1", LEASE, TTL) is not None
    _granted(store, "q", "t1")
    assert store.step("ns", "q", "t1", "old", b"1", LEASE, TTL) is not None
    _end_steps(postgres_dsn, schema, "q")
    assert store.purge(dry_run=True) == store.purge() == 1  # the tombstone of "k" only
    assert [r[0] for r in _steps_rows(postgres_dsn, schema, "p")] == ["live"]
    assert _steps_rows(postgres_dsn, schema, "q") == []


def test_a_step_write_changes_no_other_step_row(
    coord: idemlock.Coordinator, postgres_dsn: str, schema: str
) -> None:
    """The end of a key's steps is kept once, in its claims row (layout 5): a step
    inserts its own row and leaves every earlier one as it was (the row versions are
    compared, not times), so a step costs the same however many the key has."""
    store = coord.store
    g = _granted(store, "many", "t1")
    versions = f"SELECT name, xmin::text FROM {schema}.claim_steps WHERE key = 'many'"
    seen: dict[str, str] = {}
    for i in range(20):
        assert store.step("ns", "many", "t1", f"s{i:02d}", b"%d" % i, LEASE, TTL) is not None
        now = dict(_sql(postgres_dsn, versions))
        assert {n: v for n, v in now.items() if n in seen} == seen, i
        seen = now
    assert [s.name for s in store.steps("ns", "many")] == [f"s{i:02d}" for i in range(20)]
    assert {s.fence for s in store.steps("ns", "many")} == {g.fence}


def test_a_step_reads_no_other_step_row(
    coord: idemlock.Coordinator, postgres_dsn: str, schema: str
) -> None:
    """Nor does a step read the key's earlier rows (its scan for ended rows runs only
    when the key's end is behind): the index tuples its statement read, as the
    transaction's own statistics count them, do not grow with the key's steps."""
    store = coord.store
    _granted(store, "many", "t1")
    reads = []
    for n in (1, 40):
        while len(store.steps("ns", "many")) < n:
            i = len(store.steps("ns", "many"))
            assert store.step("ns", "many", "t1", f"s{i:02d}", b"1", LEASE, TTL) is not None
        st = store.statements
        params = st.step.args(
            dict(ns="ns", key="many", token="t1", name=f"x{n}", result=b"2", lease=LEASE, ttl=TTL)
        )
        with psycopg.connect(postgres_dsn) as conn:
            cur = psycopg.RawCursor(conn)
            cur.execute(st.step.sql, params)
            assert cur.fetchall()  # the claim renewed, the step written
            # Index tuples read by this transaction (idx_tup_read, of the primary key)
            cur.execute(
                f"SELECT pg_stat_get_xact_tuples_returned('{schema}.claim_steps_pkey'::regclass)"
            )
            reads.append(cur.fetchone()[0])
            conn.rollback()
    assert reads[1] <= reads[0] + 1, reads


def test_a_version_4_schema_keeps_its_steps(postgres_dsn: str, schema: str) -> None:
    """Layout 4 kept the end of a key's steps in each of its rows: after migration 5
    those rows read as before (their own end), the next step takes their end on, and
    their ended rows go then, not before."""
    _schema_v3(postgres_dsn, schema, last=4)
    now = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"
    _sql(
        postgres_dsn,
        f"INSERT INTO {schema}.claims (ns, key, state, token, fence, fp, expires_ms, result) "
        f"VALUES ('ns', 'run', 'in_flight', 't-run', nextval('{schema}.fence_seq'), NULL, "
        f"{now} + 600000, NULL)",
    )
    ((fence,),) = _sql(postgres_dsn, f"SELECT fence FROM {schema}.claims")
    _sql(
        postgres_dsn,
        f"INSERT INTO {schema}.claim_steps (ns, key, name, fence, result, until_ms) VALUES "
        f"('ns', 'run', 'a', %s, 'x'::bytea, {now} + 900000), "
        f"('ns', 'run', 'b', %s, NULL, {now} + 900000), ('ns', 'run', 'gone', %s, NULL, 1)",
        (fence, fence, fence),
    )
    assert pg.migrate(postgres_dsn, schema=schema) == pg.SCHEMA_VERSION == 5
    assert _sql(postgres_dsn, f"SELECT steps_ms, steps_from FROM {schema}.claims") == [(0, 0)]
    coord = idemlock.connect(postgres_dsn, key_prefix="up", schema=schema, auto_migrate=False)
    try:
        store = coord.store
        assert store.steps("ns", "run") == [StepRow("a", fence, b"x"), StepRow("b", fence, None)]
        ((until,),) = _sql(postgres_dsn, f"SELECT max(until_ms) FROM {schema}.claim_steps")
        # The first step of layout 5 keeps their later end, drops the ended row.
        assert store.step("ns", "run", "t-run", "c", b"3", LEASE, 1000) is not None
        assert _end(postgres_dsn, schema, "run") == until
        assert [r[0] for r in _steps_rows(postgres_dsn, schema, "run")] == ["a", "b", "c"]
        assert store.abandon("ns", "run", "t-run") is True
        again = _granted(store, "run", "t-new")
        assert [s.name for s in again.steps] == ["a", "b", "c"]
    finally:
        coord.close()


def test_purge_keeps_the_row_of_a_key_with_live_steps(
    coord: idemlock.Coordinator, postgres_dsn: str, schema: str
) -> None:
    """CLAIM_FAST reads no steps (the hot path is unchanged): a new key has none,
    because purge keeps the claims row of a key whose steps live."""
    store = coord.store
    g = _granted(store, "k", "t1")
    assert store.step("ns", "k", "t1", "a", b"1", LEASE, TTL) is not None
    # A resend (the same token again) carries the steps too.
    assert _granted(store, "k", "t1").steps == (StepRow("a", g.fence, b"1"),)
    assert store.abandon("ns", "k", "t1") is True
    assert store.purge(dry_run=True) == store.purge() == 0  # the tombstone stays
    assert _sql(postgres_dsn, f"SELECT count(*) FROM {schema}.claims") == [(1,)]
    again = _granted(store, "k", "t2")
    assert again.steps == (StepRow("a", g.fence, b"1"),) and again.fence > g.fence
    # Once the steps ended, the tombstone goes with them.
    assert store.abandon("ns", "k", "t2") is True
    _end_steps(postgres_dsn, schema, "k")
    assert store.purge(dry_run=True) == store.purge() == 1
    assert _sql(postgres_dsn, f"SELECT count(*) FROM {schema}.claims") == [(0,)]
    assert _steps_rows(postgres_dsn, schema, "k") == []
    assert _granted(store, "k", "t3").steps == ()


def test_complete_in_transaction_ends_the_steps_with_the_record(
    coord: idemlock.Coordinator, postgres_dsn: str, schema: str
) -> None:
    port = coord.idempotency(IdempotencySpec("job", ttl=timedelta(minutes=5)))
    store = coord.store
    for commit in (False, True):
        claim = port.claim(f"k{commit}")
        assert isinstance(claim, idemlock.Claimed)
        tok = claim.token
        assert store.step(tok._ns, tok._skey, tok.token, "a", b"1", LEASE, TTL) is not None
        (before,) = {r[3] for r in _steps_rows(postgres_dsn, schema, tok._skey)}
        with psycopg.connect(postgres_dsn) as conn:
            pg.complete_in_transaction(conn, port, tok, "done")
            if not commit:
                conn.rollback()
        rows = _sql(
            postgres_dsn, f"SELECT expires_ms FROM {schema}.claims WHERE key = %s", (tok._skey,)
        )
        ends = {r[3] for r in _steps_rows(postgres_dsn, schema, tok._skey)}
        if commit:
            assert ends == {rows[0][0]} and port.status(f"k{commit}").state == "completed"
        else:
            assert ends == {before} and port.status(f"k{commit}").state == "in_flight"


# ---- a step recorded in the caller's transaction ----------------------------------------


def _holds(dsn: str) -> str:
    """A table of the caller's own: the step's write lands there."""
    table = "holds_" + uuid.uuid4().hex[:10]
    _sql(dsn, f"CREATE TABLE {table} (id text PRIMARY KEY)")
    return table


def _ids(dsn: str, table: str) -> set[str]:
    return {r[0] for r in _sql(dsn, f"SELECT id FROM {table}")}


def _step_names(port: Any, key: str) -> list[tuple[str, str]]:
    status = port.status(key)
    return [] if status is None else [(s.name, s.state) for s in status.steps]


def _never() -> Any:
    raise AssertionError("a recorded step ran again")


def test_a_step_recorded_in_the_transaction_commits_with_the_write_and_replays(
    coord: idemlock.Coordinator, postgres_dsn: str
) -> None:
    table = _holds(postgres_dsn)
    port = coord.idempotency(IdempotencySpec("job"))
    ran: list[str] = []

    def reserve(attempt: idemlock.Attempt, order: str) -> dict[str, str]:
        ran.append(order)
        with psycopg.connect(postgres_dsn) as conn, conn.transaction():
            conn.execute(f"INSERT INTO {table} VALUES (%s)", (order,))
            pg.record_step_in_transaction(conn, attempt, "reserve", {"hold": order})
        return {"hold": order}

    # In the step's function: its write and its record commit together; a crash after
    # it leaves both, and the retry replays the step instead of running it again.
    with pytest.raises(RuntimeError, match="crash"), port.run("A17") as attempt:
        assert attempt.step("reserve", reserve, attempt, "A17") == {"hold": "A17"}
        assert _ids(postgres_dsn, table) == {"A17"}
        assert _step_names(port, "A17") == [("reserve", "done")]
        raise RuntimeError("crash after the step")
    with port.run("A17") as attempt:
        assert attempt.step("reserve", reserve, attempt, "A17") == {"hold": "A17"}
        attempt.result = "reserved"
    assert ran == ["A17"] and _ids(postgres_dsn, table) == {"A17"}
    status = port.status("A17")
    assert status is not None and status.state == "completed"

    # Outside a step: once the transaction committed, a later step of the same name in
    # this attempt replays the value; the name stays taken, as any step's.
    with port.run("B2") as attempt:
        with psycopg.connect(postgres_dsn) as conn, conn.transaction():
            conn.execute(f"INSERT INTO {table} VALUES ('B2')")
            pg.record_step_in_transaction(conn, attempt, "hold", 7)
        assert attempt.step("hold", _never) == 7
        with pytest.raises(idemlock.DuplicateStep):
            attempt.step("hold", _never)
        with (
            pytest.raises(idemlock.DuplicateStep),
            psycopg.connect(postgres_dsn) as conn,
            conn.transaction(),
        ):
            pg.record_step_in_transaction(conn, attempt, "hold", 8)
        attempt.result = "held"
    assert _step_names(port, "B2") == [("hold", "done")]


def test_a_step_recorded_in_a_transaction_that_rolls_back_is_not_recorded(
    coord: idemlock.Coordinator, postgres_dsn: str
) -> None:
    table = _holds(postgres_dsn)
    port = coord.idempotency(IdempotencySpec("job"))
    with port.run("C3") as attempt:
        with (
            pytest.raises(RuntimeError, match="later"),
            psycopg.connect(postgres_dsn) as conn,
            conn.transaction(),
        ):
            conn.execute(f"INSERT INTO {table} VALUES ('C3')")
            pg.record_step_in_transaction(conn, attempt, "hold", 1)
            raise RuntimeError("the rest of the transaction failed later")
        assert _ids(postgres_dsn, table) == set()
        assert _step_names(port, "C3") == []
        # Nothing was recorded: the step runs, and its own result is the record.
        assert attempt.step("hold", lambda: 2) == 2
        attempt.result = "held"
    assert _step_names(port, "C3") == [("hold", "done")]

    # The same inside a step's function: the exception leaves the step unrecorded,
    # and the retry runs it.
    def failing(attempt: idemlock.Attempt) -> int:
        with psycopg.connect(postgres_dsn) as conn, conn.transaction():
            conn.execute(f"INSERT INTO {table} VALUES ('D4')")
            pg.record_step_in_transaction(conn, attempt, "hold", 1)
            raise RuntimeError("rolled back")

    with pytest.raises(RuntimeError, match="rolled back"), port.run("D4") as attempt:
        attempt.step("hold", failing, attempt)
    with port.run("D4") as attempt:
        assert attempt.step("hold", lambda: 3) == 3
    assert _ids(postgres_dsn, table) == set()


def test_a_late_attempt_gets_claim_lost_before_its_transaction_commits(
    coord: idemlock.Coordinator, postgres_dsn: str
) -> None:
    table = _holds(postgres_dsn)
    short = coord.idempotency(IdempotencySpec("short", lease=timedelta(milliseconds=200)))
    # The same spec with a long lease: the winner's claim lives until the checks end.
    long = coord.idempotency(IdempotencySpec("short", lease=timedelta(minutes=5)))
    with pytest.raises(RuntimeError, match="left"), short.run("E5", heartbeat=False) as late:
        # A paused process: its lease lapses and another attempt takes the key over.
        deadline = time.monotonic() + 10
        winner = long.claim("E5")
        while not isinstance(winner, idemlock.Claimed):
            assert time.monotonic() < deadline, "the lease never lapsed"
            winner = long.claim("E5")
        assert winner.fence > (late.fence or 0)
        with (
            pytest.raises(idemlock.ClaimLost, match="refused step 'hold'"),
            psycopg.connect(postgres_dsn) as conn,
            conn.transaction(),
        ):
            conn.execute(f"INSERT INTO {table} VALUES ('late')")
            pg.record_step_in_transaction(conn, late, "hold", 1)
            raise AssertionError("not reached: the caller sees ClaimLost before commit")
        raise RuntimeError("left the late attempt")
    # The late attempt's write rolled back with its refused step; the winner's claim
    # is untouched.
    assert _ids(postgres_dsn, table) == set()
    assert _step_names(short, "E5") == []
    status = short.status("E5")
    assert status is not None and (status.state, status.fence) == ("in_flight", winner.fence)


def test_record_step_in_transaction_refusals(
    coord: idemlock.Coordinator, postgres_dsn: str, schema: str
) -> None:
    port = coord.idempotency(IdempotencySpec("job"))
    with psycopg.connect(postgres_dsn, autocommit=True) as conn, port.run("F6") as attempt:
        # On an autocommit connection outside a transaction it would commit on its own.
        with pytest.raises(idemlock.ConfigurationError, match="inside your transaction"):
            pg.record_step_in_transaction(conn, attempt, "a", 1)
        with (
            pytest.raises(idemlock.ConfigurationError, match="expected the attempt"),
            conn.transaction(),
        ):
            pg.record_step_in_transaction(conn, port, "a", 1)  # type: ignore[arg-type]  # the refusal under test
        attempt.step("a", lambda: 1)
        with pytest.raises(idemlock.DuplicateStep, match="already ran"), conn.transaction():
            pg.record_step_in_transaction(conn, attempt, "a", 1)
    with pytest.raises(RuntimeError, match="abandon"), port.run("G7") as attempt:
        attempt.step("a", lambda: 1)
        raise RuntimeError("abandon the claim, keeping step a")
    # A retry: an earlier attempt recorded the step, so recording it again in a
    # transaction would repeat its writes.
    with psycopg.connect(postgres_dsn) as conn, port.run("G7") as attempt:
        with pytest.raises(idemlock.DuplicateStep, match="earlier attempt"), conn.transaction():
            pg.record_step_in_transaction(conn, attempt, "a", 2)
        assert attempt.step("a", _never) == 1
        attempt.result = "done"
    # A key completed already: no step runs.
    with psycopg.connect(postgres_dsn) as conn, port.run("G7") as replayed:
        assert replayed.replayed
        with (
            pytest.raises(idemlock.ConfigurationError, match="completed already"),
            conn.transaction(),
        ):
            pg.record_step_in_transaction(conn, replayed, "b", 1)
    # A value over the limit is refused before anything is written, naming the step.
    small = idemlock.connect(postgres_dsn, key_prefix="small", schema=schema, max_result_bytes=1024)
    try:
        with (
            psycopg.connect(postgres_dsn) as conn,
            small.idempotency(IdempotencySpec("job")).run("H8") as attempt,
        ):
            with pytest.raises(idemlock.ResultTooLarge, match="step 'blob'"), conn.transaction():
                pg.record_step_in_transaction(conn, attempt, "blob", "x" * 2048)
            assert attempt.step("blob", lambda: "small") == "small"
    finally:
        small.close()
    # An attempt on another store.
    memory = idemlock.connect("memory://")
    try:
        with (
            psycopg.connect(postgres_dsn) as conn,
            memory.idempotency(IdempotencySpec("job")).run("I9") as attempt,
            pytest.raises(idemlock.ConfigurationError, match="PostgreSQL store"),
            conn.transaction(),
        ):
            pg.record_step_in_transaction(conn, attempt, "a", 1)
    finally:
        memory.close()


async def test_arecord_step_in_transaction(postgres_dsn: str, schema: str) -> None:
    table = _holds(postgres_dsn)
    coord = idemlock.aio.connect(postgres_dsn, key_prefix="asteps", schema=schema)
    port = coord.idempotency(IdempotencySpec("job"))
    ran: list[str] = []

    async def reserve(attempt: idemlock.aio.AsyncAttempt, order: str, fail: bool) -> str:
        ran.append(order)
        conn = await psycopg.AsyncConnection.connect(postgres_dsn)
        async with conn, conn.transaction():
            await conn.execute(f"INSERT INTO {table} VALUES (%s)", (order,))
            await pg.arecord_step_in_transaction(conn, attempt, "reserve", order)
            if fail:
                raise RuntimeError("rolled back")
        return order

    try:
        with pytest.raises(RuntimeError, match="rolled back"):
            async with port.run("A1") as attempt:
                await attempt.step("reserve", reserve, attempt, "A1", True)
        assert _ids(postgres_dsn, table) == set()
        with pytest.raises(RuntimeError, match="crash"):
            async with port.run("A1") as attempt:
                assert await attempt.step("reserve", reserve, attempt, "A1", False) == "A1"
                raise RuntimeError("crash after the step")
        async with port.run("A1") as attempt:
            assert await attempt.step("reserve", reserve, attempt, "A1", False) == "A1"
            attempt.result = "reserved"
        assert ran == ["A1", "A1"] and _ids(postgres_dsn, table) == {"A1"}
        # Outside a step, then the step replays it in the same attempt.
        async with port.run("B2") as attempt:
            conn = await psycopg.AsyncConnection.connect(postgres_dsn)
            async with conn, conn.transaction():
                await pg.arecord_step_in_transaction(conn, attempt, "hold", [1, 2])
            assert await attempt.step("hold", _never) == [1, 2]
        status = await port.status("B2")
        assert status is not None and [s.name for s in status.steps] == ["hold"]
    finally:
        await coord.close()
