"""What differs between the redis-py releases the Redis store admits (``redis>=5``:
5.0 to 8.x), in one place. Each difference is found by a feature test on the class
at hand (redis-py's own, or a user's subclass), made once per class: never a version
number, never an assumed attribute. The rest of the store goes through the helpers
here.

``OPTIONAL`` names every redis-py attribute some admitted release lacks; the test
suite checks that no other module of the store touches one of them, and runs the
store with each feature both present and absent.
"""

from __future__ import annotations

import inspect
from typing import Any

import redis.asyncio
import redis.asyncio.retry
import redis.cluster
import redis.connection
import redis.retry

#: redis-py attributes that some admitted release lacks (and which releases, as checked
#: on 5.0.0, 5.0.8, 5.3.1, 6.4.0 and 8.1.0): only this module reads them, each behind a
#: feature test.
OPTIONAL = {
    # Connection.should_reconnect(): a maintenance notification asked the connection
    # to reconnect (there are no such notifications before)
    "should_reconnect": "missing up to 6.4",
    # redis.asyncio clients' aclose() (close() is the coroutine before)
    "aclose": "missing in 5.0.0",
    # Retry.get_retries(): the count is the private _retries before
    "get_retries": "missing up to 5.3 (blocking Retry), up to 6.4 (asyncio Retry)",
    "_retries": "the count before get_retries() came; read only where that is missing",
    # NodesManager.initialize(last_failed_node_name=) after a failed call:
    # initialize() without arguments before
    "last_failed_node_name": "missing up to 6.4",
    # a blocking single-connection client's lock around its one connection: before,
    # threads sharing the client interleave on the socket
    "single_connection_lock": "missing in 5.0.x",
    # CredentialProvider.get_credentials_async(): get_credentials() before
    "get_credentials_async": "missing in older releases (probed, not assumed)",
}


#: (class, method name) -> whether the class has that method: probed once per class
_PROBED: dict[tuple[type, str], bool] = {}


def provides(obj: Any, name: str) -> bool:
    """Whether ``obj``'s class (or ``obj``, a class) has the method ``name``: the
    feature test, made once per class (a user's connection or client class, or
    redis-py's own of whichever release is installed)."""
    cls = obj if isinstance(obj, type) else type(obj)
    key = (cls, name)
    found = _PROBED.get(key)
    if found is None:
        found = _PROBED[key] = callable(getattr(cls, name, None))
    return found


# What the installed redis-py's own classes have (probed at import; the helpers below
# probe the class of the object they are given, which may be a user's subclass).
#: blocking connections have should_reconnect()
SHOULD_RECONNECT = provides(redis.connection.Connection, "should_reconnect")
#: redis.asyncio clients have aclose()
ACLOSE = provides(redis.asyncio.Redis, "aclose")
#: Retry objects tell their count by get_retries(), blocking and asyncio
SYNC_GET_RETRIES = provides(redis.retry.Retry, "get_retries")
ASYNC_GET_RETRIES = provides(redis.asyncio.retry.Retry, "get_retries")


def _initialize_takes_failed_node() -> bool:
    try:
        params = inspect.signature(redis.cluster.NodesManager.initialize).parameters
    except (AttributeError, TypeError, ValueError):  # pragma: no cover - not inspectable
        return False
    return "last_failed_node_name" in params


#: whether a blocking RedisCluster re-reads its slot map after a failed call by
#: ``initialize(last_failed_node_name=...)`` (else by ``initialize()``)
FAILED_NODE_REFRESH = _initialize_takes_failed_node()


def unguarded_single_connection(client: Any) -> bool:
    """Whether ``client`` (blocking) is a single-connection client whose redis-py does
    not guard the connection against threads calling at once (5.0.x): the store then
    holds a lock of its own around each use of it."""
    if getattr(client, "connection", None) is None:
        return False
    return getattr(client, "single_connection_lock", None) is None


def should_reconnect(conn: Any) -> bool:
    """Whether redis-py asked ``conn`` (blocking) to reconnect before its next use."""
    return provides(conn, "should_reconnect") and bool(conn.should_reconnect())


async def aclose_client(client: Any) -> None:
    """Close a redis.asyncio client (standalone or Cluster) and its pool."""
    if provides(client, "aclose"):
        await client.aclose()
    else:
        await client.close()  # the coroutine before aclose() came


async def credentials(conn: Any) -> tuple[Any, ...]:
    """The AUTH arguments of a redis.asyncio connection's settings, as its own
    handshake would send them: its credential provider's, else (user,) password."""
    provider = conn.credential_provider
    if provider is not None:
        if provides(provider, "get_credentials_async"):
            return tuple(await provider.get_credentials_async())
        return tuple(provider.get_credentials())
    if conn.username or conn.password:
        return (conn.username, conn.password) if conn.username else (conn.password,)
    return ()


def retry_count(retry: Any) -> int:
    """How many times a redis-py Retry (blocking or asyncio) retries; 0 if unknown."""
    if retry is None:
        return 0
    if provides(retry, "get_retries"):
        value = retry.get_retries()
    else:
        value = getattr(retry, "_retries", None)  # what get_retries() returns later
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def refresh_after_failure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a blocking RedisCluster's ``nodes_manager.initialize(*args, **kwargs)``,
    called once the client is built, re-reads the slot map after a failed call (which
    idemlock moves off the caller's thread) rather than on an explicit request."""
    if args:
        return False
    if FAILED_NODE_REFRESH:
        return "last_failed_node_name" in kwargs
    # Before: redis-py re-reads it after a failed call (a connection error, a timeout,
    # CLUSTERDOWN, repeated MOVED) by initialize() without arguments, and only the
    # constructor (before idemlock hooks in) calls it otherwise.
    return not kwargs


class StartupNodes:
    """The startup nodes a redis-py Cluster client (blocking or asyncio) had when the
    store took it (for a client built from the URL: the URL's nodes), put back once
    redis-py has dropped every one of them.

    Why: redis-py (5.0 to 6.4 at least: checked on 5.0.1, 5.0.8, 5.3.1 and 6.4.0, both
    clients) removes a node from ``nodes_manager.startup_nodes`` when a call to it
    fails on its connection (refused, reset, timed out), and reads the slot map
    again only from the startup nodes left. Calls that fail on every primary during one
    outage of the whole cluster leave none, and from then on every call fails ("Redis
    Cluster cannot be connected. Please provide at least one reachable node: None"),
    although the cluster is back. Later releases (8.1.0) move a failed node to the end
    of the dict instead, never emptying it. The feature test is that behaviour itself, seen as
    it happens (the dict found empty), never a version number: on a release that keeps
    its startup nodes this never acts.

    ``nodes_manager.startup_nodes`` (on every admitted release) is the only redis-py
    state read or changed here, and it is replaced, never filled in place: on the
    blocking client of those releases it is, after a slot map read, the very dict of the nodes
    the client knows (``nodes_cache``), which the next slot map read rebuilds.
    """

    __slots__ = ("_manager", "_nodes")

    def __init__(self, client: Any) -> None:
        manager = getattr(client, "nodes_manager", None)
        nodes = getattr(manager, "startup_nodes", None)
        self._manager: Any = None
        #: the nodes to put back (name -> redis-py ClusterNode); a copy: redis-py
        #: changes its own dict in place
        self._nodes: dict[str, Any] = {}
        if isinstance(nodes, dict) and nodes:
            self._manager, self._nodes = manager, dict(nodes)

    def restore(self) -> bool:
        """Put the startup nodes back if redis-py has dropped every one; whether it had."""
        manager = self._manager
        if manager is None or manager.startup_nodes:
            return False
        manager.startup_nodes = dict(self._nodes)
        return True
