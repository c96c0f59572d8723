"""The embedded store: one SQLite file, shared by every thread and process on one machine.

URL: ``sqlite:///relative/path.db`` (relative to the working directory) or
``sqlite:////absolute/path.db``, in a directory that exists (a missing one raises
:class:`~idemlock.ConfigurationError`; only the default file's, in the user's state
directory, is created on first use). Options,
as keywords or in the URL (``?timeout=2.5``): ``timeout`` (seconds, default 5), the
bound on one call, and ``busy_timeout`` (default: ``timeout``), how long a call waits
for another writer before raising :class:`~idemlock.StoreUnavailable`.

How it works:

* The file is in WAL mode with ``synchronous=NORMAL`` (a power cut may lose the last
  transactions, never corrupt the file). Put it on a local disk: WAL needs shared
  memory, which network file systems do not provide.
* Every port method is one transaction, so a call either happens whole or not at all;
  a failed call is rolled back before :class:`~idemlock.StoreUnavailable` is raised.
  A transition of one statement (claim and acquire when nothing is in the way,
  complete, release, ...) runs as a transaction of its own, which takes the write lock
  as ``BEGIN IMMEDIATE`` would; the others run inside ``BEGIN IMMEDIATE``.
* Fences and lock tokens count per key: a freed key keeps its row as a tombstone with
  its last fence, and ``purge()`` raises a floor above every fence it deletes before a
  new row starts from it, so they strictly increase per key for the life of the file.
  (Tokens of different keys are not comparable.)
* **Expiry is judged by this machine's wall clock** (``time.time()``), which every
  process using the file shares: keep the file on one machine, and keep the clock from
  stepping back by more than your leases (NTP slewing is fine).
* Waiters in this process are woken at once when a key is freed; a waiter in another
  process re-checks in a short jittered backoff capped at :attr:`SQLiteStore.poll_cap`,
  and on Linux is also woken at once when a lock is reserved for it (a datagram to a
  random socket name of its process, carrying only a keyed tag of the lock, ``_wake``; a
  lost one costs only that poll).
* Locks are handed off in arrival order: a waiting caller is queued in the file (table
  ``lock_waiters``) with each refused attempt, and a free lock is reserved for the
  oldest waiter for a short window, so neither the releasing process nor a newcomer
  barges in. A process whose waiters on a key all left (got it, gave up, timed out,
  were cancelled) unqueues them at once; a registration otherwise lapses soon after its
  waiter's last attempt, at once when its process has exited. A window is never kept
  for a waiter whose registration lapsed.
* Connections are pooled (one per concurrent caller), so one store object can be
  used from many threads and from ``asyncio.to_thread``.
* Give idemlock a file of its own: its tables have plain names (``meta`` with the
  schema version, the purge floor and the wake-ups' secret, ``claims``, ``locks`` (a
  lock key's token counter and the end of its last permit), ``lock_permits`` (its
  holders: a lock is the one-permit case), ``fences``, ``lock_waiters``).

The package: ``_sql`` (schema and statements), ``_conn`` (connections and the call
of each port method), ``_store`` (the store and its transactions), ``_txn``
(transaction bodies), ``_wake`` (wake-ups across processes), ``_fork`` (fork safety),
``_url`` (URLs and options).
"""

from __future__ import annotations

from typing import Any

from ._fork import FORK_WAIT
from ._sql import (
    _ABANDON,
    _ACQUIRE_UNQUEUED,
    _CLAIM_NEW,
    _COMPLETE,
    _RELEASE,
    _SCHEMA,
    DEFAULT_BUSY_TIMEOUT,
    SCHEMA_VERSION,
)
from ._store import SQLiteAsyncStore, SQLiteStore
from ._url import parse

__all__ = ["SQLiteAsyncStore", "SQLiteStore", "open_async", "open_sync"]

# Kept importable from here: the benchmarks run the store's statements raw.
_REEXPORTED = (FORK_WAIT, DEFAULT_BUSY_TIMEOUT, SCHEMA_VERSION, _ABANDON, _ACQUIRE_UNQUEUED)
_REEXPORTED_SQL = (_CLAIM_NEW, _COMPLETE, _RELEASE, _SCHEMA)


def open_sync(url: str, **options: Any) -> tuple[SQLiteStore, None]:
    path, busy, timeout = parse(url, options)
    return SQLiteStore(path, busy_timeout=busy, timeout=timeout), None


def open_async(url: str, **options: Any) -> tuple[SQLiteAsyncStore, None]:
    path, busy, timeout = parse(url, options)
    return SQLiteAsyncStore(SQLiteStore(path, busy_timeout=busy, timeout=timeout)), None
