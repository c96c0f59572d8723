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
    "CREATE INDEX IF NOT EXISTS locks_expires ON locks (expires_ms)",
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
RETURNING fence
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
# (completed, same token, same result, ttl running) matches and changes nothing.
_COMPLETE = """
UPDATE claims SET state = 'completed', result = ?1,
    expires_ms = CASE WHEN state = 'in_flight' THEN ?2 ELSE expires_ms END
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
# Rows forget.live (one row changed), forget.dead (none)
_FORGET = """
UPDATE claims SET expires_ms = 0, result = NULL
WHERE ns = ?1 AND key = ?2 AND expires_ms > ?3
"""
_RECORD_GET = """
SELECT state, fence, expires_ms FROM claims WHERE ns = ?1 AND key = ?2 AND expires_ms > ?3
"""
# substr() rather than LIKE: namespaces contain '%' (the escape of keys.namespace).
_RECORDS = """
SELECT ns, key, state, fence, expires_ms FROM claims
WHERE substr(ns, 1, ?1) = ?2 AND expires_ms > ?3 ORDER BY ns, key
"""

# Rows lock.acquire, lock.reacquire (lock.busy: nothing returned). Free or expired ->
# next token of the key; held by the same owner -> same token, new
# expiry. Released locks stay as tombstones (expires_ms = 0) that keep their token.
_ACQUIRE_UPSERT = """
INSERT INTO locks (ns, key, owner, token, expires_ms)
VALUES (?1, ?2, ?3, (SELECT value FROM meta WHERE name = 'floor') + 1, ?4)
ON CONFLICT (ns, key) DO UPDATE SET
    token = CASE WHEN locks.expires_ms > ?5 THEN locks.token ELSE locks.token + 1 END,
    owner = excluded.owner, expires_ms = excluded.expires_ms
"""
_ACQUIRE = (
    _ACQUIRE_UPSERT
    + """WHERE locks.expires_ms <= ?5 OR locks.owner = excluded.owner
RETURNING token
"""
)
# The same, in one statement for the common case: it takes a free lock only while
# nobody is queued for it (else _store._acquire_queued decides, rows lock.handoff*).
_ACQUIRE_UNQUEUED = (
    _ACQUIRE_UPSERT
    + """WHERE (locks.expires_ms > ?5 AND locks.owner = excluded.owner)
   OR (locks.expires_ms <= ?5
       AND NOT EXISTS (SELECT 1 FROM lock_waiters WHERE ns = ?1 AND key = ?2))
RETURNING token
"""
)
_LOCK_GET = "SELECT owner, token, expires_ms FROM locks WHERE ns = ?1 AND key = ?2"

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
_WAITER_CHOOSE = "UPDATE lock_waiters SET window_ms = ?4 WHERE ns = ?1 AND key = ?2 AND owner = ?3"
_WAITERS_UNCHOOSE = "UPDATE lock_waiters SET window_ms = 0 WHERE ns = ?1 AND key = ?2"
_PURGE_WAITERS = "DELETE FROM lock_waiters WHERE until_ms <= ?1 AND window_ms <= ?1"
_LOCK_LIVE = (
    "SELECT owner, token, expires_ms FROM locks WHERE ns = ?1 AND key = ?2 AND expires_ms > ?3"
)
# Row lock.release (lock.release.stale: no row changed)
_RELEASE = """
UPDATE locks SET expires_ms = 0
WHERE ns = ?1 AND key = ?2 AND owner = ?3 AND token = ?4 AND expires_ms > ?5
"""
# Row lock.renew (lock.renew.stale: no row changed)
_RENEW = """
UPDATE locks SET expires_ms = ?1
WHERE ns = ?2 AND key = ?3 AND owner = ?4 AND token = ?5 AND expires_ms > ?6
"""
# State table row lock.break: held by anyone -> free. The tombstone keeps the token, so
# the next acquire counts on from it and the old holder's (owner, token) matches nothing.
_BREAK = """
UPDATE locks SET expires_ms = 0
WHERE ns = ?1 AND key = ?2 AND expires_ms > ?3
"""
_LOCKS = """
SELECT ns, key, owner, token, expires_ms FROM locks
WHERE substr(ns, 1, ?1) = ?2 AND expires_ms > ?3 ORDER BY ns, key
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
# those dead rows. ?1 now, ?2 the chunk's size; ordered by the index and the primary
# key, the floor's rows and the deleted ones are the same in one transaction.
_DEAD_CLAIMS = (
    "SELECT ns, key, fence FROM claims WHERE expires_ms <= ?1 ORDER BY expires_ms, ns, key LIMIT ?2"
)
_DEAD_LOCKS = (
    "SELECT ns, key, token FROM locks WHERE expires_ms <= ?1 ORDER BY expires_ms, ns, key LIMIT ?2"
)
_PURGE_FLOOR = f"""
UPDATE meta SET value = max(
    value,
    coalesce((SELECT max(fence) FROM ({_DEAD_CLAIMS})), 0),
    coalesce((SELECT max(token) FROM ({_DEAD_LOCKS})), 0)
) WHERE name = 'floor'
"""
_PURGE_CLAIMS = f"DELETE FROM claims WHERE (ns, key) IN (SELECT ns, key FROM ({_DEAD_CLAIMS}))"
_PURGE_LOCKS = f"DELETE FROM locks WHERE (ns, key) IN (SELECT ns, key FROM ({_DEAD_LOCKS}))"
# What _PURGE_CLAIMS and _PURGE_LOCKS would delete (purge's dry run).
_PURGE_COUNT = """
SELECT (SELECT count(*) FROM claims WHERE expires_ms <= ?1)
     + (SELECT count(*) FROM locks WHERE expires_ms <= ?1)
"""

_STATES = ("in_flight", "completed")

# SQLite result codes (sqlite3.SQLITE_* exist from Python 3.11 only).
_SQLITE_CORRUPT = 11
_SQLITE_NOTADB = 26
