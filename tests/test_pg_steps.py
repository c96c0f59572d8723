"""Steps inside a claim on PostgreSQL (table ``claim_steps``, layout 4): what the
contract (tests/contract/test_steps.py, the step.* rows of test_table.py) cannot see.
A schema of the previous layout upgrades in place and keeps its records; a step row
changed by something else is reported as StoreCorrupt; complete (also in the caller's
transaction), forget and purge treat the steps as the table says, judged in the rows
themselves. No waiting on the clock: where a step must have ended, the test ends it
in its row (a step is over when ``until_ms`` is behind the database clock).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import psycopg
import pytest

import idemlock
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


def _granted(store: Any, key: str, token: str) -> Granted:
    got = store.claim("ns", key, None, token, LEASE)
    assert isinstance(got, Granted)
    return got


def _schema_v3(dsn: str, schema: str) -> None:
    """A schema made by the previous release: layouts 1 to 3, as it ran them."""
    with psycopg.connect(dsn) as conn:
        for stmt in bootstrap_statements(schema):
            conn.execute(stmt)
        for version in (1, 2, 3):
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
    assert pg.migrate(postgres_dsn, schema=schema) == pg.SCHEMA_VERSION == 4
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
    # One end for the key's steps: the later of theirs and now + ttl.
    assert [r[:3] for r in rows] == [("a", g.fence, b"1"), ("b", g.fence, None)]
    assert rows[0][3] == rows[1][3]
    # An ended step is dropped by the next write, never revived.
    _sql(postgres_dsn, f"UPDATE {schema}.claim_steps SET until_ms = 1 WHERE name = 'a'")
    assert store.steps("ns", "k") == [StepRow("b", g.fence, None)]
    assert store.step("ns", "k", "t1", "c", b"3", LEASE, TTL) is not None
    assert [r[0] for r in _steps_rows(postgres_dsn, schema, "k")] == ["b", "c"]
    # Completing moves the steps' end to the record's end, in the same statement.
    assert store.complete("ns", "k", "t1", b"r", 5_000) is True
    (expires,) = _sql(postgres_dsn, f"SELECT expires_ms FROM {schema}.claims WHERE key = 'k'")
    assert {r[3] for r in _steps_rows(postgres_dsn, schema, "k")} == {expires[0]}
    # Forgetting the key drops them with the record.
    assert store.forget("ns", "k") is True
    assert _steps_rows(postgres_dsn, schema, "k") == []
    # Purge deletes ended steps and does not count them; live ones stay.
    _granted(store, "p", "t1")
    assert store.step("ns", "p", "t1", "live", b"1", LEASE, TTL) is not None
    _granted(store, "q", "t1")
    assert store.step("ns", "q", "t1", "old", b"1", LEASE, TTL) is not None
    _sql(postgres_dsn, f"UPDATE {schema}.claim_steps SET until_ms = 1 WHERE key = 'q'")
    assert store.purge(dry_run=True) == store.purge() == 1  # the tombstone of "k" only
    assert [r[0] for r in _steps_rows(postgres_dsn, schema, "p")] == ["live"]
    assert _steps_rows(postgres_dsn, schema, "q") == []


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
    _sql(postgres_dsn, f"UPDATE {schema}.claim_steps SET until_ms = 1")
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
