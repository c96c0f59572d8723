"""What the asyncio Redis store keeps per event loop, and how it gets a client for
a loop other than the first: asyncio connections belong to the loop that opened them.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any

from ..._errors import ConfigurationError
from ._clients import ScriptClient
from ._compat import StartupNodes, retry_count
from ._listen import AsyncListener, AsyncNodeListeners


class LoopState:
    """What the store keeps per event loop: asyncio connections belong to the loop
    that opened them, so each loop gets its own client, listener and queue."""

    __slots__ = (
        "backend",
        "client",
        "init_lock",
        "listener",
        "loop",
        "owned",
        "ready",
        "retries",
        "slots",
        "startup",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, client: Any, owned: bool) -> None:
        self.loop: Callable[[], asyncio.AbstractEventLoop | None]
        try:
            self.loop = weakref.ref(loop)
        except TypeError:  # a loop class without weak references
            self.loop = lambda: loop
        self.client = client
        self.owned = owned
        self.ready = False
        self.init_lock = asyncio.Lock()
        self.slots = asyncio.Semaphore(max_connections(client))
        retry = getattr(client, "connection_pool", None)
        retry = getattr(retry, "connection_kwargs", {}).get("retry")
        self.retries = retry_count(retry) > 0
        #: a Cluster client's startup nodes as given, put back if redis-py drops them all
        #: (taken now: a client built for this loop has not read the slot map yet)
        self.startup = StartupNodes(client)
        #: how scripts reach Redis on this loop (chosen by the store, see _clients)
        self.backend: ScriptClient
        self.listener: AsyncListener | AsyncNodeListeners


def client_for_another_loop(client: Any, cluster: bool, factory: Callable[[], Any] | None) -> Any:
    """A client for a loop other than the one ``client`` serves: from ``factory`` (the
    URL's), else a copy of a standalone client's connection settings."""
    if factory is not None:
        return factory()
    if cluster:
        raise ConfigurationError(
            "this redis.asyncio RedisCluster client belongs to the event loop it was "
            "first used on, and idemlock cannot copy it for another loop; pass the "
            "cluster URL to idemlock.aio.connect() (idemlock then opens connections per "
            "loop), or create the client and the coordinator inside each loop"
        )
    if hasattr(client.connection_pool, "service_name"):  # a Sentinel pool (duck-typed)
        raise ConfigurationError(
            "this redis.asyncio Sentinel client belongs to the event loop it was first "
            "used on, and idemlock cannot copy it for another loop; pass the "
            "redis+sentinel:// URL to idemlock.aio.connect() (idemlock then opens "
            "connections per loop), or create the client and the coordinator inside "
            "each loop"
        )
    return copy_standalone(client)


def node_of(client: Any, channel: bytes) -> str:
    """The Cluster node holding ``channel``'s slot ('' if the client cannot tell yet);
    of a blocking client too (the sync plumbing uses it)."""
    try:
        return str(client.get_node_from_key(channel).name)
    except Exception:  # slot map not read yet, or slot not covered: any node will do
        return ""


def max_connections(client: Any) -> int:
    """How many calls may run at once on ``client`` without redis-py's pool raising
    MaxConnectionsError (a cluster client limits each node: at most that in all)."""
    pool = getattr(client, "connection_pool", None)
    value = getattr(pool, "max_connections", None)
    if value is None:
        manager = getattr(client, "nodes_manager", None)
        value = getattr(manager, "connection_kwargs", {}).get("max_connections")
    if not isinstance(value, int) or value <= 0:
        value = 100
    return min(value, 10_000)


def copy_standalone(client: Any) -> Any:
    """A client with the same connection settings as ``client``, for another loop."""
    import redis.asyncio

    pool = client.connection_pool
    kwargs = {
        k: v for k, v in pool.connection_kwargs.items() if k != "maint_notifications_pool_handler"
    }
    if isinstance(pool, redis.asyncio.BlockingConnectionPool):
        kwargs["timeout"] = pool.timeout
    new_pool = type(pool)(
        connection_class=pool.connection_class, max_connections=pool.max_connections, **kwargs
    )
    return redis.asyncio.Redis(connection_pool=new_pool)
