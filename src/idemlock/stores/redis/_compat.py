"""What differs between the redis-py releases the Redis store admits (``redis>=5``:
5.0 to 8.x), in one place. Each difference is found once, at import, by a feature
test on redis-py's own classes (never a version number, never an assumed attribute),
and the rest of the store goes through the helpers here.

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

#: redis-py attributes that some admitted release lacks (the release that added them):
#: only this module reads them, each behind the feature test below.
OPTIONAL = {
    # Connection.should_reconnect(): a maintenance notification asked the connection
    # to reconnect (7.0; there are no such notifications before)
    "should_reconnect": "7.0",
    # redis.asyncio clients' aclose() (5.0.1; close() was the coroutine before)
    "aclose": "5.0.1",
    # Retry.get_retries() (6.0 on the blocking Retry, 7.0 on the asyncio one; the
    # count is the private _retries before)
    "get_retries": "6.0",
    "_retries": "-",
    # NodesManager.initialize(last_failed_node_name=) after a failed call (7.0;
    # initialize() without arguments before)
    "last_failed_node_name": "7.0",
}


def _has(cls: Any, name: str) -> bool:
    return callable(getattr(cls, name, None))


#: whether blocking connections have should_reconnect()
SHOULD_RECONNECT = _has(redis.connection.Connection, "should_reconnect")
#: whether redis.asyncio clients have aclose()
ACLOSE = _has(redis.asyncio.Redis, "aclose")
#: whether Retry objects tell their count by get_retries(), blocking and asyncio
SYNC_GET_RETRIES = _has(redis.retry.Retry, "get_retries")
ASYNC_GET_RETRIES = _has(redis.asyncio.retry.Retry, "get_retries")


def _initialize_takes_failed_node() -> bool:
    try:
        params = inspect.signature(redis.cluster.NodesManager.initialize).parameters
    except (AttributeError, TypeError, ValueError):  # pragma: no cover - not inspectable
        return False
    return "last_failed_node_name" in params


#: whether a blocking RedisCluster re-reads its slot map after a failed call by
#: ``initialize(last_failed_node_name=...)`` (else by ``initialize()``)
FAILED_NODE_REFRESH = _initialize_takes_failed_node()


def should_reconnect(conn: Any) -> bool:
    """Whether redis-py asked ``conn`` (blocking) to reconnect before its next use."""
    if SHOULD_RECONNECT:
        return bool(conn.should_reconnect())
    return False


async def aclose_client(client: Any) -> None:
    """Close a redis.asyncio client (standalone or Cluster) and its pool."""
    if ACLOSE and _has(client, "aclose"):
        await client.aclose()
    else:
        await client.close()


def retry_count(retry: Any) -> int:
    """How many times a redis-py Retry (blocking or asyncio) retries; 0 if unknown."""
    if retry is None:
        return 0
    asynchronous = isinstance(retry, redis.asyncio.retry.Retry)
    if ASYNC_GET_RETRIES if asynchronous else SYNC_GET_RETRIES:
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
