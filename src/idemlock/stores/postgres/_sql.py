"""The schema, its migrations and every statement the store runs, for one PostgreSQL schema.

Each transition is ONE statement, so it is atomic on its own (autocommit) and a client
killed mid-call leaves nothing half-made. Expiry is judged by ``clock_timestamp()``
read once per statement, in whole milliseconds since the epoch.

A lock key is one locks row holding its permits (a lock is the one-permit case): slot 0
in the row's own columns, further permits in ``others`` (see "locks and permits" below).

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
SCHEMA_VERSION = 5

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
    # Counted leases (a lock is the one-permit case). A key's locks row stays its one
    # row: its owner, token, expires_ms (and now value) are the key's first permit,
    # "slot 0", exactly as a lock was, and ``others`` holds the further permits. A
    # grant takes slot 0 whenever it is free, so a lock (a grant with no live holder)
    # is always there: a process still running layout 2 sees it held and cannot grant
    # it, and a lock held at upgrade time stays as it is. Every transition stays one
    # statement on that one row (its row lock serializes the key). No data moves.
    3: (
        """CREATE TYPE {s}.lock_permit AS (
            owner text, token bigint, expires_ms bigint, value bytea
        )""",
        """ALTER TABLE {s}.locks
            ADD COLUMN value bytea,
            ADD COLUMN others {s}.lock_permit[] NOT NULL DEFAULT '{{}}'""",
        # What the statements ask of others, as functions: a statement then carries a
        # call, not a sub-plan its executor must set up on every run (a lock's
        # statements skip the call: others is empty). at: the statement's time.
        # The live permits, lowest token first.
        """CREATE FUNCTION {s}.lock_live(ps {s}.lock_permit[], at bigint)
            RETURNS {s}.lock_permit[] LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
            SELECT coalesce(array_agg(p ORDER BY p.token), '{{}}')
            FROM unnest(ps) p WHERE p.expires_ms > at $$""",
        # The live permit of owner ``who``, or NULL.
        """CREATE FUNCTION {s}.lock_mine(ps {s}.lock_permit[], who text, at bigint)
            RETURNS {s}.lock_permit LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
            SELECT p FROM unnest(ps) p WHERE p.owner = who AND p.expires_ms > at LIMIT 1 $$""",
        # The earliest end of a live permit, or NULL.
        """CREATE FUNCTION {s}.lock_end(ps {s}.lock_permit[], at bigint)
            RETURNS bigint LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
            SELECT min(p.expires_ms) FROM unnest(ps) p WHERE p.expires_ms > at $$""",
        # The live permits, the one of ``who`` (with token ``tok``, unless NULL) ending
        # at ``ends`` and publishing ``val`` (unless NULL).
        """CREATE FUNCTION {s}.lock_set(
                ps {s}.lock_permit[], who text, tok bigint, ends bigint, val bytea, at bigint)
            RETURNS {s}.lock_permit[] LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
            SELECT coalesce(array_agg(
                CASE WHEN p.owner = who AND (tok IS NULL OR p.token = tok)
                     THEN ROW(p.owner, p.token, ends, coalesce(val, p.value))::{s}.lock_permit
                     ELSE p END ORDER BY p.token), '{{}}')
            FROM unnest(ps) p WHERE p.expires_ms > at $$""",
        # The live permits but the one with token ``tok`` (of ``who``, unless NULL).
        """CREATE FUNCTION {s}.lock_drop(
                ps {s}.lock_permit[], who text, tok bigint, at bigint)
            RETURNS {s}.lock_permit[] LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
            SELECT coalesce(array_agg(p ORDER BY p.token), '{{}}') FROM unnest(ps) p
            WHERE p.expires_ms > at AND NOT (p.token = tok AND (who IS NULL OR p.owner = who))
            $$""",
    ),
    # Steps inside a claim (rows step.*): a key's steps beside its claims row, so an
    # abandon (a tombstone) or a lapsed lease keeps them for the next attempt. fence:
    # the claim's fence when the step was written; result NULL: a "started" marker;
    # until_ms: the key's steps' end (the ttl after its last step written, or, once
    # completed, the record's end). A new table only: no data moves, and a process
    # still running layout 3 never reads it (it leaves a forgotten key's steps to
    # their until_ms, as purge does).
    4: (
        """CREATE TABLE {s}.claim_steps (
            ns text COLLATE "C" NOT NULL,
            key text COLLATE "C" NOT NULL,
            name text COLLATE "C" NOT NULL,
            fence bigint NOT NULL,
            result bytea,
            until_ms bigint NOT NULL,
            PRIMARY KEY (ns, key, name)
        )""",
        "CREATE INDEX claim_steps_until_idx ON {s}.claim_steps (until_ms)",
    ),
    # The end of a key's steps kept once, in its claims row, so a step write changes
    # that row and its own step row, never the key's other steps (layout 4 moved
    # until_ms on all of them: K steps cost O(K^2)). steps_ms: that end (0: none kept);
    # steps_from: when the key's current steps began (the first step after the end
    # passed), which tells STEP to drop the ended ones. A step row's until_ms is the
    # key's end when the row was written; a step lives while its row's until_ms or its
    # key's steps_ms is ahead, so the rows of layout 4 (and of a process still running
    # it, which never reads the columns) read as they did. Columns with a constant
    # default: no row is rewritten.
    5: (
        """ALTER TABLE {s}.claims
            ADD COLUMN steps_ms bigint NOT NULL DEFAULT 0,
            ADD COLUMN steps_from bigint NOT NULL DEFAULT 0""",
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
# A grant (claim.new, claim.resend) carries the key's live steps (rows step.*), read
# in the same statement: three arrays (names, fences, results) of one aggregate, all
# NULL when the key has none. One probe of claim_steps' primary key, in the snapshot
# the grant was decided in; ``gate`` (a condition on the outer row only) makes it a
# one-time filter, so a reply that is no grant (busy, replay...) skips the probe. A
# step lives while its key's end (``end``: the claims row's steps_ms) or its own is
# ahead.
def _steps_of(now: str, end: str, gate: str = "true") -> str:
    return f"""
CROSS JOIN LATERAL (
    SELECT array_agg(t.name) AS names, array_agg(t.fence) AS fences,
           array_agg(t.result) AS results
    FROM {{s}}.claim_steps t
    WHERE {gate} AND t.ns = %(ns)s::text AND t.key = %(key)s::text
      AND ({end} > {now} OR t.until_ms > {now})
) st"""


_STEPS_COLS = "st.names, st.fences, st.results"
# the record in the way is the caller's own claim (claim.resend)
_RESEND = "cur.state = 'in_flight' AND cur.token = %(token)s::text"

# Rows claim.new (the upsert), claim.resend, claim.mismatch, claim.busy, claim.replay
# (decided from the read by the table: _replies.claim_reply).
CLAIM = f"""
WITH n AS MATERIALIZED (SELECT {{now}} AS ms),
cur AS MATERIALIZED (
    SELECT c.state, c.token, c.fence, c.fp, c.expires_ms, c.result, c.steps_ms
    FROM {{s}}.claims c WHERE c.ns = %(ns)s::text AND c.key = %(key)s::text
),
up AS (
    INSERT INTO {{s}}.claims AS c (ns, key, state, token, fence, fp, expires_ms)
    SELECT %(ns)s::text, %(key)s::text, 'in_flight', %(token)s::text, nextval({{seq}}),
           %(fp)s::text, n.ms + %(lease)s
    FROM n WHERE NOT EXISTS (SELECT FROM cur WHERE cur.expires_ms > n.ms)
    ON CONFLICT (ns, key) DO UPDATE
        SET state = 'in_flight', token = excluded.token, fence = nextval({{seq}}),
            fp = excluded.fp, expires_ms = excluded.expires_ms, result = NULL
        WHERE c.expires_ms <= excluded.expires_ms - %(lease)s
    RETURNING c.fence, c.expires_ms, c.steps_ms
)
SELECT true, up.fence, up.expires_ms, n.ms, NULL::text, NULL::bytea, NULL::bool, NULL::bool,
       {_STEPS_COLS}
FROM up CROSS JOIN n{_steps_of("n.ms", "up.steps_ms")}
UNION ALL
SELECT false, cur.fence, cur.expires_ms, n.ms, cur.state,
       CASE WHEN cur.state = 'completed' AND cur.fp IS NOT DISTINCT FROM %(fp)s::text
            THEN cur.result END,
       cur.token = %(token)s::text, cur.fp IS NOT DISTINCT FROM %(fp)s::text, {_STEPS_COLS}
FROM cur CROSS JOIN n{_steps_of("n.ms", "cur.steps_ms", _RESEND)}
WHERE NOT EXISTS (SELECT FROM up)
"""

# The same rows, first try: a new key is one INSERT (claim.new) with no read before it;
# a record in the way answers from the row as CLAIM's read does (claim.resend,
# claim.mismatch, claim.busy, claim.replay). One that is no longer live (expired,
# abandoned, forgotten) is taken over by CLAIM, which the caller runs then (_RETRY).
# It reads no steps: a key with live steps always has a claims row (purge keeps the
# row of such a key), so a new key has none; a claim.resend found here is left to
# CLAIM too (_RETRY), which returns the steps with it. The hot path (claim.new,
# claim.replay) is the statement it was before steps.
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
# The key's live steps last as long as the completed record, in the same statement
# (rows complete.ok, complete.late; steps whose end passed stay dead for purge): their
# end in the claims row, and the rows that carry a later end of their own (one probe of
# claim_steps' primary key; once per operation, not once per step).
COMPLETE = """
WITH c AS (
    UPDATE {s}.claims AS c
    SET state = 'completed', result = %(result)s::bytea,
        expires_ms = CASE WHEN c.state = 'in_flight' THEN n.ms + %(ttl)s ELSE c.expires_ms END,
        steps_ms = CASE WHEN c.state = 'in_flight' AND c.steps_ms > n.ms THEN n.ms + %(ttl)s
                        ELSE c.steps_ms END
    FROM (SELECT {now} AS ms) AS n
    WHERE c.ns = %(ns)s::text AND c.key = %(key)s::text AND c.token = %(token)s::text
      AND ((c.state = 'in_flight' AND c.expires_ms > 0)
           OR (c.state = 'completed' AND c.result = %(result)s::bytea AND c.expires_ms > n.ms))
    RETURNING c.expires_ms, n.ms, pg_notify(%(chan)s::text, '')
),
s AS (
    UPDATE {s}.claim_steps AS t SET until_ms = c.expires_ms
    FROM c
    WHERE t.ns = %(ns)s::text AND t.key = %(key)s::text AND t.until_ms > c.ms
      AND t.until_ms <> c.expires_ms
)
SELECT true FROM c
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

# Rows forget.live (a row), forget.dead (none): the key's steps go with the record,
# in both (their rows, and their end on a live record).
FORGET = """
WITH s AS (
    DELETE FROM {s}.claim_steps AS t WHERE t.ns = %(ns)s::text AND t.key = %(key)s::text
)
UPDATE {s}.claims AS c SET expires_ms = 0, result = NULL, steps_ms = 0
FROM (SELECT {now} AS ms) AS n
WHERE c.ns = %(ns)s::text AND c.key = %(key)s::text AND c.expires_ms > n.ms
RETURNING pg_notify(%(chan)s::text, '')
"""

# ---- steps inside a claim -------------------------------------------------------------
# Rows step.record (STEP), step.drop (DROP_STEP); no row: step.stale, step.drop.stale.
# The caller's claim is renewed exactly as EXTEND renews it (its token, in flight, the
# lease not ended on the server's clock), and only then, in the same statement, the
# step is written or removed. The key's steps' end is its claims row's (layout 5): a
# step written moves it to the later of it and now + ttl, and writes its own row,
# never the key's other rows, so a step costs the same however many the key has.
# When that end is behind (the key's first step, or its steps are over), the new end
# also takes on the later end of rows that carry one of their own (layout 4's), and
# steps_from marks a new generation: the key's ended rows are dropped then (never
# revived), a scan the step skips otherwise (a one-time filter: an InitPlan on c, which
# the executor checks before it scans; a join on c would scan the key's rows every
# step, for nothing). The
# sub-statements touch distinct rows (the step's own row only in the upsert), as one
# statement must. The claims row lock serializes the key's writers.
_STEP_RENEW = """
WITH n AS MATERIALIZED (SELECT {now} AS ms),
c AS (
    UPDATE {s}.claims AS c SET expires_ms = n.ms + %(lease)s{more}
    FROM n
    WHERE c.ns = %(ns)s::text AND c.key = %(key)s::text AND c.token = %(token)s::text
      AND c.state = 'in_flight' AND c.expires_ms > n.ms
    RETURNING c.fence, c.expires_ms, n.ms, c.steps_ms, c.steps_from
),"""

STEP = (
    _STEP_RENEW.replace(
        "{more}",
        """,
        steps_ms = CASE WHEN c.steps_ms > n.ms THEN greatest(c.steps_ms, n.ms + %(ttl)s)
            ELSE greatest(n.ms + %(ttl)s, (
                SELECT max(t.until_ms) FROM {s}.claim_steps t
                WHERE t.ns = %(ns)s::text AND t.key = %(key)s::text AND t.until_ms > n.ms))
            END,
        steps_from = CASE WHEN c.steps_ms > n.ms THEN c.steps_from ELSE n.ms END""",
    )
    + """
dead AS (
    DELETE FROM {s}.claim_steps AS t
    WHERE (SELECT c.steps_from = c.ms FROM c)
      AND t.ns = %(ns)s::text AND t.key = %(key)s::text
      AND t.until_ms <= (SELECT c.ms FROM c) AND t.name <> %(name)s::text
),
put AS (
    INSERT INTO {s}.claim_steps AS t (ns, key, name, fence, result, until_ms)
    SELECT %(ns)s::text, %(key)s::text, %(name)s::text, c.fence, %(result)s::bytea,
           c.steps_ms
    FROM c
    ON CONFLICT (ns, key, name) DO UPDATE
        SET fence = excluded.fence, result = excluded.result, until_ms = excluded.until_ms
)
SELECT c.expires_ms FROM c
"""
)

# The step's row goes; the key's ended rows too, only when its end is behind (a
# one-time filter on c).
DROP_STEP = (
    _STEP_RENEW.replace("{more}", "")
    + """
dead AS (
    DELETE FROM {s}.claim_steps AS t
    WHERE (SELECT c.steps_ms <= c.ms FROM c)
      AND t.ns = %(ns)s::text AND t.key = %(key)s::text
      AND t.until_ms <= (SELECT c.ms FROM c) AND t.name <> %(name)s::text
),
one AS (
    DELETE FROM {s}.claim_steps AS t USING c
    WHERE t.ns = %(ns)s::text AND t.key = %(key)s::text AND t.name = %(name)s::text
)
SELECT c.expires_ms FROM c
"""
)

# The key's live steps (status(key).steps): its end, or the row's own, ahead
STEPS = """
WITH n AS MATERIALIZED (SELECT {now} AS ms),
e AS MATERIALIZED (
    SELECT coalesce(max(c.steps_ms), 0) AS ms FROM {s}.claims c
    WHERE c.ns = %(ns)s::text AND c.key = %(key)s::text
)
SELECT t.name, t.fence, t.result
FROM {s}.claim_steps t, n, e
WHERE t.ns = %(ns)s::text AND t.key = %(key)s::text AND (e.ms > n.ms OR t.until_ms > n.ms)
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

# ---- locks and permits --------------------------------------------------------------
# A key's one locks row holds its permits: slot 0 (the row's owner, token, expires_ms,
# value: a lock, and the first permit of a key with many) and ``others`` (the further
# permits, lock_permit[], lowest token first). A grant takes slot 0 when it is free
# (expired or released: expires_ms = 0 keeps the row as a tombstone), else appends to
# others; expired permits in others are dropped by the next transition of the key and
# by purge. Every transition is one statement on that row: its WHERE and SET are
# judged on the latest row version under the row lock, so holders are counted exactly.
# A hand-off window (chosen, window_ms) kept for another waiter counts as one holder.
# The fragments below are SQL over a locks row ``r`` and the statement's time ``N``.


def _permit(owner: str, token: str, expires: str, value: str) -> str:
    return f"ROW({owner}, {token}, {expires}, {value})::{{s}}.lock_permit"


def _live_others(r: str, now: str, where: str = "", replace: str = "") -> str:
    """``r.others`` less its expired permits (and those matching ``where``), each
    permit kept, or rebuilt by ``replace`` (a CASE branch ``WHEN ... THEN ...``)."""
    keep = _permit("p.owner", "p.token", "p.expires_ms", "p.value")
    item = f"CASE {replace} ELSE {keep} END" if replace else keep
    cond = f" AND NOT ({where})" if where else ""
    # cardinality first: a key of one permit (a lock) skips the sub-select
    return (
        f"CASE WHEN cardinality({r}.others) = 0 THEN {r}.others ELSE "
        f"ARRAY(SELECT {item} FROM unnest({r}.others) p "
        f"WHERE p.expires_ms > {now}{cond} ORDER BY p.token) END"
    )


def _mine0(r: str, now: str) -> str:
    """Slot 0 is the caller's live permit."""
    return f"({r}.expires_ms > {now} AND {r}.owner = %(owner)s::text)"


def _mine_n(r: str, now: str) -> str:
    """A live permit of others is the caller's."""
    return (
        f"(cardinality({r}.others) > 0 AND "
        f"({{s}}.lock_mine({r}.others, %(owner)s::text, {now})).token IS NOT NULL)"
    )


def _kept(r: str, now: str) -> str:
    """A hand-off window is kept for another waiting process than the caller's."""
    return f"coalesce({r}.window_ms > {now} AND {r}.chosen <> %(gid)s::text, false)"


def _room(r: str, now: str) -> str:
    """Guards room and chosen: the live holders, plus one for a window kept for
    another process, number fewer than the caller's limit; and the caller holds none."""
    count = (
        f"(({r}.expires_ms > {now})::int + CASE WHEN cardinality({r}.others) = 0 "
        f"THEN 0 ELSE cardinality({{s}}.lock_live({r}.others, {now})) END)"
    )
    return (
        f"(NOT {_mine0(r, now)} AND NOT {_mine_n(r, now)} "
        f"AND {count} + {_kept(r, now)}::int < %(limit)s::int8)"
    )


def _takes(r: str, now: str) -> str:
    """What an acquire does to the row: the caller's reacquire or a grant."""
    return f"({_mine0(r, now)} OR {_mine_n(r, now)} OR {_room(r, now)})"


def _until(r: str, now: str) -> str:
    """When a refused caller may try again: the earliest end of a live permit or of
    a window kept for another process (row lock.busy, lock.handoff)."""
    return (
        f"coalesce(LEAST(CASE WHEN {r}.expires_ms > {now} THEN {r}.expires_ms END, "
        f"CASE WHEN cardinality({r}.others) > 0 THEN {{s}}.lock_end({r}.others, {now}) END, "
        f"CASE WHEN {_kept(r, now)} THEN {r}.window_ms END), {now})"
    )


#: what a grant or renew that publishes a value adds to its RETURNING: a notification
#: for the key's observers alone (idemlock._core.wakeups.OBSERVERS), once per changed
#: row, sent when the statement commits (a data-modifying CTE runs to completion, its
#: RETURNING list with it, whether or not the query reads the column)
_PUBLISHED = ",\n              pg_notify(%(chan)s::text, '!') AS published"


def _acquire(waits: bool, publish: bool = False) -> str:
    """Rows lock.reacquire, lock.handoff.take and lock.acquire (the upsert), lock.busy
    and lock.handoff (no row changed: the reply is read from the statement's snapshot,
    which says _RETRY when it disagrees with the row version the upsert judged).

    ``publish``: the statement of a caller that publishes a value (an election's term
    begins, or a campaign re-acquires): a grant or re-acquire also notifies the key's
    channel with payload ``!``, which wakes the key's observers and not its waiters
    (it frees nothing). Sent at commit, with the grant. A caller without a value runs
    the statement without it: a plain lock's or permit's acquire stays as it was.

    ``waits``: the statement of a caller whose process waits on the key (ACQUIRE):
    the key is read first and, when the snapshot shows the caller refused, nothing is
    locked or written but the process's registration in the waiters' queue (keeping
    its place: seq is drawn once) and the row's queued mark; a take ends the
    registration, and that of a chosen waiter whose window passed untaken (it lost its
    turn). The queue is read from the snapshot, which can only make a hand-off less
    fair, never unsafe. Otherwise (ACQUIRE_FAST: a first attempt, a one-shot try; gid
    is the process's if it waited just before, so a window kept for it is its own) the
    upsert alone runs, and a take keeps ``chosen`` (a window that passed untaken, or
    this process's own), so the next release passes that process over once.

    The upsert judges the row once, in the sub-select ``d`` (OFFSET 0 keeps the
    planner from copying its expressions into every column), and sets every column
    from it."""
    e = "excluded"
    now = f"({e}.expires_ms - %(ttl)s)"
    new = _permit(f"{e}.owner", "nextval({seq})", f"{e}.expires_ms", f"{e}.value")
    others = (
        f"CASE WHEN cardinality(l.others) = 0 THEN l.others ELSE "
        f"{{s}}.lock_set(l.others, {e}.owner, NULL, {e}.expires_ms, {e}.value, {now}) END"
    )
    chosen = "CASE WHEN d.kept THEN l.chosen END" if waits else "l.chosen"
    published = _PUBLISHED if publish else ""
    if waits:
        head = (
            "WITH n AS MATERIALIZED (SELECT {now} AS ms),\n"
            "cur AS MATERIALIZED (\n"
            f"    SELECT NOT {_takes('l', 'n.ms')} AS busy, {_until('l', 'n.ms')} AS until,\n"
            "           l.chosen, l.window_ms\n"
            "    FROM {s}.locks l, n WHERE l.ns = %(ns)s::text AND l.key = %(key)s::text\n"
            "),\n"
        )
        values = (
            "SELECT %(ns)s::text, %(key)s::text, %(owner)s::text, nextval({seq}), "
            "n.ms + %(ttl)s,\n           %(value)s::bytea\n"
            "    FROM n WHERE NOT EXISTS (SELECT FROM cur WHERE cur.busy)"
        )
    else:
        head = "WITH "
        values = (
            "VALUES (%(ns)s::text, %(key)s::text, %(owner)s::text, nextval({seq}),\n"
            "            {now} + %(ttl)s, %(value)s::bytea)"
        )
    # The caller's permit: slot 0 if it names the caller (a grant takes slot 0 when
    # it is free, so the caller's permit is never in others then), else in others
    # (which the update left with live permits only).
    mine_is = (
        "CASE WHEN l.owner = %(owner)s::text THEN l.{c} "
        "ELSE ({{s}}.lock_mine(l.others, %(owner)s::text, 0)).{c} END"
    )
    text = (
        head
        + f"""up AS (
    INSERT INTO {{s}}.locks AS l (ns, key, owner, token, expires_ms, value)
    {values}
    ON CONFLICT (ns, key) DO UPDATE
    SET (owner, token, expires_ms, value, others, chosen, window_ms) = (
        SELECT CASE WHEN d.g0 THEN {e}.owner ELSE l.owner END,
               CASE WHEN d.g0 THEN nextval({{seq}}) ELSE l.token END,
               CASE WHEN d.g0 OR d.mine THEN {e}.expires_ms ELSE l.expires_ms END,
               CASE WHEN d.g0 THEN {e}.value WHEN d.mine THEN coalesce({e}.value, l.value)
                    ELSE l.value END,
               {others}
               || CASE WHEN d.gn THEN ARRAY[{new}] ELSE '{{{{}}}}'::{{s}}.lock_permit[] END,
               {chosen},
               CASE WHEN d.kept THEN l.window_ms ELSE 0 END
        FROM (SELECT r.mine, r.kept, r.room AND NOT r.live AS g0, r.room AND r.live AS gn
              FROM (SELECT {_mine0("l", now)} AS mine, {_kept("l", now)} AS kept,
                           {_room("l", now)} AS room, l.expires_ms > {now} AS live
                    OFFSET 0) AS r) AS d
    )
    WHERE {_takes("l", now)}
    RETURNING {mine_is.format(c="token")} AS token,
              {mine_is.format(c="expires_ms")} AS expires_ms{published}
)"""
    )
    if waits:
        text += """,
gone AS (
    DELETE FROM {s}.lock_waiters w
    WHERE w.chan = %(chan)s::text AND EXISTS (SELECT FROM up)
      AND w.gid IN (%(gid)s::text,
                    (SELECT cur.chosen FROM cur, n WHERE cur.window_ms <= n.ms))
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
SELECT true, up.token, up.expires_ms, up.expires_ms - %(ttl)s, false FROM up
UNION ALL
SELECT false, 0::int8, cur.until, n.ms, cur.busy
FROM cur, n WHERE NOT EXISTS (SELECT FROM up)
"""
    else:
        text += f"""
SELECT true, up.token, up.expires_ms, up.expires_ms - %(ttl)s, false FROM up
UNION ALL
SELECT false, 0::int8, {_until("c", "n.ms")}, n.ms, NOT {_takes("c", "n.ms")}
FROM {{s}}.locks c, (SELECT {{now}} AS ms) AS n
WHERE c.ns = %(ns)s::text AND c.key = %(key)s::text AND NOT EXISTS (SELECT FROM up)
"""
    return text


ACQUIRE = _acquire(True)
ACQUIRE_FAST = _acquire(False)
ACQUIRE_PUBLISH = _acquire(True, publish=True)
ACQUIRE_FAST_PUBLISH = _acquire(False, publish=True)

_NOW = "n.ms"
_H0 = "(l.owner = %(owner)s::text AND l.token = %(token)s AND l.expires_ms > n.ms)"
_HN = (
    "(cardinality(l.others) > 0 AND "
    "({s}.lock_mine(l.others, %(owner)s::text, n.ms)).token = %(token)s)"
)
_HELD = (
    "(l.expires_ms > n.ms OR (cardinality(l.others) > 0 "
    "AND cardinality({s}.lock_live(l.others, n.ms)) > 0))"
)

# Row lock.release (no row: lock.release.stale): that permit freed (slot 0 becomes a
# tombstone; a permit of others is dropped). With a live registration one slot goes to
# state reserved: a window of %(handoff)s ms for the oldest registered waiter (chosen;
# passed over: the one a lapsed window named), whose id the notification carries
# (only that process wakes at once); without one (chosen NULL, whatever window_ms
# says) every waiter is woken ('*'), as they are when a window is already kept for
# another waiter (one window per key: it is left as it is). The queue is read only
# when a registration marked the row (queued), and the mark stays while any does.
# A registration racing the release may miss this one hand-off (it is not in the
# statement's snapshot, or its mark is cleared): its waiter is still woken ('*').
RELEASE = f"""
UPDATE {{s}}.locks AS l
SET expires_ms = CASE WHEN {_H0} THEN 0 ELSE l.expires_ms END,
    others = CASE WHEN {_H0} THEN l.others
                  ELSE {{s}}.lock_drop(l.others, %(owner)s::text, %(token)s, n.ms) END,
    window_ms = CASE WHEN l.chosen IS NOT NULL AND l.window_ms > n.ms THEN l.window_ms
                     ELSE n.ms + %(handoff)s END,
    chosen = CASE WHEN l.chosen IS NOT NULL AND l.window_ms > n.ms THEN l.chosen
                  WHEN l.queued THEN (
        SELECT q.gid FROM {{s}}.lock_waiters q
        WHERE q.chan = %(chan)s::text AND q.until_ms > n.ms
          AND q.gid IS DISTINCT FROM l.chosen
        ORDER BY q.seq LIMIT 1
    ) END,
    queued = l.queued AND EXISTS (
        SELECT FROM {{s}}.lock_waiters q
        WHERE q.chan = %(chan)s::text AND q.until_ms > n.ms
    )
FROM (SELECT {{now}} AS ms) AS n
WHERE l.ns = %(ns)s::text AND l.key = %(key)s::text AND ({_H0} OR {_HN})
RETURNING pg_notify(
    %(chan)s::text,
    CASE WHEN l.window_ms = n.ms + %(handoff)s THEN coalesce(l.chosen, '*') ELSE '*' END
)
"""

# A process stopped waiting on a lock without getting it (its last waiter gave up,
# timed out or was cancelled): its place in the queue goes at once. Run by the
# listener on its own connection; a crashed process's registration lapses instead.
UNREGISTER = """
DELETE FROM {s}.lock_waiters WHERE chan = %(chan)s::text AND gid = %(gid)s::text
"""

# Row lock.break (no row: lock.break.free), every holder: held by anyone -> free, and
# no window kept (every waiter is woken). The row keeps its token and the next acquire
# draws a new one from fence_seq, so an old holder's (owner, token) stops matching:
# its renew and release fail.
BREAK = f"""
UPDATE {{s}}.locks AS l SET expires_ms = 0, others = '{{{{}}}}', chosen = NULL, window_ms = 0
FROM (SELECT {{now}} AS ms) AS n
WHERE l.ns = %(ns)s::text AND l.key = %(key)s::text AND {_HELD}
RETURNING pg_notify(%(chan)s::text, '')
"""

# Row lock.break (no row: lock.break.free), the one live permit with %(token)s; the
# others and a kept window stay.
BREAK_ONE = f"""
UPDATE {{s}}.locks AS l
SET expires_ms = CASE WHEN l.token = %(token)s THEN 0 ELSE l.expires_ms END,
    others = {_live_others("l", _NOW, "p.token = %(token)s")}
FROM (SELECT {{now}} AS ms) AS n
WHERE l.ns = %(ns)s::text AND l.key = %(key)s::text
  AND ((l.token = %(token)s AND l.expires_ms > n.ms) OR EXISTS (
      SELECT FROM unnest(l.others) p WHERE p.token = %(token)s AND p.expires_ms > n.ms))
RETURNING pg_notify(%(chan)s::text, '')
"""


# Row lock.renew (no row: lock.renew.stale): the permit's expiry, and its published
# value when one is given (RENEW_PUBLISH: then the key's observers are notified too,
# payload '!', which its waiters sleep through).
RENEW = f"""
UPDATE {{s}}.locks AS l
SET expires_ms = CASE WHEN {_H0} THEN n.ms + %(ttl)s ELSE l.expires_ms END,
    value = CASE WHEN {_H0} THEN coalesce(%(value)s::bytea, l.value) ELSE l.value END,
    others = CASE WHEN {_H0} THEN l.others ELSE {{s}}.lock_set(
        l.others, %(owner)s::text, %(token)s, n.ms + %(ttl)s, %(value)s::bytea, n.ms) END
FROM (SELECT {{now}} AS ms) AS n
WHERE l.ns = %(ns)s::text AND l.key = %(key)s::text AND ({_H0} OR {_HN})
RETURNING n.ms + %(ttl)s
"""
RENEW_PUBLISH = RENEW.replace(
    "RETURNING n.ms + %(ttl)s\n", "RETURNING n.ms + %(ttl)s, pg_notify(%(chan)s::text, '!')\n"
)
assert RENEW_PUBLISH != RENEW

# The batched renewal of a coordinator's renewer: many claims and leases in one
# statement (each item's check as in EXTEND and RENEW: rows extend.ok, extend.stale,
# lock.renew, lock.renew.stale). Leases are grouped by key, so that one row update
# renews every permit of the key in the batch. Replies: (kind, position, expiry) for
# each renewed item; an item missing from the reply was refused.
_ITEM = "unnest(g.owners, g.tokens, g.ttls, g.poss) AS j(owner, token, ttl, pos)"
_ITEM_AT = (
    "(SELECT n.ms + j.ttl FROM {items} WHERE j.owner = {r}.owner AND j.token = {r}.token LIMIT 1)"
)
_RENEWED_SLOT0 = _ITEM_AT.format(items=_ITEM, r="l")
_RENEWED_N = _permit(
    "p.owner",
    "p.token",
    f"coalesce({_ITEM_AT.format(items=_ITEM, r='p')}, p.expires_ms)",
    "p.value",
)
_DONE = (
    f"FROM {_ITEM} WHERE (j.owner = l.owner AND j.token = l.token "
    "AND l.expires_ms = n.ms + j.ttl) OR EXISTS (SELECT FROM unnest(l.others) p "
    "WHERE p.owner = j.owner AND p.token = j.token AND p.expires_ms = n.ms + j.ttl) "
    "ORDER BY j.pos"
)
RENEW_MANY = f"""
WITH n AS MATERIALIZED (SELECT {{now}} AS ms),
c AS (
    UPDATE {{s}}.claims AS c SET expires_ms = n.ms + i.lease
    FROM n, unnest(%(cns)s::text[], %(ckey)s::text[], %(ctoken)s::text[], %(clease)s::int8[])
        WITH ORDINALITY AS i(ns, key, token, lease, pos)
    WHERE c.ns = i.ns AND c.key = i.key AND c.token = i.token
      AND c.state = 'in_flight' AND c.expires_ms > n.ms
    RETURNING i.pos, c.expires_ms
),
g AS (
    SELECT i.ns, i.key, array_agg(i.owner) AS owners, array_agg(i.token) AS tokens,
           array_agg(i.ttl) AS ttls, array_agg(i.pos) AS poss
    FROM unnest(%(lns)s::text[], %(lkey)s::text[], %(lowner)s::text[], %(ltoken)s::int8[],
                %(lttl)s::int8[]) WITH ORDINALITY AS i(ns, key, owner, token, ttl, pos)
    GROUP BY i.ns, i.key
),
l AS (
    UPDATE {{s}}.locks AS l
    SET expires_ms = CASE WHEN l.expires_ms > n.ms
                          THEN coalesce({_RENEWED_SLOT0}, l.expires_ms)
                          ELSE l.expires_ms END,
        others = CASE WHEN cardinality(l.others) = 0 THEN l.others
                      ELSE {_live_others("l", _NOW, replace=f"WHEN true THEN {_RENEWED_N}")} END
    FROM n, g
    WHERE l.ns = g.ns AND l.key = g.key AND EXISTS (
        SELECT FROM {_ITEM}
        WHERE (j.owner = l.owner AND j.token = l.token AND l.expires_ms > n.ms)
           OR EXISTS (SELECT FROM unnest(l.others) p WHERE p.owner = j.owner
                      AND p.token = j.token AND p.expires_ms > n.ms))
    RETURNING ARRAY(SELECT j.pos {_DONE}) AS poss, ARRAY(SELECT n.ms + j.ttl {_DONE}) AS exps
)
SELECT 'c', pos, expires_ms FROM c
UNION ALL
SELECT 'l', x.pos, x.exp FROM l, unnest(l.poss, l.exps) AS x(pos, exp)
"""

# Every live permit of a key (HOLDERS), of a key's lowest token (LOCK), of the keys
# under a prefix (LOCKS): slot 0 and others, lowest token first.
_PERMITS = """
    LATERAL (SELECT l.owner, l.token, l.expires_ms, l.value WHERE l.expires_ms > n.ms
             UNION ALL
             SELECT p.owner, p.token, p.expires_ms, p.value FROM unnest(l.others) p
             WHERE p.expires_ms > n.ms) h"""

HOLDERS = f"""
SELECT h.owner, h.token, h.expires_ms, h.value
FROM {{s}}.locks l, (SELECT {{now}} AS ms) AS n,{_PERMITS}
WHERE l.ns = %(ns)s::text AND l.key = %(key)s::text
ORDER BY h.token
"""

LOCK = HOLDERS + "LIMIT 1\n"

LOCKS = f"""
SELECT l.ns, l.key, h.owner, h.token, h.expires_ms, h.value
FROM {{s}}.locks l, (SELECT {{now}} AS ms) AS n,{_PERMITS}
WHERE starts_with(l.ns, %(prefix)s::text)
ORDER BY l.ns, l.key, h.token
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
# that claim.ttl, claim.expiry and lock.expiry left dead (a key with a live permit or
# in its hand-off window is kept). The outer condition is re-checked on the latest row
# version, so a row re-claimed meanwhile is kept. Returns the rows deleted and what
# they count for: one per claim; per lock row, slot 0 (expired or a tombstone) and
# each (expired) permit of others.
PURGE = """
WITH n AS MATERIALIZED (SELECT {now} AS ms),
d AS (
    DELETE FROM {s}.{table} AS t
    USING (SELECT t.ns, t.key FROM {s}.{table} AS t WHERE {dead} LIMIT %(batch)s) AS x
    WHERE t.ns = x.ns AND t.key = x.key AND {dead}
    RETURNING {weight} AS w
)
SELECT count(*), coalesce(sum(w), 0) FROM d
"""

# Row claim.ttl, claim.expiry: a record that ended, unless its key still has live steps
# (they need the row: CLAIM_FAST reads no steps, a new key having none; and it keeps
# their end).
_CLAIM_DEAD = (
    "(t.expires_ms <= (SELECT ms FROM n) AND t.steps_ms <= (SELECT ms FROM n) "
    "AND NOT EXISTS (SELECT FROM {s}.claim_steps st "
    "WHERE st.ns = t.ns AND st.key = t.key AND st.until_ms > (SELECT ms FROM n)))"
)
# Row lock.expiry: nothing live in the row (slot 0, others, a kept window).
_LOCK_DEAD = (
    "(expires_ms <= (SELECT ms FROM n) AND window_ms <= (SELECT ms FROM n) AND NOT EXISTS "
    "(SELECT FROM unnest(others) p WHERE p.expires_ms > (SELECT ms FROM n)))"
)
_AT = "(SELECT ms FROM n)"


def _dead_others(r: str) -> str:
    return f"(SELECT count(*) FROM unnest({r}others) p WHERE p.expires_ms <= {_AT})"


def _promote(r: str) -> str:
    """Slot 0 expired (or released) while a permit of others lives on."""
    return (
        f"({r}expires_ms <= {_AT} AND EXISTS "
        f"(SELECT FROM unnest({r}others) p WHERE p.expires_ms > {_AT}))"
    )


def _first_live(r: str, column: str) -> str:
    return (
        f"(SELECT p.{column} FROM unnest({r}others) p WHERE p.expires_ms > {_AT} "
        "ORDER BY p.token LIMIT 1)"
    )


def _prune_weight(r: str) -> str:
    """The expired permits of a key that stays: slot 0, once a permit of others takes
    its place, and those of others."""
    return f"({_promote(r)}::int + {_dead_others(r)})"


_DEAD_OTHERS = _dead_others("")
_PROMOTE_T = _promote("t.")
_NEEDS_PRUNE = f"({_promote('')} OR {_DEAD_OTHERS} > 0)"
_LIVE_REST = (
    "ARRAY(SELECT "
    + _permit("p.owner", "p.token", "p.expires_ms", "p.value")
    + f" FROM unnest(t.others) p WHERE p.expires_ms > {_AT} ORDER BY p.token OFFSET 1)"
)

# Row lock.expiry in a key that stays: its expired permits are dropped, those of
# others, and an expired slot 0 whose place the lowest-token live permit of others
# takes (slot 0 stays the key's first live permit, which a process of the previous
# layout sees). Returns the rows changed and the permits dropped (as the statement's
# snapshot counted them).
PRUNE_LOCKS = f"""
WITH n AS MATERIALIZED (SELECT {{now}} AS ms),
d AS (
    UPDATE {{s}}.locks AS t
    SET owner = CASE WHEN {_PROMOTE_T} THEN {_first_live("t.", "owner")} ELSE t.owner END,
        token = CASE WHEN {_PROMOTE_T} THEN {_first_live("t.", "token")} ELSE t.token END,
        expires_ms = CASE WHEN {_PROMOTE_T} THEN {_first_live("t.", "expires_ms")}
                          ELSE t.expires_ms END,
        value = CASE WHEN {_PROMOTE_T} THEN {_first_live("t.", "value")} ELSE t.value END,
        others = CASE WHEN {_PROMOTE_T} THEN {_LIVE_REST}
                      ELSE {_live_others("t", _AT)} END
    FROM (SELECT ns, key, {_prune_weight("")} AS dead FROM {{s}}.locks
          WHERE {_NEEDS_PRUNE} LIMIT %(batch)s) AS x
    WHERE t.ns = x.ns AND t.key = x.key AND ({_PROMOTE_T} OR {_dead_others("t.")} > 0)
    RETURNING x.dead
)
SELECT count(*), coalesce(sum(dead), 0) FROM d
"""

#: what a lock row counts for in the dry run: a row PURGE deletes, or PRUNE_LOCKS' drops
_LOCK_WEIGHT = f"CASE WHEN {_LOCK_DEAD} THEN 1 + cardinality(others) ELSE {_prune_weight('')} END"

# Purge's dry run: what PURGE (and PRUNE_LOCKS) would remove, counted in batches along
# the primary key (keyset: each batch starts after the last key of the one before;
# NULL starts at the beginning). Read-only: no row is locked. Returns the batch's row
# count, what they count for, and its last key.
PURGE_COUNT = """
WITH n AS MATERIALIZED (SELECT {now} AS ms),
b AS MATERIALIZED (
    SELECT ns, key, {weight} AS w FROM {s}.{table} AS t
    WHERE ({dead})
      AND (%(ns)s::text IS NULL OR (ns, key) > (%(ns)s::text, %(key)s::text))
    ORDER BY ns, key LIMIT %(batch)s
),
l AS (SELECT ns, key FROM b ORDER BY ns DESC, key DESC LIMIT 1)
SELECT (SELECT count(*) FROM b), (SELECT coalesce(sum(w), 0) FROM b), l.ns, l.key
FROM (SELECT 1) AS one LEFT JOIN l ON true
"""

# Steps whose end passed, their own and their key's (parts of records, not records:
# purge does not count them).
_STEP_OVER = (
    "t.until_ms <= (SELECT ms FROM n) AND NOT EXISTS (SELECT FROM {s}.claims c "
    "WHERE c.ns = t.ns AND c.key = t.key AND c.steps_ms > (SELECT ms FROM n))"
)
PURGE_STEPS = f"""
WITH n AS MATERIALIZED (SELECT {{now}} AS ms),
d AS (
    DELETE FROM {{s}}.claim_steps AS t
    USING (SELECT ns, key, name FROM {{s}}.claim_steps AS t
           WHERE {_STEP_OVER} LIMIT %(batch)s) AS x
    WHERE t.ns = x.ns AND t.key = x.key AND t.name = x.name AND {_STEP_OVER}
    RETURNING 1
)
SELECT count(*) FROM d
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
    step: Stmt
    drop_step: Stmt
    steps: Stmt
    record: Stmt
    records: Stmt
    acquire: Stmt
    acquire_fast: Stmt
    #: acquire and acquire_fast of a caller that publishes a value (observers notified)
    acquire_publish: Stmt
    acquire_fast_publish: Stmt
    release: Stmt
    break_lock: Stmt
    renew: Stmt
    #: renew of a caller that publishes a value (observers notified)
    renew_publish: Stmt
    break_one: Stmt
    holders: Stmt
    lock: Stmt
    locks: Stmt
    fence_advance: Stmt
    fence_current: Stmt
    purge_claims: Stmt
    purge_locks: Stmt
    prune_locks: Stmt
    purge_waiters: Stmt
    purge_steps: Stmt
    count_claims: Stmt
    count_locks: Stmt
    unregister: Stmt
    version: bytes

    @classmethod
    def for_schema(cls, schema: str) -> Statements:
        r = Stmt.render
        claim_dead = _CLAIM_DEAD.replace("{s}", sql.Identifier(schema).as_string(None))
        return cls(
            schema=schema,
            claim=r(CLAIM, schema),
            claim_fast=r(CLAIM_FAST, schema),
            complete=r(COMPLETE, schema),
            abandon=r(ABANDON, schema),
            extend=r(EXTEND, schema),
            forget=r(FORGET, schema),
            step=r(STEP, schema),
            drop_step=r(DROP_STEP, schema),
            steps=r(STEPS, schema),
            record=r(RECORD, schema),
            records=r(RECORDS, schema),
            acquire=r(ACQUIRE, schema),
            acquire_fast=r(ACQUIRE_FAST, schema),
            acquire_publish=r(ACQUIRE_PUBLISH, schema),
            acquire_fast_publish=r(ACQUIRE_FAST_PUBLISH, schema),
            release=r(RELEASE, schema),
            break_lock=r(BREAK, schema),
            break_one=r(BREAK_ONE, schema),
            holders=r(HOLDERS, schema),
            renew=r(RENEW, schema),
            renew_publish=r(RENEW_PUBLISH, schema),
            lock=r(LOCK, schema),
            locks=r(LOCKS, schema),
            fence_advance=r(FENCE_ADVANCE, schema),
            fence_current=r(FENCE_CURRENT, schema),
            purge_claims=r(PURGE, schema, table="claims", dead=claim_dead, weight="1"),
            purge_locks=r(
                PURGE, schema, table="locks", dead=_LOCK_DEAD, weight="1 + cardinality(t.others)"
            ),
            prune_locks=r(PRUNE_LOCKS, schema),
            purge_waiters=r(PURGE_WAITERS, schema),
            purge_steps=r(PURGE_STEPS, schema),
            count_claims=r(PURGE_COUNT, schema, table="claims", dead=claim_dead, weight="1"),
            count_locks=r(
                PURGE_COUNT,
                schema,
                table="locks",
                dead=f"{_LOCK_DEAD} OR {_NEEDS_PRUNE}",
                weight=_LOCK_WEIGHT,
            ),
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
