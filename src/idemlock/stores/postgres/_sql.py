"""The schema, its migrations and every statement the store runs, for one PostgreSQL schema.

Each transition is ONE statement, so it is atomic on its own (autocommit) and a client
killed mid-call leaves nothing half-made. Expiry is judged by ``clock_timestamp()``
read once per statement, in whole milliseconds since the epoch.

Freeing a key never deletes its row: abandon, forget and release set ``expires_ms = 0``
(a tombstone that keeps the row's fence/token). A new claim or acquire then goes
through ``ON CONFLICT ... DO UPDATE`` and draws its fence from the sequence *under the
row lock*, so it is above every fence the key had. Only ``purge`` deletes rows; a
fresh INSERT draws its fence just before its uniqueness check, so it could come out
lower than a purged row's fence only if that statement stalled for the purged row's
whole life (claim, lease expiry, purge).
"""

from __future__ import annotations

import functools
import hashlib
import re
from dataclasses import dataclass
from typing import Any

from psycopg import sql

#: the schema layout this code reads and writes
SCHEMA_VERSION = 2

# Store time in ms since the epoch; read once per statement (a MATERIALIZED CTE or a
# FROM sub-select is evaluated once even though clock_timestamp() is volatile).
NOW = "floor(extract(epoch FROM clock_timestamp()) * 1000)::bigint"

# Migrations by version. Statements are templates: {s} is the quoted schema name,
# {seq} the quoted sequence name as a regclass literal.
MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        # One sequence for every fence and lock token: durable, never reused, and
        # safe to keep while rows come and go. CACHE 1 (the default) keeps values in
        # issue order across sessions; a larger cache would break per-key ordering.
        "CREATE SEQUENCE {s}.fence_seq AS bigint CACHE 1",
        """CREATE TABLE {s}.claims (
            ns text COLLATE "C" NOT NULL,
            key text COLLATE "C" NOT NULL,
            state text NOT NULL,
            token text NOT NULL,
            fence bigint NOT NULL,
            fp text,
            expires_ms bigint NOT NULL,
            result bytea,
            PRIMARY KEY (ns, key)
        )""",
        "CREATE INDEX claims_expires_idx ON {s}.claims (expires_ms)",
        """CREATE TABLE {s}.locks (
            ns text COLLATE "C" NOT NULL,
            key text COLLATE "C" NOT NULL,
            owner text NOT NULL,
            token bigint NOT NULL,
            expires_ms bigint NOT NULL,
            PRIMARY KEY (ns, key)
        )""",
        "CREATE INDEX locks_expires_idx ON {s}.locks (expires_ms)",
        """CREATE TABLE {s}.fences (
            ns text COLLATE "C" NOT NULL,
            resource text COLLATE "C" NOT NULL,
            token bigint NOT NULL,
            PRIMARY KEY (ns, resource)
        )""",
    ),
    # Fair lock hand-off. A lock row keeps the hand-off window of a release (chosen:
    # the waiter id it is reserved for, window_ms: until when) and whether waiters may
    # be queued (queued: so a release of a lock nobody waits for skips the queue), and
    # lock_waiters queues the processes waiting on a lock, one row per (channel,
    # waiter id), in arrival order (seq) until its registration lapses (until_ms).
    2: (
        """ALTER TABLE {s}.locks
            ADD COLUMN chosen text COLLATE "C",
            ADD COLUMN window_ms bigint NOT NULL DEFAULT 0,
            ADD COLUMN queued boolean NOT NULL DEFAULT false""",
        "CREATE SEQUENCE {s}.waiter_seq AS bigint",
        """CREATE TABLE {s}.lock_waiters (
            chan text COLLATE "C" NOT NULL,
            gid text COLLATE "C" NOT NULL,
            seq bigint NOT NULL,
            until_ms bigint NOT NULL,
            PRIMARY KEY (chan, gid)
        )""",
        "CREATE INDEX lock_waiters_until_idx ON {s}.lock_waiters (until_ms)",
    ),
}

# ---- statement templates ----------------------------------------------------------
# Parameters are always bound (never formatted in); ints are sent as int8.

# Each statement names the rows of the state table (idemlock._core.table,
# docs/states.md) it implements.
#
# claim/acquire/fence_advance first read the row (statement snapshot). When it is live
# and in the way, the reply comes from that read alone: no row lock, no write, no
# transaction id (replays and waiting re-checks stay cheap). Otherwise the upsert
# runs; it re-checks against the latest row version under the row lock. If that
# version is newer than the snapshot (a concurrent commit) and in the way, nothing is
# written and nothing usable is returned: the caller runs the statement again.
# Rows claim.new (the upsert), claim.resend, claim.mismatch, claim.busy, claim.replay
# (decided from the read by the table: _replies.claim_reply).
CLAIM = """
WITH n AS MATERIALIZED (SELECT {now} AS ms),
cur AS MATERIALIZED (
    SELECT c.state, c.token, c.fence, c.fp, c.expires_ms, c.result
    FROM {s}.claims c WHERE c.ns = %(ns)s::text AND c.key = %(key)s::text
),
up AS (
    INSERT INTO {s}.claims AS c (ns, key, state, token, fence, fp, expires_ms)
    SELECT %(ns)s::text, %(key)s::text, 'in_flight', %(token)s::text, nextval({seq}),
           %(fp)s::text, n.ms + %(lease)s
    FROM n WHERE NOT EXISTS (SELECT FROM cur WHERE cur.expires_ms > n.ms)
    ON CONFLICT (ns, key) DO UPDATE
        SET state = 'in_flight', token = excluded.token, fence = nextval({seq}),
            fp = excluded.fp, expires_ms = excluded.expires_ms, result = NULL
        WHERE c.expires_ms <= excluded.expires_ms - %(lease)s
    RETURNING c.fence, c.expires_ms
)
SELECT true, up.fence, up.expires_ms, n.ms, NULL::text, NULL::bytea, NULL::bool, NULL::bool
FROM up, n
UNION ALL
SELECT false, cur.fence, cur.expires_ms, n.ms, cur.state,
       CASE WHEN cur.state = 'completed' AND cur.fp IS NOT DISTINCT FROM %(fp)s::text
            THEN cur.result END,
       cur.token = %(token)s::text, cur.fp IS NOT DISTINCT FROM %(fp)s::text
FROM cur, n
WHERE NOT EXISTS (SELECT FROM up)
"""

# The same rows, first try: a new key is one INSERT (claim.new) with no read before it;
# a record in the way answers from the row as CLAIM's read does (claim.resend,
# claim.mismatch, claim.busy, claim.replay). One that is no longer live (expired,
# abandoned, forgotten) is taken over by CLAIM, which the caller runs then (_RETRY).
CLAIM_FAST = """
WITH up AS (
    INSERT INTO {s}.claims AS c (ns, key, state, token, fence, fp, expires_ms)
    VALUES (%(ns)s::text, %(key)s::text, 'in_flight', %(token)s::text, nextval({seq}),
            %(fp)s::text, {now} + %(lease)s)
    ON CONFLICT (ns, key) DO NOTHING
    RETURNING c.fence, c.expires_ms
)
SELECT true, up.fence, up.expires_ms, up.expires_ms - %(lease)s, NULL::text, NULL::bytea,
       NULL::bool, NULL::bool
FROM up
UNION ALL
SELECT false, cur.fence, cur.expires_ms, n.ms, cur.state,
       CASE WHEN cur.state = 'completed' AND cur.fp IS NOT DISTINCT FROM %(fp)s::text
            THEN cur.result END,
       cur.token = %(token)s::text, cur.fp IS NOT DISTINCT FROM %(fp)s::text
FROM {s}.claims cur, (SELECT {now} AS ms) AS n
WHERE cur.ns = %(ns)s::text AND cur.key = %(key)s::text AND NOT EXISTS (SELECT FROM up)
"""

# Rows complete.ok, complete.late, complete.resend (no row: complete.stale). Complete
# and abandon are accepted after the lease ended, as long as the record still holds
# this token (nobody took the key over) and is not a tombstone (expires_ms = 0:
# abandoned or forgotten): refusing would throw finished work away and run it again.
# A completion re-sent after a lost reply (completed, same token and result, ttl
# running) matches and keeps its expiry.
COMPLETE = """
UPDATE {s}.claims AS c
SET state = 'completed', result = %(result)s::bytea,
    expires_ms = CASE WHEN c.state = 'in_flight' THEN n.ms + %(ttl)s ELSE c.expires_ms END
FROM (SELECT {now} AS ms) AS n
WHERE c.ns = %(ns)s::text AND c.key = %(key)s::text AND c.token = %(token)s::text
  AND ((c.state = 'in_flight' AND c.expires_ms > 0)
       OR (c.state = 'completed' AND c.result = %(result)s::bytea AND c.expires_ms > n.ms))
RETURNING pg_notify(%(chan)s::text, '')
"""

# Rows abandon.ok, abandon.late (no row: abandon.stale)
ABANDON = """
UPDATE {s}.claims AS c SET expires_ms = 0, result = NULL
FROM (SELECT {now} AS ms) AS n
WHERE c.ns = %(ns)s::text AND c.key = %(key)s::text AND c.token = %(token)s::text
  AND c.state = 'in_flight' AND c.expires_ms > 0
RETURNING pg_notify(%(chan)s::text, '')
"""

# Row extend.ok (no row: extend.stale; a lapsed lease is never revived)
EXTEND = """
UPDATE {s}.claims AS c SET expires_ms = n.ms + %(lease)s
FROM (SELECT {now} AS ms) AS n
WHERE c.ns = %(ns)s::text AND c.key = %(key)s::text AND c.token = %(token)s::text
  AND c.state = 'in_flight' AND c.expires_ms > n.ms
RETURNING c.expires_ms
"""

# Rows forget.live (a row), forget.dead (none)
FORGET = """
UPDATE {s}.claims AS c SET expires_ms = 0, result = NULL
FROM (SELECT {now} AS ms) AS n
WHERE c.ns = %(ns)s::text AND c.key = %(key)s::text AND c.expires_ms > n.ms
RETURNING pg_notify(%(chan)s::text, '')
"""

RECORD = """
SELECT c.state, c.fence, c.expires_ms
FROM {s}.claims c, (SELECT {now} AS ms) AS n
WHERE c.ns = %(ns)s::text AND c.key = %(key)s::text AND c.expires_ms > n.ms
"""

RECORDS = """
SELECT c.ns, c.key, c.state, c.fence, c.expires_ms
FROM {s}.claims c, (SELECT {now} AS ms) AS n
WHERE starts_with(c.ns, %(prefix)s::text) AND c.expires_ms > n.ms
ORDER BY c.ns, c.key
"""

# Rows lock.acquire, lock.reacquire, lock.handoff.take (the upsert), lock.busy and
# lock.handoff (the read). A caller of a process waiting on the lock passes that
# process's waiter id (gid, '' for none): refused, it registers the process in the
# queue (keeping its place: seq is drawn once) and marks the lock row queued; taking
# the lock ends the registration, and that of a chosen waiter whose window passed
# untaken (it lost its turn). During a window only the chosen process (any of its
# callers) may take the free lock, so neither the releasing
# process nor a newcomer barges in. The window and owner checks are re-made on the
# latest row version under the row lock (the upsert's WHERE); the queue is read from
# the statement's snapshot, which can only make a hand-off less fair, never unsafe.
ACQUIRE = """
WITH n AS MATERIALIZED (SELECT {now} AS ms),
cur AS MATERIALIZED (
    SELECT l.owner, l.token, l.expires_ms, l.chosen, l.window_ms
    FROM {s}.locks l WHERE l.ns = %(ns)s::text AND l.key = %(key)s::text
),
up AS (
    INSERT INTO {s}.locks AS l (ns, key, owner, token, expires_ms)
    SELECT %(ns)s::text, %(key)s::text, %(owner)s::text, nextval({seq}), n.ms + %(ttl)s
    FROM n
    WHERE NOT EXISTS (
        SELECT FROM cur
        WHERE CASE WHEN cur.expires_ms > n.ms THEN cur.owner <> %(owner)s::text
                   ELSE cur.window_ms > n.ms AND cur.chosen <> %(gid)s::text END
    )
    ON CONFLICT (ns, key) DO UPDATE
        SET token = CASE WHEN l.expires_ms <= excluded.expires_ms - %(ttl)s
                         THEN nextval({seq}) ELSE l.token END,
            owner = excluded.owner, expires_ms = excluded.expires_ms,
            chosen = NULL, window_ms = 0
        WHERE CASE WHEN l.expires_ms > excluded.expires_ms - %(ttl)s
                   THEN l.owner = excluded.owner
                   ELSE l.chosen IS NULL OR l.window_ms <= excluded.expires_ms - %(ttl)s
                        OR l.chosen = %(gid)s::text END
    RETURNING l.token, l.expires_ms
),
gone AS (
    DELETE FROM {s}.lock_waiters w
    WHERE w.chan = %(chan)s::text AND EXISTS (SELECT FROM up)
      AND w.gid IN (%(gid)s::text, (SELECT cur.chosen FROM cur))
),
reg AS (
    INSERT INTO {s}.lock_waiters AS w (chan, gid, seq, until_ms)
    SELECT %(chan)s::text, %(gid)s::text, nextval({wseq}), n.ms + %(reg)s
    FROM n WHERE %(gid)s::text <> '' AND NOT EXISTS (SELECT FROM up)
    ON CONFLICT (chan, gid) DO UPDATE SET until_ms = excluded.until_ms
),
mark AS (
    UPDATE {s}.locks AS l SET queued = true
    WHERE l.ns = %(ns)s::text AND l.key = %(key)s::text AND NOT l.queued
      AND %(gid)s::text <> '' AND NOT EXISTS (SELECT FROM up)
)
SELECT true, up.token, up.expires_ms, n.ms, NULL::text, 0::bigint, false FROM up, n
UNION ALL
SELECT false, cur.token, cur.expires_ms, n.ms, cur.owner, cur.window_ms,
       coalesce(cur.window_ms > n.ms AND cur.chosen <> %(gid)s::text, false)
FROM cur, n
WHERE NOT EXISTS (SELECT FROM up)
"""

# The same rows for a caller whose process does not wait on the lock now (nothing to
# register: a first attempt, a one-shot try; gid is the process's if it waited just
# before, so a window kept for it is its own): the upsert alone, with the reply read
# from the row when it refuses. A take here keeps ``chosen`` (a window that passed
# untaken, or this process's own), so the next release passes that process over once.
ACQUIRE_FAST = """
WITH up AS (
    INSERT INTO {s}.locks AS l (ns, key, owner, token, expires_ms)
    VALUES (%(ns)s::text, %(key)s::text, %(owner)s::text, nextval({seq}), {now} + %(ttl)s)
    ON CONFLICT (ns, key) DO UPDATE
        SET token = CASE WHEN l.expires_ms <= excluded.expires_ms - %(ttl)s
                         THEN nextval({seq}) ELSE l.token END,
            owner = excluded.owner, expires_ms = excluded.expires_ms, window_ms = 0
        WHERE CASE WHEN l.expires_ms > excluded.expires_ms - %(ttl)s
                   THEN l.owner = excluded.owner
                   ELSE l.chosen IS NULL OR l.window_ms <= excluded.expires_ms - %(ttl)s
                        OR l.chosen = %(gid)s::text END
    RETURNING l.token, l.expires_ms
)
SELECT true, up.token, up.expires_ms, up.expires_ms - %(ttl)s, NULL::text, 0::bigint, false
FROM up
UNION ALL
SELECT false, c.token, c.expires_ms, n.ms, c.owner, c.window_ms,
       coalesce(c.window_ms > n.ms AND c.chosen <> %(gid)s::text, false)
FROM {s}.locks c, (SELECT {now} AS ms) AS n
WHERE c.ns = %(ns)s::text AND c.key = %(key)s::text AND NOT EXISTS (SELECT FROM up)
"""

# Row lock.release (no row: lock.release.stale). With a live registration the lock
# goes to state reserved: a window of %(handoff)s ms for the oldest registered waiter
# (chosen; passed over: the one a lapsed window named), whose id the notification
# carries (only that process wakes at once); without one (chosen NULL, whatever
# window_ms says) it is free and every waiter is woken ('*'). The queue is read only
# when a registration marked the row (queued), and the mark stays while any does.
# A registration racing the release may miss this one hand-off (it is not in the
# statement's snapshot, or its mark is cleared): its waiter is still woken ('*').
RELEASE = """
UPDATE {s}.locks AS l
SET expires_ms = 0, window_ms = n.ms + %(handoff)s,
    chosen = CASE WHEN l.queued THEN (
        SELECT q.gid FROM {s}.lock_waiters q
        WHERE q.chan = %(chan)s::text AND q.until_ms > n.ms
          AND q.gid IS DISTINCT FROM l.chosen
        ORDER BY q.seq LIMIT 1
    ) END,
    queued = l.queued AND EXISTS (
        SELECT FROM {s}.lock_waiters q
        WHERE q.chan = %(chan)s::text AND q.until_ms > n.ms
    )
FROM (SELECT {now} AS ms) AS n
WHERE l.ns = %(ns)s::text AND l.key = %(key)s::text AND l.owner = %(owner)s::text
  AND l.token = %(token)s AND l.expires_ms > n.ms
RETURNING pg_notify(%(chan)s::text, coalesce(l.chosen, '*'))
"""

# A process stopped waiting on a lock without getting it (its last waiter gave up,
# timed out or was cancelled): its place in the queue goes at once. Run by the
# listener on its own connection; a crashed process's registration lapses instead.
UNREGISTER = """
DELETE FROM {s}.lock_waiters WHERE chan = %(chan)s::text AND gid = %(gid)s::text
"""

# State table row lock.break: held by anyone -> free. The row keeps its token and the
# next acquire draws a new one from fence_seq, so the old holder's (owner, token) stops
# matching: its renew and release fail. No window is kept: every waiter is woken.
BREAK = """
UPDATE {s}.locks AS l SET expires_ms = 0, chosen = NULL, window_ms = 0
FROM (SELECT {now} AS ms) AS n
WHERE l.ns = %(ns)s::text AND l.key = %(key)s::text AND l.expires_ms > n.ms
RETURNING pg_notify(%(chan)s::text, '')
"""

# Row lock.renew (no row: lock.renew.stale)
RENEW = """
UPDATE {s}.locks AS l SET expires_ms = n.ms + %(ttl)s
FROM (SELECT {now} AS ms) AS n
WHERE l.ns = %(ns)s::text AND l.key = %(key)s::text AND l.owner = %(owner)s::text
  AND l.token = %(token)s AND l.expires_ms > n.ms
RETURNING l.expires_ms
"""

# The batched renewal of a coordinator's renewer: many claims and leases in one
# statement (each row's check as in EXTEND and RENEW: rows extend.ok, extend.stale,
# lock.renew, lock.renew.stale). Replies: (kind, position, expiry)
# for each renewed item; an item missing from the reply was refused.
RENEW_MANY = """
WITH n AS MATERIALIZED (SELECT {now} AS ms),
c AS (
    UPDATE {s}.claims AS c SET expires_ms = n.ms + i.lease
    FROM n, unnest(%(cns)s::text[], %(ckey)s::text[], %(ctoken)s::text[], %(clease)s::int8[])
        WITH ORDINALITY AS i(ns, key, token, lease, pos)
    WHERE c.ns = i.ns AND c.key = i.key AND c.token = i.token
      AND c.state = 'in_flight' AND c.expires_ms > n.ms
    RETURNING i.pos, c.expires_ms
),
l AS (
    UPDATE {s}.locks AS l SET expires_ms = n.ms + i.ttl
    FROM n, unnest(%(lns)s::text[], %(lkey)s::text[], %(lowner)s::text[], %(ltoken)s::int8[],
                   %(lttl)s::int8[]) WITH ORDINALITY AS i(ns, key, owner, token, ttl, pos)
    WHERE l.ns = i.ns AND l.key = i.key AND l.owner = i.owner AND l.token = i.token
      AND l.expires_ms > n.ms
    RETURNING i.pos, l.expires_ms
)
SELECT 'c', pos, expires_ms FROM c
UNION ALL
SELECT 'l', pos, expires_ms FROM l
"""

LOCK = """
SELECT l.owner, l.token, l.expires_ms
FROM {s}.locks l, (SELECT {now} AS ms) AS n
WHERE l.ns = %(ns)s::text AND l.key = %(key)s::text AND l.expires_ms > n.ms
"""

LOCKS = """
SELECT l.ns, l.key, l.owner, l.token, l.expires_ms
FROM {s}.locks l, (SELECT {now} AS ms) AS n
WHERE starts_with(l.ns, %(prefix)s::text) AND l.expires_ms > n.ms
ORDER BY l.ns, l.key
"""

# Rows fence.advance (the upsert), fence.stale (the read)
FENCE_ADVANCE = """
WITH cur AS MATERIALIZED (
    SELECT f.token FROM {s}.fences f
    WHERE f.ns = %(ns)s::text AND f.resource = %(resource)s::text
),
up AS (
    INSERT INTO {s}.fences AS f (ns, resource, token)
    SELECT %(ns)s::text, %(resource)s::text, %(token)s
    WHERE NOT EXISTS (SELECT FROM cur WHERE cur.token > %(token)s)
    ON CONFLICT (ns, resource) DO UPDATE SET token = excluded.token
        WHERE f.token <= excluded.token
    RETURNING f.token
)
SELECT true, up.token FROM up
UNION ALL
SELECT false, cur.token FROM cur WHERE NOT EXISTS (SELECT FROM up)
"""

FENCE_CURRENT = """
SELECT f.token FROM {s}.fences f WHERE f.ns = %(ns)s::text AND f.resource = %(resource)s::text
"""

# Purge in batches so no statement holds many row locks for long; it deletes the rows
# that claim.ttl, claim.expiry and lock.expiry left dead (a lock in its hand-off
# window is kept). The outer condition is re-checked on the latest row version, so a
# row re-claimed meanwhile is kept.
PURGE = """
WITH n AS MATERIALIZED (SELECT {now} AS ms),
d AS (
    DELETE FROM {s}.{table} AS t
    USING (SELECT ns, key FROM {s}.{table}
           WHERE expires_ms <= (SELECT ms FROM n) {extra} LIMIT %(batch)s) AS x
    WHERE t.ns = x.ns AND t.key = x.key AND t.expires_ms <= (SELECT ms FROM n) {extra}
    RETURNING 1
)
SELECT count(*) FROM d
"""

_NOT_RESERVED = "AND window_ms <= (SELECT ms FROM n)"

# Purge's dry run: what PURGE would delete, counted in batches along the primary key
# (keyset: each batch starts after the last key of the one before; NULL starts at the
# beginning). Read-only: no row is locked. Returns the batch's count and last key.
PURGE_COUNT = """
WITH n AS MATERIALIZED (SELECT {now} AS ms),
b AS MATERIALIZED (
    SELECT ns, key FROM {s}.{table}
    WHERE expires_ms <= (SELECT ms FROM n) {extra}
      AND (%(ns)s::text IS NULL OR (ns, key) > (%(ns)s::text, %(key)s::text))
    ORDER BY ns, key LIMIT %(batch)s
),
l AS (SELECT ns, key FROM b ORDER BY ns DESC, key DESC LIMIT 1)
SELECT (SELECT count(*) FROM b), l.ns, l.key FROM (SELECT 1) AS one LEFT JOIN l ON true
"""

# Lapsed registrations of the waiters' queue (not records: purge does not count them).
PURGE_WAITERS = """
WITH d AS (
    DELETE FROM {s}.lock_waiters AS t
    USING (SELECT chan, gid FROM {s}.lock_waiters
           WHERE until_ms <= {now} LIMIT %(batch)s) AS x
    WHERE t.chan = x.chan AND t.gid = x.gid AND t.until_ms <= {now}
    RETURNING 1
)
SELECT count(*) FROM d
"""

VERSION = "SELECT coalesce(max(version), 0) FROM {s}.schema_version"


def _render(template: str, schema: str, **extra: str) -> bytes:
    s = sql.Identifier(schema).as_string(None)
    seq = sql.Literal(sql.Identifier(schema, "fence_seq").as_string(None)).as_string(None)
    seq = f"{seq}::regclass"
    wseq = sql.Literal(sql.Identifier(schema, "waiter_seq").as_string(None)).as_string(None)
    return template.format(s=s, seq=seq, wseq=f"{wseq}::regclass", now=NOW, **extra).encode()


_PARAM = re.compile(rb"%\((\w+)\)s")


@dataclass(frozen=True, slots=True)
class Stmt:
    """One statement with native ``$n`` placeholders, run with psycopg's RawCursor:
    psycopg then skips converting the query and reordering parameters on every call
    (measurable next to a ~100 us round trip), and one value may appear many times."""

    sql: bytes
    names: tuple[str, ...]

    @classmethod
    def render(cls, template: str, schema: str, **extra: str) -> Stmt:
        text = _render(template, schema, **extra)
        names: list[str] = []

        def number(m: re.Match[bytes]) -> bytes:
            name = m.group(1).decode()
            if name not in names:
                names.append(name)
            return b"$%d" % (names.index(name) + 1)

        return cls(_PARAM.sub(number, text), tuple(names))

    def args(self, params: dict[str, Any]) -> tuple[Any, ...]:
        return tuple([params[n] for n in self.names])


@dataclass(frozen=True)
class Statements:
    """Every statement rendered once for one schema (psycopg keys its prepared
    statement cache on the text, so each is prepared once per connection)."""

    schema: str
    claim: Stmt
    claim_fast: Stmt
    complete: Stmt
    abandon: Stmt
    extend: Stmt
    forget: Stmt
    record: Stmt
    records: Stmt
    acquire: Stmt
    acquire_fast: Stmt
    release: Stmt
    break_lock: Stmt
    renew: Stmt
    lock: Stmt
    locks: Stmt
    fence_advance: Stmt
    fence_current: Stmt
    purge_claims: Stmt
    purge_locks: Stmt
    purge_waiters: Stmt
    count_claims: Stmt
    count_locks: Stmt
    unregister: Stmt
    version: bytes

    @classmethod
    def for_schema(cls, schema: str) -> Statements:
        r = Stmt.render
        return cls(
            schema=schema,
            claim=r(CLAIM, schema),
            claim_fast=r(CLAIM_FAST, schema),
            complete=r(COMPLETE, schema),
            abandon=r(ABANDON, schema),
            extend=r(EXTEND, schema),
            forget=r(FORGET, schema),
            record=r(RECORD, schema),
            records=r(RECORDS, schema),
            acquire=r(ACQUIRE, schema),
            acquire_fast=r(ACQUIRE_FAST, schema),
            release=r(RELEASE, schema),
            break_lock=r(BREAK, schema),
            renew=r(RENEW, schema),
            lock=r(LOCK, schema),
            locks=r(LOCKS, schema),
            fence_advance=r(FENCE_ADVANCE, schema),
            fence_current=r(FENCE_CURRENT, schema),
            purge_claims=r(PURGE, schema, table="claims", extra=""),
            purge_locks=r(PURGE, schema, table="locks", extra=_NOT_RESERVED),
            purge_waiters=r(PURGE_WAITERS, schema),
            count_claims=r(PURGE_COUNT, schema, table="claims", extra=""),
            count_locks=r(PURGE_COUNT, schema, table="locks", extra=_NOT_RESERVED),
            unregister=r(UNREGISTER, schema),
            version=_render(VERSION, schema),
        )

    def channel(self, kind: str, ns: str, key: str) -> str:
        """The NOTIFY channel of one key: a hash, because channel names are identifiers
        of at most 63 bytes and keys may be 512."""
        return _channel(self.schema, kind, ns, key)


# Cached: a lock's acquire and release each need its channel, and a hot key's hash is
# the same every time (bounded, so many one-off keys cannot grow it without limit).
@functools.lru_cache(maxsize=4096)
def _channel(schema: str, kind: str, ns: str, key: str) -> str:
    digest = hashlib.blake2b(
        "\0".join((schema, kind, ns, key)).encode("utf-8", "surrogatepass"),
        digest_size=16,
    ).hexdigest()
    return f"idemlock_{digest}"


def migration_statements(schema: str, version: int) -> list[bytes]:
    return [_render(t, schema) for t in MIGRATIONS[version]]


def bootstrap_statements(schema: str) -> list[bytes]:
    """Run under the migration lock before reading the version."""
    return [
        _render("CREATE SCHEMA IF NOT EXISTS {s}", schema),
        _render(
            "CREATE TABLE IF NOT EXISTS {s}.schema_version ("
            "version integer PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())",
            schema,
        ),
    ]


def record_version(schema: str) -> bytes:
    return _render("INSERT INTO {s}.schema_version (version) VALUES (%(v)s)", schema)


def advisory_key(schema: str) -> int:
    """A signed 64-bit key for pg_advisory_xact_lock, per schema."""
    digest = hashlib.blake2b(f"idemlock.migrate:{schema}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)
