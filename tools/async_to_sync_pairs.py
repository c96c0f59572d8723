"""The modules ``tools/async_to_sync.py`` generates, and the names and phrases it maps.

To generate one more module, add a line to ``PAIRS``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Pair:
    source: str
    target: str
    #: names mapped for this pair only, on top of RENAMES
    renames: dict[str, str] = field(default_factory=dict)
    #: the target's module docstring, when the source's (mapped) would not fit it
    docstring: str | None = None
    #: phrases replaced in this pair's docstrings and comments, before DOC_PHRASES
    phrases: list[tuple[str, str]] = field(default_factory=list)


#: Every generated module: add a line here to generate one more.
PAIRS: list[Pair] = [
    Pair(
        "src/idemlock/aio.py",
        "src/idemlock/_sync.py",
        {
            "_tasks": "_threads",
            "AsyncWatchdog": "Watchdog",
            "AsyncRenewer": "Renewer",
            "run_async": "run_sync",
            "AsyncStore": "SyncStore",
            "AsyncCoordinator": "Coordinator",
            "AsyncIdempotencyPort": "IdempotencyPort",
            "AsyncLockPort": "LockPort",
            "AsyncSemaphorePort": "SemaphorePort",
            "AsyncElectionPort": "ElectionPort",
            "AsyncTerm": "Term",
            "AsyncFenceGate": "FenceGate",
        },
        docstring="The blocking API: :class:`Coordinator` and its ports.",
        phrases=[
            ("the asyncio API", "the blocking API"),
            ("Open an :class:`AsyncCoordinator`", "Open a :class:`Coordinator`"),
            (":func:`idemlock.aio.connect`", ":func:`idemlock.connect`"),
            (
                "Works on\n        ``async def`` functions.",
                "Works on\n        plain and ``async def`` functions.",
            ),
        ],
    ),
    Pair(
        "src/idemlock/_drive.py",
        "src/idemlock/_drive_sync.py",
        {"AsyncStore": "SyncStore", "run_async": "run_sync"},
        docstring="""The blocking driver of :mod:`idemlock._core.flows`, :func:`run_sync`, generated
from :func:`idemlock._drive.run_async` (which imports it back, so both come from one place).""",
    ),
    Pair(
        "src/idemlock/compat/_ports_async.py",
        "src/idemlock/compat/_ports_sync.py",
        {
            "aio": "_sync",
            "_async_coord": "_sync_coord",
            "AsyncCoordinator": "Coordinator",
            "AsyncLockPort": "LockPort",
            "AsyncIdempotencyPort": "IdempotencyPort",
            "AsyncDistributedLockCommandPort": "DistributedLockCommandPort",
            "AsyncDistributedLockQueryPort": "DistributedLockQueryPort",
            "AsyncDistributedLockScope": "DistributedLockScope",
            "AsyncBackend": "Backend",
        },
    ),
    Pair(
        "src/idemlock/stores/redis/_async.py",
        "src/idemlock/stores/redis/_sync.py",
        {
            "AsyncRedisStore": "RedisStore",
            "AsyncPlumbing": "SyncPlumbing",
            "_plumbing_async": "_plumbing_sync",
        },
    ),
    Pair(
        "src/idemlock/stores/postgres/_async.py",
        "src/idemlock/stores/postgres/_sync.py",
        {
            "_AsyncRunner": "_SyncRunner",
            "_runner_async": "_runner_sync",
            "AsyncRawCursor": "RawCursor",
            "_schema_async": "_schema_sync",
            "aensure": "ensure",
            "_adirect_connect": "_direct_connect",
        },
        docstring="""The sync PostgreSQL store, :class:`PostgresStore`: the statements it runs and
how it reads their replies, as in :mod:`._async`, its source. What differs from the
async store is hand-written in :mod:`._runner_sync`.
""",
    ),
    Pair(
        "src/idemlock/stores/postgres/_schema_async.py",
        "src/idemlock/stores/postgres/_schema_sync.py",
        {
            "_aversion": "_version",
            "amigrate_conn": "migrate_conn",
            "aensure": "ensure",
            "amigrate": "migrate",
            "_amigrate_refused": "_migrate_refused",
        },
        docstring="Creating and upgrading the store's schema, blocking (see :mod:`._schema`).",
    ),
    Pair(
        "src/idemlock/stores/etcd/_calls_async.py",
        "src/idemlock/stores/etcd/_calls_sync.py",
        {"AsyncCalls": "SyncCalls", "_grpc_aio": "_grpc_sync"},
        docstring="""How the blocking etcd client calls, as in :mod:`._calls_async`, its source:
:func:`drive` runs an op of :mod:`._ops` to its end, and :class:`SyncCalls` makes each
of its calls within the store's deadline, authenticated, failing over to another
member when one does not answer.""",
    ),
    Pair(
        "src/idemlock/stores/postgres/_fenced_async.py",
        "src/idemlock/stores/postgres/_fenced_sync.py",
        {
            "afenced_update": "fenced_update",
            "afenced_upsert": "fenced_upsert",
            "sa_afenced_update": "sa_fenced_update",
            "sa_afenced_upsert": "sa_fenced_upsert",
            "acomplete_in_transaction": "complete_in_transaction",
            "arecord_step_in_transaction": "record_step_in_transaction",
            "_arun": "_run",
            "AsyncRawCursor": "RawCursor",
        },
        docstring="""The fenced helpers that run statements, on a ``psycopg.Connection`` (and a
SQLAlchemy ``Connection``), generated from :mod:`._fenced_async`; what both share is in
:mod:`._fenced_sql`, and the public face is :mod:`idemlock.stores.postgres.fenced`.
""",
        phrases=[("``sqlalchemy.ext.asyncio.AsyncConnection``", "``sqlalchemy.Connection``")],
    ),
    Pair(
        "src/idemlock/stores/etcd/_async.py",
        "src/idemlock/stores/etcd/_sync.py",
        {
            "_AsyncRunner": "_SyncRunner",
            "_grpc_aio": "_grpc_sync",
            "AsyncEtcdStore": "EtcdStore",
        },
        docstring="""The blocking etcd store, :class:`EtcdStore`: each port method runs one op of
:mod:`._ops`, as in :mod:`._async`, its source. What differs from the async store is
hand-written in :mod:`._grpc_sync`.""",
    ),
]

#: Names mapped everywhere (a dotted key maps an attribute chain as a whole).
RENAMES: dict[str, str] = {
    "__aenter__": "__enter__",
    "__aexit__": "__exit__",
    "__aiter__": "__iter__",
    "__anext__": "__next__",
    "aclose": "close",
    "StopAsyncIteration": "StopIteration",
    "AsyncIterator": "Iterator",
    "AsyncIterable": "Iterable",
    "AsyncGenerator": "Generator",
    "AbstractAsyncContextManager": "AbstractContextManager",
    "asynccontextmanager": "contextmanager",
    "AsyncExitStack": "ExitStack",
    "asyncio.sleep": "time.sleep",
    "asyncio.Lock": "threading.Lock",
    "asyncio.Event": "threading.Event",
    "AsyncConnection": "Connection",
    "AsyncCursor": "Cursor",
    "AsyncConnectionPool": "ConnectionPool",
    "AsyncNullConnectionPool": "NullConnectionPool",
    "AsyncPostgresStore": "PostgresStore",
    "AsyncListenSubscription": "ListenSubscription",
    "AsyncSubscription": "Subscription",
    "AsyncStore": "Store",
}

#: Phrases replaced in docstrings and comments (after the word mapping).
DOC_PHRASES: list[tuple[str, str]] = [
    ("``await ", "``"),
    ("``async with ", "``with "),
    ("``async for ", "``for "),
    ("an async ", "a "),
    ("An async ", "A "),
]
