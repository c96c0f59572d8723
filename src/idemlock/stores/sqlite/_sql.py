"""The SQL of the SQLite store: its schema and one statement per transition.

Each statement names the rows of the state table (:mod:`idemlock._core.table`) it
implements.
"""

from __future__ import annotations

SCHEMA_VERSION = 1
DEFAULT_BUSY_TIMEOUT = 5.0
#: idle connections kept per store; more concurrent callers get a connection each,
#: closed when they are done
MAX_IDLE = 16

# ---- SQL ------------------------------------------------------------------------
# Module constants: the sqlite3 statement cache keys on the text, so each statement is
# prepared once per connection.

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS meta (
        name TEXT PRIMARY KEY NOT NULL,
        value INTEGER NOT NULL
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS claims (
        ns TEXT NOT NULL,
        key TEXT NOT NULL,
        state TEXT NOT NULL,
        token TEXT NOT NULL,
        fence INTEGER NOT NULL,
        fp TEXT,
        expires_ms INTEGER NOT NULL,
        result BLOB,
        steps_ms INTEGER NOT NULL DEFAULT 0,
        PRIMARY KEY (ns, key)
    ) WITHOUT ROWID""",
    "CREATE INDEX IF NOT EXISTS claims_expires ON claims (expires_ms)",
    """CREATE TABLE IF NOT EXISTS locks (
        ns TEXT NOT NULL,
        key TEXT NOT NULL,
        owner TEXT NOT NULL,
        token INTEGER NOT NULL,
        expires_ms INTEGER NOT NULL,
        PRIMARY KEY (ns, key)
    ) WITHOUT ROWID""",
    """CREATE TABLE IF NOT EXISTS fences (
        ns TEXT NOT NULL,
        resource TEXT NOT NULL,
        highest INTEGER NOT NULL,
        PRIMARY KEY (ns, resource)
    ) WITHOUT ROWID""",
    # The queue of a lock's waiters (fair hand-off): seq is the arrival order, until_ms
    # when the registration lapses (its waiter stopped asking), window_ms > 0 marks the
    # chosen waiter, for which the free lock is reserved until then; wake is the name of
    # the waiter's process's socket ("": none, it polls; see _wake). An idemlock that
    # does not know this table only loses fairness, so the schema version stays.
    """CREATE TABLE IF NOT EXISTS lock_waiters (
        ns TEXT NOT NULL,
        key TEXT NOT NULL,
        owner TEXT NOT NULL,
        seq INTEGER NOT NULL,
        pid INTEGER NOT NULL,
        host TEXT NOT NULL,
        until_ms INTEGER NOT NULL,
        tries INTEGER NOT NULL,
        window_ms INTEGER NOT NULL DEFAULT 0,
        wake TEXT NOT NULL DEFAULT '',
        PRIMARY KEY (ns, key, owner)
    ) WITHOUT ROWID""",
    # 'floor' is at least every fence and token of a row that purge deleted, so a key
    # created again starts above all it ever had; 'schema' is the layout version.
    "INSERT OR IGNORE INTO meta (name, value) VALUES ('schema', 1), ('floor', 0)",
)
# Steps inside a claim (rows step.*): the steps of a key beside its record, so an
# abandon (a tombstone) keeps them for the next attempt. The end of a key's steps is
# kept once, in its claims row (steps_ms: the ttl after its last step written, or, once
# completed, the record's end), so a step write changes that row and its own step row,
# never the key's other steps: it costs the same however many the key has. A step
# row's until_ms is the key's end when that row was written (the trigger moves it to the
# record's end on complete.ok / complete.late). A step lives while its row's until_ms
# or its key's steps_ms is ahead: rows written before steps_ms existed (and by an
# idemlock that does not know it, which also leaves a forgotten key's steps to their
# until_ms) read as they did.
_STEPS_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS claim_steps (
        ns TEXT NOT NULL,
        key TEXT NOT NULL,
        name TEXT NOT NULL,
        fence INTEGER NOT NULL,
        result BLOB,
        until_ms INTEGER NOT NULL,
        PRIMARY KEY (ns, key, name)
    ) WITHOUT ROWID""",
    """CREATE TRIGGER IF NOT EXISTS claim_steps_completed AFTER UPDATE OF state ON claims
    WHEN NEW.state = 'completed'
    BEGIN
        UPDATE claim_steps SET until_ms = NEW.expires_ms WHERE ns = NEW.ns AND key = NEW.key;
    END""",
)
# A file whose claims predate steps_ms gets it (0: no end kept; old writers leave it).
_CLAIMS_COLUMNS = "SELECT name FROM pragma_table_info('claims')"
_CLAIMS_ADD_STEPS = "ALTER TABLE claims ADD COLUMN steps_ms INTEGER NOT NULL DEFAULT 0"
_SCHEMA_GET = "SELECT value FROM meta WHERE name = 'schema'"
# A file whose lock_waiters predates the wake column gets it (old writers leave it '').
_WAITERS_COLUMNS = "SELECT name FROM pragma_table_info('lock_waiters')"
_WAITERS_ADD_WAKE = "ALTER TABLE lock_waiters ADD COLUMN wake TEXT NOT NULL DEFAULT ''"
# The file's secret that keys the tags of its wake-ups (_wake.tag): random, made by
# the first process to open the file, read by every other.
_WAKE_KEY_NEW = "INSERT OR IGNORE INTO meta (name, value) VALUES ('wake_key', ?1)"
_WAKE_KEY_GET = "SELECT value FROM meta WHERE name = 'wake_key'"
assert _SCHEMA[0].startswith("CREATE TABLE IF NOT EXISTS meta")

_BEGIN = "BEGIN IMMEDIATE"
_COMMIT = "COMMIT"
_ROLLBACK = "ROLLBACK"

# Row claim.new: absent or expired -> in flight with the next fence, in one statement.
# Fences are per key: a dead row (expired, abandoned, forgotten) stays as a tombstone that keeps its
# fence, so the next claim of the key counts on from it; a brand-new key starts above the
# purge floor. Writing no shared counter row keeps a claim to the pages of its own row.
# Nothing is returned when a live record is in the way; the caller then reads it.
_CLAIM_NEW = """
INSERT INTO claims (ns, key, state, token, fence, fp, expires_ms, result)
VALUES (?1, ?2, 'in_flight', ?3, (SELECT value FROM meta WHERE name = 'floor') + 1, ?4, ?5,
        NULL)
ON CONFLICT (ns, key) DO UPDATE SET
    state = 'in_flight', token = excluded.token, fence = claims.fence + 1, fp = excluded.fp,
    expires_ms = excluded.expires_ms, result = NULL
WHERE claims.expires_ms <= ?6
RETURNING fence, steps_ms > ?6 OR EXISTS (SELECT 1 FROM claim_steps
                                          WHERE ns = ?1 AND key = ?2 AND until_ms > ?6)
"""
# Rows claim.resend, claim.mismatch, claim.busy, claim.replay: the record in the way,
# read back for the table to decide (SQLiteStore._claim).
_CLAIM_GET = (
    "SELECT state, token, fence, fp, expires_ms, result FROM claims WHERE ns = ?1 AND key = ?2"
)
# Rows complete.ok, complete.late, complete.resend. Complete and abandon are accepted
# after the lease ended while the record still holds this token (nobody took the key
# over) and is no tombstone (expires_ms = 0: abandoned or forgotten): refusing would
# throw finished work away and run it again. A completion re-sent after a lost reply
# (completed, same token, same result, ttl running) matches and changes nothing. The
# key's live steps end with the record (their rows: the trigger).
_COMPLETE = """
UPDATE claims SET state = 'completed', result = ?1,
    expires_ms = CASE WHEN state = 'in_flight' THEN ?2 ELSE expires_ms END,
    steps_ms = CASE WHEN state = 'in_flight' AND steps_ms > ?6 THEN ?2 ELSE steps_ms END
WHERE ns = ?3 AND key = ?4 AND token = ?5 AND (
    (state = 'in_flight' AND expires_ms > 0)
    OR (state = 'completed' AND result = ?1 AND expires_ms > ?6))
"""
# Rows abandon.ok, abandon.late. Freeing a key leaves a tombstone (expires_ms = 0)
# that keeps the fence.
_ABANDON = """
UPDATE claims SET expires_ms = 0, result = NULL
WHERE ns = ?1 AND key = ?2 AND token = ?3 AND state = 'in_flight' AND expires_ms > 0
"""
# Row extend.ok (a lapsed lease is never revived: extend.stale)
_EXTEND = """
UPDATE claims SET expires_ms = ?1
WHERE ns = ?2 AND key = ?3 AND token = ?4 AND state = 'in_flight' AND expires_ms > ?5
"""
# Rows forget.live (one row changed), forget.dead (none); the key's steps end in both
# (_txn._forget).
_FORGET = """
UPDATE claims SET expires_ms = 0, result = NULL
WHERE ns = ?1 AND key = ?2 AND expires_ms > ?3
"""
# Rows step.record, step.drop, in one transaction (_txn._step): the caller's claim
# renewed as _EXTEND renews it and, for a step written, the key's steps' end moved to
# the later of theirs and now + ttl (?6), when it is ahead (?5 now). The end comes back
# (the fence with it): one behind now is the end of steps that are over, if any (left
# as it was), and the transaction then drops the key's ended steps (so none is revived)
# before it sets the new end: once a generation of steps, not once a step.
_STEP_RENEW = """
UPDATE claims SET expires_ms = ?1,
    steps_ms = CASE WHEN steps_ms > ?5 THEN max(steps_ms, ?6) ELSE steps_ms END
WHERE ns = ?2 AND key = ?3 AND token = ?4 AND state = 'in_flight' AND expires_ms > ?5
RETURNING fence, steps_ms
"""
_STEPS_DROP_DEAD = "DELETE FROM claim_steps WHERE ns = ?1 AND key = ?2 AND until_ms <= ?3"
# The new end: now + ttl, or the later end of the steps left (rows that carry their own)
_STEPS_START = """
UPDATE claims SET steps_ms = max(?3, coalesce(
    (SELECT max(until_ms) FROM claim_steps WHERE ns = ?1 AND key = ?2), 0))
WHERE ns = ?1 AND key = ?2
RETURNING steps_ms
"""
_STEP_PUT = """
INSERT INTO claim_steps (ns, key, name, fence, result, until_ms) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
ON CONFLICT (ns, key, name) DO UPDATE SET
    fence = excluded.fence, result = excluded.result, until_ms = excluded.until_ms
"""
_STEP_DROP = "DELETE FROM claim_steps WHERE ns = ?1 AND key = ?2 AND name = ?3"
_STEPS_FORGET = "DELETE FROM claim_steps WHERE ns = ?1 AND key = ?2"
_STEPS_END_FORGET = "UPDATE claims SET steps_ms = 0 WHERE ns = ?1 AND key = ?2 AND steps_ms <> 0"
# The key's live steps: its steps' end ahead (one probe of the claims row, evaluated
# once), or the row's own.
_STEPS_GET = """
SELECT name, fence, result FROM claim_steps
WHERE ns = ?1 AND key = ?2
  AND (until_ms > ?3
       OR EXISTS (SELECT 1 FROM claims WHERE ns = ?1 AND key = ?2 AND steps_ms > ?3))
ORDER BY name
"""
_RECORD_GET = """
SELECT state, fence, expires_ms FROM claims WHERE ns = ?1 AND key = ?2 AND expires_ms > ?3
"""
# substr() rather than LIKE: namespaces contain '%' (the escape of keys.namespace).
_RECORDS = """
SELECT ns, key, state, fence, expires_ms FROM claims
WHERE substr(ns, 1, ?1) = ?2 AND expires_ms > ?3 ORDER BY ns, key
"""

# Locks and permits. A lock is the limit=1 case of the same rows and statements: a key
# has one row in lock_permits per holder (at most one per owner; each with its own token
# and expiry), and one row in locks, the key's summary: its token counter (the last token
# granted: tokens count on from it, also after a release, a break or an expiry, as the
# released lock's tombstone did before permits) and, in expires_ms, when its last permit
# ends (0: none). The triggers of _SCHEMA keep the summary, so each statement below is
# still one transition in one statement. A summary that is live while no permit is, is a
# lock taken by idemlock before permits (the same row, written by that release's
# statements): it counts as one holder, and a process of that release never takes a key
# while a permit of it is live.
_PERMITS_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS lock_permits (
        ns TEXT NOT NULL,
        key TEXT NOT NULL,
        owner TEXT NOT NULL,
        token INTEGER NOT NULL,
        expires_ms INTEGER NOT NULL,
        value BLOB,
        PRIMARY KEY (ns, key, owner)
    ) WITHOUT ROWID""",
    # No index on the expiries of locks and permits: every acquire and release would
    # write a page more; purge scans instead (a file of the release before permits
    # loses its index here).
    "DROP INDEX IF EXISTS locks_expires",
    # Rows lock.acquire, lock.handoff.take: the summary counts the new token, and lasts
    # at least as long as the new permit.
    """CREATE TRIGGER IF NOT EXISTS lock_permits_granted AFTER INSERT ON lock_permits
    BEGIN
        INSERT INTO locks (ns, key, owner, token, expires_ms)
        VALUES (NEW.ns, NEW.key, NEW.owner, NEW.token, NEW.expires_ms)
        ON CONFLICT (ns, key) DO UPDATE SET
            owner = excluded.owner, token = max(locks.token, excluded.token),
            expires_ms = max(locks.expires_ms, excluded.expires_ms);
    END""",
    # Rows lock.reacquire, lock.renew, and lock.acquire of an owner whose permit expired:
    # the summary ends with the key's last permit (and is made again if a purge of the
    # release before permits deleted it).
    """CREATE TRIGGER IF NOT EXISTS lock_permits_changed AFTER UPDATE ON lock_permits
    BEGIN
        INSERT INTO locks (ns, key, owner, token, expires_ms)
        VALUES (NEW.ns, NEW.key, NEW.owner, NEW.token, NEW.expires_ms)
        ON CONFLICT (ns, key) DO UPDATE SET
            owner = CASE WHEN excluded.token >= locks.token THEN excluded.owner
                         ELSE locks.owner END,
            token = max(locks.token, excluded.token),
            expires_ms = (SELECT max(expires_ms) FROM lock_permits
                          WHERE ns = excluded.ns AND key = excluded.key);
    END""",
    # Rows lock.release, lock.break, and purge: the token stays; 0 once none is left.
    """CREATE TRIGGER IF NOT EXISTS lock_permits_freed AFTER DELETE ON lock_permits
    BEGIN
        UPDATE locks SET expires_ms = coalesce(
            (SELECT max(expires_ms) FROM lock_permits WHERE ns = OLD.ns AND key = OLD.key), 0)
        WHERE ns = OLD.ns AND key = OLD.key;
    END""",
)

# The live holders of a key (?1 ns, ?2 key, ?5 now) as counted against a limit: its live
# permits, or one for a lock taken before permits (a live summary without them).
_COUNT_HOLDERS = """max(
    (SELECT count(*) FROM lock_permits WHERE ns = ?1 AND key = ?2 AND expires_ms > ?5),
    (SELECT count(*) FROM locks WHERE ns = ?1 AND key = ?2 AND expires_ms > ?5))"""
# Rows lock.reacquire and lock.acquire, in one statement for the common case (lock.busy:
# nothing returned). ?6 is the caller's limit, ?7 the value to publish (NULL: none, or
# keep the published one). The same owner's live permit -> same token, new expiry; room
# under the limit and nobody queued -> a permit with the key's next token (a new key:
# above the purge floor); the owner's expired permit row is taken over. With waiters
# queued a new permit is left to _store._acquire_queued (rows lock.handoff*).
_ACQUIRE_UNQUEUED = f"""
INSERT INTO lock_permits (ns, key, owner, token, expires_ms, value)
SELECT ?1, ?2, ?3,
       coalesce((SELECT token FROM locks WHERE ns = ?1 AND key = ?2),
                (SELECT value FROM meta WHERE name = 'floor')) + 1,
       ?4, ?7
WHERE EXISTS (SELECT 1 FROM lock_permits
              WHERE ns = ?1 AND key = ?2 AND owner = ?3 AND expires_ms > ?5)
   OR (NOT EXISTS (SELECT 1 FROM lock_waiters WHERE ns = ?1 AND key = ?2)
       AND {_COUNT_HOLDERS} < ?6)
ON CONFLICT (ns, key, owner) DO UPDATE SET
    token = CASE WHEN lock_permits.expires_ms > ?5 THEN lock_permits.token
                 ELSE excluded.token END,
    expires_ms = excluded.expires_ms,
    value = CASE WHEN lock_permits.expires_ms > ?5
                 THEN coalesce(excluded.value, lock_permits.value) ELSE excluded.value END
RETURNING token
"""
# Rows lock.acquire, lock.reacquire, lock.handoff.take as the table decided them in
# _store._acquire_queued: the caller's permit as it is now.
_PERMIT_PUT = """
INSERT INTO lock_permits (ns, key, owner, token, expires_ms, value)
VALUES (?1, ?2, ?3, ?4, ?5, ?6)
ON CONFLICT (ns, key, owner) DO UPDATE SET
    token = excluded.token, expires_ms = excluded.expires_ms, value = excluded.value
"""
# A key as _store._acquire_queued reads it: the summary, then every permit row.
_LOCK_GET = "SELECT owner, token, expires_ms FROM locks WHERE ns = ?1 AND key = ?2"
_PERMITS_GET = """
SELECT owner, token, expires_ms, value FROM lock_permits WHERE ns = ?1 AND key = ?2
"""
_FLOOR_GET = "SELECT value FROM meta WHERE name = 'floor'"

# The waiters' queue (rows lock.handoff, lock.handoff.take; see _store._choose).
_WAITERS = """
SELECT owner, pid, host, until_ms, tries, window_ms, wake FROM lock_waiters
WHERE ns = ?1 AND key = ?2 ORDER BY seq
"""
_WAITER_REGISTER = """
INSERT INTO lock_waiters (ns, key, owner, seq, pid, host, until_ms, tries, wake)
VALUES (?1, ?2, ?3,
        coalesce((SELECT max(seq) FROM lock_waiters WHERE ns = ?1 AND key = ?2), 0) + 1,
        ?4, ?5, ?6, 1, ?7)
ON CONFLICT (ns, key, owner) DO UPDATE SET
    until_ms = excluded.until_ms, pid = excluded.pid, host = excluded.host,
    tries = lock_waiters.tries + 1, wake = excluded.wake
"""
_WAITER_DROP = "DELETE FROM lock_waiters WHERE ns = ?1 AND key = ?2 AND owner = ?3"
# A process stopped waiting on a lock without getting it (its last waiter there gave up,
# timed out or was cancelled): the waiters it queued leave the queue at once, so that no
# window is kept for them (a crashed process's registrations lapse instead).
_WAITER_UNREGISTER = """
DELETE FROM lock_waiters WHERE ns = ?1 AND key = ?2 AND owner = ?3 AND pid = ?4 AND host = ?5
"""
_WAITER_CHOOSE = "UPDATE lock_waiters SET window_ms = ?4 WHERE ns = ?1 AND key = ?2 AND owner = ?3"
_WAITERS_UNCHOOSE = "UPDATE lock_waiters SET window_ms = 0 WHERE ns = ?1 AND key = ?2"
_PURGE_WAITERS = "DELETE FROM lock_waiters WHERE until_ms <= ?1 AND window_ms <= ?1"

# The live holders of a key (?3 now), lowest token first: its live permits, else a
# lock taken before permits (a live summary).
_HOLDERS = """
SELECT owner, token, expires_ms, value FROM lock_permits
WHERE ns = ?1 AND key = ?2 AND expires_ms > ?3
UNION ALL
SELECT owner, token, expires_ms, NULL FROM locks
WHERE ns = ?1 AND key = ?2 AND expires_ms > ?3
  AND NOT EXISTS (SELECT 1 FROM lock_permits WHERE ns = ?1 AND key = ?2 AND expires_ms > ?3)
ORDER BY 2
"""
# Row lock.release (lock.release.stale: no row changed). The trigger ends the summary
# with the key's last live permit; the token stays.
_RELEASE = """
DELETE FROM lock_permits
WHERE ns = ?1 AND key = ?2 AND owner = ?3 AND token = ?4 AND expires_ms > ?5
"""
# Row lock.release of a lock taken before permits (tried when _RELEASE changed nothing).
_RELEASE_OLD = """
UPDATE locks SET expires_ms = 0
WHERE ns = ?1 AND key = ?2 AND owner = ?3 AND token = ?4 AND expires_ms > ?5
  AND NOT EXISTS (SELECT 1 FROM lock_permits WHERE ns = ?1 AND key = ?2 AND expires_ms > ?5)
"""
# Row lock.renew (lock.renew.stale: no row changed); ?7 the value to publish (NULL: keep).
_RENEW = """
UPDATE lock_permits SET expires_ms = ?1, value = coalesce(?7, value)
WHERE ns = ?2 AND key = ?3 AND owner = ?4 AND token = ?5 AND expires_ms > ?6
"""
# Row lock.renew of a lock taken before permits (tried when _RENEW changed nothing).
_RENEW_OLD = """
UPDATE locks SET expires_ms = ?1
WHERE ns = ?2 AND key = ?3 AND owner = ?4 AND token = ?5 AND expires_ms > ?6
  AND NOT EXISTS (SELECT 1 FROM lock_permits WHERE ns = ?2 AND key = ?3 AND expires_ms > ?6)
"""
# Row lock.break: every live permit (?4 NULL) or the one with token ?4 -> freed. The
# summary keeps the token, so the next acquire counts on from it and the old holder's
# (owner, token) matches nothing.
_BREAK = """
DELETE FROM lock_permits
WHERE ns = ?1 AND key = ?2 AND expires_ms > ?3 AND (?4 IS NULL OR token = ?4)
"""
# Row lock.break of a lock taken before permits.
_BREAK_OLD = """
UPDATE locks SET expires_ms = 0
WHERE ns = ?1 AND key = ?2 AND expires_ms > ?3 AND (?4 IS NULL OR token = ?4)
  AND NOT EXISTS (SELECT 1 FROM lock_permits WHERE ns = ?1 AND key = ?2 AND expires_ms > ?3)
"""
# One row per live holder, as _HOLDERS, of every key whose ns starts with the prefix.
_LOCKS = """
SELECT ns, key, owner, token, expires_ms, value FROM lock_permits
WHERE substr(ns, 1, ?1) = ?2 AND expires_ms > ?3
UNION ALL
SELECT ns, key, owner, token, expires_ms, NULL FROM locks AS l
WHERE substr(ns, 1, ?1) = ?2 AND expires_ms > ?3
  AND NOT EXISTS (SELECT 1 FROM lock_permits AS p
                  WHERE p.ns = l.ns AND p.key = l.key AND p.expires_ms > ?3)
ORDER BY 1, 2, 4
"""

# Row fence.advance (fence.stale: nothing returned, the caller reads the gate)
_FENCE_ADVANCE = """
INSERT INTO fences (ns, resource, highest) VALUES (?1, ?2, ?3)
ON CONFLICT (ns, resource) DO UPDATE SET highest = excluded.highest
WHERE excluded.highest >= fences.highest
RETURNING highest
"""
_FENCE_GET = "SELECT highest FROM fences WHERE ns = ?1 AND resource = ?2"

# Purge, one chunk per transaction (so other writers wait for a chunk, never for the
# whole purge): raise the floor over every fence and token about to go, then delete
# those dead rows (_txn._purge). ?1 now, ?2 the chunk's size; ordered by the index and
# the primary key, the floor's claims and the deleted ones are the same in one
# transaction. A dead record whose key's steps live stays (it keeps their end).
_DEAD_CLAIMS = (
    "SELECT ns, key, fence FROM claims WHERE expires_ms <= ?1 AND steps_ms <= ?1 "
    "ORDER BY expires_ms, ns, key LIMIT ?2"
)
_PURGE_FLOOR = f"""
UPDATE meta SET value = max(value, coalesce((SELECT max(fence) FROM ({_DEAD_CLAIMS})), 0))
WHERE name = 'floor'
"""
_PURGE_CLAIMS = f"DELETE FROM claims WHERE (ns, key) IN (SELECT ns, key FROM ({_DEAD_CLAIMS}))"
# Steps over: past their until_ms and their key's steps_ms (not counted: they are part
# of a claim key's record).
_PURGE_STEPS = """
DELETE FROM claim_steps WHERE (ns, key, name) IN (
    SELECT ns, key, name FROM claim_steps AS s WHERE until_ms <= ?1
      AND NOT EXISTS (SELECT 1 FROM claims AS c
                      WHERE c.ns = s.ns AND c.key = s.key AND c.steps_ms > ?1)
    LIMIT ?2)
"""
# Dead lock keys (summary over: no live permit), read by _txn._purge, which raises the
# floor over their tokens (_FLOOR_RAISE) before deleting them.
_DEAD_LOCKS = "SELECT ns, key, token FROM locks WHERE expires_ms <= ?1 LIMIT ?2"
_FLOOR_RAISE = "UPDATE meta SET value = max(value, ?1) WHERE name = 'floor'"
# Then per dead key (its summary over, so every permit of it too): its permits, then
# its summary (the trigger's update of it is deleted with it).
_PURGE_KEY_PERMITS = "DELETE FROM lock_permits WHERE ns = ?1 AND key = ?2 AND expires_ms <= ?3"
_PURGE_KEY = "DELETE FROM locks WHERE ns = ?1 AND key = ?2"
# Then expired permits of keys still held by others (the summary keeps the counter).
_PURGE_PERMITS = """
DELETE FROM lock_permits WHERE (ns, key, owner) IN (
    SELECT ns, key, owner FROM lock_permits WHERE expires_ms <= ?1 LIMIT ?2)
"""
# What a purge would delete (its dry run): dead claims, expired permits, and dead keys
# without a permit (released ones), each counted once.
_PURGE_COUNT = """
SELECT (SELECT count(*) FROM claims WHERE expires_ms <= ?1 AND steps_ms <= ?1)
     + (SELECT count(*) FROM lock_permits WHERE expires_ms <= ?1)
     + (SELECT count(*) FROM locks AS l WHERE expires_ms <= ?1
        AND NOT EXISTS (SELECT 1 FROM lock_permits AS p
                        WHERE p.ns = l.ns AND p.key = l.key AND p.expires_ms <= ?1))
"""

_STATES = ("in_flight", "completed")

# SQLite result codes (sqlite3.SQLITE_* exist from Python 3.11 only).
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26
