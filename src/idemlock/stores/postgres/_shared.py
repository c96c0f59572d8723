"""What the sync and async PostgreSQL stores share: settings, error messages, the
pool's health, fork safety (a pid check), and :class:`_Base`, the half of a store that
runs no statement itself."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import psycopg
import psycopg_pool
from psycopg.conninfo import conninfo_to_dict
from psycopg.pq import TransactionStatus
from psycopg.types.numeric import Int8

from ... import _forks, _urls
from ..._core.port import Capabilities, Held
from ..._errors import ConfigurationError, StoreUnavailable
from . import _watchdog
from ._listen import Listener
from ._pool import CancellableAsyncPool
from ._replies import _i8
from ._schema import DEFAULT_SCHEMA as DEFAULT_SCHEMA
from ._schema import migrate_command
from ._sql import Statements

log = logging.getLogger("idemlock")

#: rows deleted per purge statement
PURGE_BATCH = 5000
#: seconds a store keeps its lane connection before handing it back to its pool
LANE_SECONDS = 60.0
#: re-runs of a claim/acquire/fence statement that raced a concurrent commit (see _RETRY)
MAX_RACE_RETRIES = 100
#: ms a released lock stays reserved for the oldest waiting process (state reserved);
#: a chosen process that died or left costs the others this once
HANDOFF_MS = 50
#: ms a refused attempt keeps its process registered as a waiter: longer than the
#: longest wait between re-checks (flows.MAX_WAIT_CHUNK, 1 s), so a live waiter never
#: lapses, and a crashed one lapses soon
REGISTER_MS = 1500
_REGISTER_MS8 = Int8(REGISTER_MS)
_HANDOFF_MS8 = Int8(HANDOFF_MS)


_SCHEMA_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")


#: seconds one call may take, connection wait included (A1)
DEFAULT_TIMEOUT = 5.0


def _secrets_of(conninfo: Any) -> list[str]:
    """The secret values a conninfo string holds (userinfo password, ``?password=``),
    to mask them in messages; the shared helper lives in idemlock._urls."""
    find = getattr(_urls, "secrets_in", None)
    if not isinstance(conninfo, str) or find is None:
        return []
    found: list[str] = find(conninfo)
    return found


def _wait(deadline: float) -> float:
    """Seconds left to wait for a pooled connection (psycopg_pool needs > 0)."""
    return max(0.001, deadline - time.monotonic())


def clone_pool(pool: Any, health: Health) -> Any:
    """A new, unopened pool with the settings of ``pool`` (a forked child cannot use
    the parent's: its connections are shared with the parent and its threads are
    gone). Its connection attempts are recorded in ``health``."""
    cls = (
        CancellableAsyncPool
        if isinstance(pool, psycopg_pool.AsyncConnectionPool)
        else psycopg_pool.ConnectionPool
    )
    options: dict[str, Any] = {}
    for name in ("configure", "reset"):
        value = getattr(pool, "_" + name, None)
        if value is not None:
            options[name] = value
    return cls(
        pool.conninfo,
        kwargs=pool.kwargs,
        min_size=pool.min_size,
        max_size=pool.max_size,
        timeout=pool.timeout,
        max_idle=pool.max_idle,
        max_lifetime=pool.max_lifetime,
        reconnect_timeout=pool.reconnect_timeout,
        connection_class=recording_class(pool.connection_class, health),
        name=pool.name,
        open=False,
        **options,
    )


def check_schema(schema: object) -> str:
    if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
        raise ConfigurationError(
            f"schema must be a plain PostgreSQL identifier (letters, digits, underscores, "
            f"at most 63 characters, not starting with a digit), got {schema!r}"
        )
    return schema


def unavailable(exc: BaseException, what: str, schema: str = DEFAULT_SCHEMA) -> StoreUnavailable:
    """A driver error as StoreUnavailable (the caller chains the cause); ``schema`` is
    the store's, named in the command that creates missing tables."""
    if isinstance(exc, psycopg_pool.PoolTimeout):
        msg = f"no PostgreSQL connection became free in time for {what}: {exc}"
    elif isinstance(exc, psycopg.errors.UndefinedTable):
        msg = (
            f"the idemlock tables are missing ({exc}); run {migrate_command(schema)} "
            "or let the store create them (auto_migrate=True)"
        )
    elif startup_refused(exc):
        msg = (
            f"PostgreSQL failed during {what}: {type(exc).__name__}: {str(exc).strip()}. "
            "A connection pooler (PgBouncer...) refused a startup parameter given in the "
            "URL: take it off the URL (set it per statement or per transaction instead), or "
            "add it to the pooler's ignore_startup_parameters"
        )
    else:
        msg = f"PostgreSQL failed during {what}: {type(exc).__name__}: {exc}"
    return StoreUnavailable(msg.strip())


def _resolve(value: Any) -> Any:
    """A pool setting that may be a value, a function or an async function (psycopg_pool
    allows all three for conninfo and kwargs). Runs in the listener's thread, which has
    no event loop of its own."""
    if callable(value):
        value = value()
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
    return value


async def _awaited(aw: Any) -> Any:
    return await aw


def _lane_spent(conn: Any, since: float) -> bool:
    """Whether the lane connection must go back to the pool now."""
    return bool(
        conn.closed
        or getattr(conn, "broken", False)
        # pgconn's own status: conn.info would build a ConnectionInfo on every call.
        or conn.pgconn.transaction_status != TransactionStatus.IDLE
        or time.monotonic() - since > LANE_SECONDS
    )


class LaneFlag:
    """The async store's guard of its lane, with the face of ``threading.Lock`` (which
    guards the sync store's): on one event loop a flag tested and set with no await in
    between is enough."""

    __slots__ = ("busy",)

    def __init__(self) -> None:
        self.busy = False

    def acquire(self, blocking: bool = True) -> bool:
        if self.busy:
            return False
        self.busy = True
        return True

    def release(self) -> None:
        self.busy = False


def _is_disconnect(exc: BaseException, conn: Any) -> bool:
    """Whether a statement failed because its pooled connection was dead (None: no
    connection was borrowed, e.g. a pool timeout, which a retry would not help)."""
    return (
        isinstance(exc, psycopg.OperationalError)
        and conn is not None
        and (conn.closed or bool(getattr(conn, "broken", False)))
    )


class Health:
    """What the pool's own connection attempts found: the last failure (None once one
    succeeds). Calls read it to name the cause of an outage at once instead of
    waiting for a connection that is not coming (issue 10 item 19).

    ``pooled``: whether the URL leads to a transaction-pooling connection pooler
    (PgBouncer...) rather than straight to PostgreSQL (None: not known yet). Found out
    by the first connection: a pooler refuses the ``options`` startup parameter, or
    reports a backend pid that is not the server's (see :func:`pooler_seen`). Then the
    store's connections are opened without ``options``, statements are not prepared and
    ``statement_timeout`` is set per statement (see ``_fetch``)."""

    __slots__ = ("down", "pooled")

    def __init__(self) -> None:
        self.down: BaseException | None = None
        self.pooled: bool | None = None


#: URLs (conninfo strings) this process found to lead to a pooler
_POOLED_URLS: set[str] = set()
#: what a connection pooler answers to a startup parameter it does not pass on
_REFUSED_STARTUP = "unsupported startup parameter"
_OWN_TIMEOUT = re.compile(r"\s*-c statement_timeout=\d+")


def startup_refused(exc: BaseException) -> bool:
    """Whether ``exc`` is a pooler refusing a startup parameter (PgBouncer < 1.20 says
    ``unsupported startup parameter: options`` to the statement_timeout the store sends)."""
    return isinstance(exc, psycopg.OperationalError) and _REFUSED_STARTUP in str(exc)


def for_pooler(kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """``kwargs`` of a connection the store makes, without the ``options`` the store
    added (``-c statement_timeout=...``) and without prepared statements; None if the
    store added no options (the refusal is then about the user's own settings)."""
    options = kwargs.get("options")
    if not isinstance(options, str) or not _OWN_TIMEOUT.search(options):
        return None
    out = {k: v for k, v in kwargs.items() if k != "options"}
    out["prepare_threshold"] = None
    return out


def _pooled_kwargs(kwargs: dict[str, Any], health: Health) -> dict[str, Any]:
    if health.pooled:
        return for_pooler(kwargs) or kwargs
    return kwargs


def recording_class(base: type[Any], health: Health) -> type[Any]:
    """A connection class for psycopg_pool that records each connection attempt's
    outcome in ``health`` (the pool only logs its failures)."""
    if issubclass(base, psycopg.AsyncConnection):

        class _AsyncRecording(base):  # type: ignore[misc]
            @classmethod
            async def connect(cls, *args: Any, **kwargs: Any) -> Any:
                try:
                    try:
                        conn = await super().connect(*args, **_pooled_kwargs(kwargs, health))
                    except psycopg.OperationalError as exc:
                        bare = for_pooler(kwargs) if startup_refused(exc) else None
                        if bare is None:
                            raise
                        health.pooled = True  # a pooler: connect as it accepts
                        conn = await super().connect(*args, **bare)
                except BaseException as exc:
                    health.down = exc
                    raise
                health.down = None
                return conn

        return _AsyncRecording

    class _Recording(base):  # type: ignore[misc]
        @classmethod
        def connect(cls, *args: Any, **kwargs: Any) -> Any:
            try:
                try:
                    conn = super().connect(*args, **_pooled_kwargs(kwargs, health))
                except psycopg.OperationalError as exc:
                    bare = for_pooler(kwargs) if startup_refused(exc) else None
                    if bare is None:
                        raise
                    health.pooled = True  # a pooler: connect as it accepts
                    conn = super().connect(*args, **bare)
            except BaseException as exc:
                health.down = exc
                raise
            health.down = None
            return conn

    return _Recording


#: the set-up's query that tells a pooler from the server (see :func:`pooler_seen`)
SERVER_PID = "SELECT pg_backend_pid()"


def pooler_seen(conn: Any, server_pid: int) -> bool:
    """Whether ``conn`` reaches PostgreSQL through a pooler or proxy: the backend pid
    the connection was given at start (BackendKeyData) is not the pid of the server
    process that runs its statements. PgBouncer, and proxies generally, make up their
    own: they cannot hand out a server's cancel key for a client they may move to
    another server connection."""
    return int(conn.info.backend_pid) != int(server_pid)


def connect_kwargs(conninfo: Any, kwargs: Any, timeout: float) -> dict[str, Any]:
    """Connection settings for a connection the store opens itself (schema check,
    notifications, probes): the pool's, with a connect timeout unless one is set."""
    kw = {k: v for k, v in (kwargs or {}).items() if k not in ("autocommit", "row_factory")}
    if "connect_timeout" not in kw and "connect_timeout" not in conninfo_to_dict(conninfo):
        # libpq waits forever by default; psycopg's floor is 2 s.
        kw["connect_timeout"] = max(2, math.ceil(timeout))
    return kw


async def _aresolve(value: Any) -> Any:
    if callable(value):
        value = value()
        if inspect.isawaitable(value):
            value = await value
    return value


P = TypeVar("P")


class _Base(Generic[P]):
    """The half of a store that runs no statement itself; ``P`` is its pool's type."""

    kind = "postgres"
    #: LISTEN/NOTIFY wakes waiters in every process
    capabilities = Capabilities(handoff=True, renew_many=True, steps=True)
    #: the batched renewal statement, rendered on first use (``_replies._renew_many``)
    _renew_many_stmt: Any = None

    def __init__(
        self,
        pool: P,
        *,
        schema: str = DEFAULT_SCHEMA,
        prepare: bool = True,
        auto_migrate: bool = True,
        owns_pool: bool = False,
        timeout: float = DEFAULT_TIMEOUT,
        pool_factory: Callable[[], P] | None = None,
        health: Health | None = None,
        listen: tuple[str, dict[str, Any]] | None = None,
    ) -> None:
        health = health or Health()
        conninfo: Any = getattr(pool, "conninfo", None)
        if isinstance(conninfo, str) and conninfo in _POOLED_URLS:
            # Another store of this process found a pooler there: no refused attempt.
            health.pooled = True
        #: (conninfo, connection settings) of the connection that takes notifications,
        #: when it is not the pool's (``listen_url``: straight to PostgreSQL)
        self._listen = listen
        self.pool = pool
        self.schema = check_schema(schema)
        self.statements = Statements.for_schema(self.schema)
        #: the bound on one call, in seconds (A1)
        self.timeout = float(timeout)
        self._prepare = prepare
        self._auto_migrate = auto_migrate
        self._owns_pool = owns_pool
        self._ready = False
        self._conninfo = conninfo
        self._secrets = _secrets_of(conninfo)
        if listen is not None:
            self._secrets = sorted({*self._secrets, *_secrets_of(listen[0])}, key=len)[::-1]
        self._conn_kwargs = getattr(pool, "kwargs", None)
        #: whether calls go through a transaction pooler (set up by the first call)
        self._pooled = False
        self._prepare_now = prepare
        self._local_timeout = (
            f"SELECT set_config('statement_timeout', '{int(self.timeout * 1000)}', true)"
        )
        # Builds a fresh pool of the same settings: a forked child uses it (A6).
        self._pool_factory: Callable[[], P] = pool_factory or (lambda: clone_pool(pool, health))
        self._health = health
        self.listener = self._new_listener()
        #: the store's own connection for one call at a time (see _take)
        self._lane: Any = None
        self._lane_since = 0.0
        #: the process the pool, the listener and the lane are of (see ``_forked``)
        self._pid = os.getpid()
        self._reset_runner()

    def _reset_runner(self) -> None:
        """Set up (and, in a forked child, start afresh) what the runner keeps."""
        raise NotImplementedError

    def _new_listener(self) -> Listener:
        return Listener(
            self._listen_connect,
            self.timeout,
            self.statements.unregister,
            HANDOFF_MS / 1000,
            probe=self._send_probe,
            secrets=self._secrets,
        )

    def _set_pooled(self, conn: Any, server_pid: int) -> None:
        """After the set-up's first statement: whether calls go through a pooler."""
        pooled = bool(self._health.pooled) or pooler_seen(conn, server_pid)
        self._health.pooled = pooled
        if pooled and isinstance(self._conninfo, str):
            _POOLED_URLS.add(self._conninfo)
        self._pooled = pooled
        self._prepare_now = self._prepare and not pooled

    def _listen_connect(self) -> psycopg.Connection[Any]:
        """The connection that takes notifications: ``listen_url``'s, else the pool's."""
        if self._listen is None:
            return self._direct_connect()
        info, kwargs = self._listen
        return psycopg.connect(info, autocommit=True, prepare_threshold=None, **kwargs)

    def _send_probe(self, channel: str) -> None:
        """NOTIFY ``channel`` the way the store's own statements do (through the pool's
        URL): the listener checks that it hears it."""
        with self._direct_connect() as conn:
            armed = _watchdog.WATCHDOG.arm(conn, time.monotonic() + self.timeout)
            try:
                conn.execute("SELECT pg_notify(%s, 'probe')", [channel])
            finally:
                _watchdog.WATCHDOG.disarm(armed)

    def _direct_kwargs(self, info: Any, kwargs: Any) -> dict[str, Any]:
        kw = connect_kwargs(info, kwargs, self.timeout)
        kw = _pooled_kwargs(kw, self._health)
        kw["prepare_threshold"] = None  # one-off connections; safe behind a pooler
        return kw

    def _direct_connect(self, connect_timeout: int | None = None) -> psycopg.Connection[Any]:
        """A connection of its own, on the pool's settings (which may be computed per
        connection). Runs in threads without an event loop."""
        info = _resolve(self._conninfo)
        kwargs = self._direct_kwargs(info, _resolve(self._conn_kwargs))
        if connect_timeout is not None:
            kwargs["connect_timeout"] = connect_timeout
        try:
            return psycopg.connect(info, autocommit=True, **kwargs)
        except psycopg.OperationalError as exc:
            bare = for_pooler(kwargs) if startup_refused(exc) else None
            if bare is None:
                raise
            self._health.pooled = True
            return psycopg.connect(info, autocommit=True, **bare)

    async def _adirect_connect(self) -> psycopg.AsyncConnection[Any]:
        info = await _aresolve(self._conninfo)
        kwargs = self._direct_kwargs(info, await _aresolve(self._conn_kwargs))
        try:
            return await psycopg.AsyncConnection.connect(info, autocommit=True, **kwargs)
        except psycopg.OperationalError as exc:
            bare = for_pooler(kwargs) if startup_refused(exc) else None
            if bare is None:
                raise
            self._health.pooled = True
            return await psycopg.AsyncConnection.connect(info, autocommit=True, **bare)

    def _scrub(self, err: StoreUnavailable) -> StoreUnavailable:
        """No secret of the URL (a ``?password=``...) leaves in a message (item 17)."""
        msg = str(err)
        for secret in self._secrets:
            msg = msg.replace(secret, "***")
        return err if msg == str(err) else StoreUnavailable(msg)

    def _unavailable(self, exc: BaseException, what: str) -> StoreUnavailable:
        return self._scrub(unavailable(exc, what, self.schema))

    def _timed_out(self, what: str) -> StoreUnavailable:
        return StoreUnavailable(
            f"PostgreSQL did not answer {what} within timeout={self.timeout:g}s (the server "
            "or the network is stuck or silent); the connection was dropped. The call may or "
            "may not have been applied; retrying it is safe"
        )

    def _pool_timeout(self, exc: BaseException, what: str) -> StoreUnavailable:
        down = self._health.down
        if down is not None:
            return self._scrub(
                StoreUnavailable(
                    f"cannot connect to PostgreSQL for {what}: {type(down).__name__}: "
                    f"{str(down).strip()}"
                )
            )
        return StoreUnavailable(
            f"no PostgreSQL connection became free within timeout={self.timeout:g}s for "
            f"{what} (every pooled connection was busy: raise max_size or timeout): {exc}"
        )

    def _forked(self) -> None:
        """In a forked child (the pid check of every call): keep the inherited pool,
        listener and lane from being used, closed or collected (closing would end the
        parent's sessions), and start afresh on a pool of the same settings."""
        with _forks.LOCK:
            if self._pid == os.getpid():
                return
            _forks.INHERITED.append((self.pool, self.listener, self._lane))
            self.pool = self._pool_factory()
            self._owns_pool = True
            self._ready = False
            self._health.down = None
            self.listener = self._new_listener()
            self._lane = None
            self._reset_runner()
            self._pid = os.getpid()

    def _chan(self, kind: str, ns: str, key: str) -> str:
        # An election's observer listens where the lock's waiters do, subscribed as an
        # observer (see subscribe): a published value's '!' wakes it alone.
        return self.statements.channel("lock" if kind == "leader" else kind, ns, key)

    def _acquire_params(
        self, ns: str, key: str, owner: str, ttl_ms: int, limit: int, value: bytes | None
    ) -> dict[str, Any]:
        if self._pid != os.getpid():
            self._forked()
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise ConfigurationError(
                f"a lock or semaphore limit must be an int of at least 1, got {limit!r}"
            )
        chan = self._chan("lock", ns, key)
        # Any caller of a process may take a window kept for the process (its gid); one
        # of a process that waits on the key now also queues the process ("wait").
        me = self.listener.waiter_id(chan)
        return {
            "ns": ns,
            "key": key,
            "owner": owner,
            "ttl": _i8(ttl_ms),
            "limit": _i8(limit),
            "value": None if value is None else bytes(value),
            "gid": me[0].decode() if me is not None else "",
            "wait": me is not None and me[1],
            "chan": chan,
            "reg": _REGISTER_MS8,
        }

    def _registered(self, params: dict[str, Any], reply: Any) -> None:
        """After an acquire that passed the process's waiter id: whether the store holds
        it queued now (refused) or not (taken), so that the registration is dropped
        when the process's last waiter leaves."""
        if params["wait"]:
            g = self.listener.waiting(params["chan"])
            if g is not None:
                g.registered = isinstance(reply, Held)

    def _complete_params(
        self, ns: str, key: str, token: str, result: bytes, ttl_ms: int
    ) -> dict[str, Any]:
        return {
            "ns": ns,
            "key": key,
            "token": token,
            "result": bytes(result),
            "ttl": _i8(ttl_ms),
            "chan": self._chan("claim", ns, key),
        }

    @staticmethod
    def _step_params(
        ns: str,
        key: str,
        token: str,
        name: str,
        result: bytes | None,
        lease_ms: int,
        ttl_ms: int,
    ) -> dict[str, Any]:
        return {
            "ns": ns,
            "key": key,
            "token": token,
            "name": name,
            "result": None if result is None else bytes(result),
            "lease": _i8(lease_ms),
            "ttl": _i8(ttl_ms),
        }
