"""The Redis surface fencekit took, and how the façade turns it into a coordinator.

Every fencekit class takes a redis-py client (or a :class:`RedisClient` around one),
as fencekit did, or any idemlock :class:`~idemlock.Coordinator`, which brings every
store idemlock supports (memory, SQLite, Redis, Redis Cluster, PostgreSQL).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Protocol, runtime_checkable

from ..._errors import ConfigurationError
from ..._sync import Coordinator

__all__ = ["RedisClient", "SyncRedis", "integer_response"]

#: the key prefix of the coordinator the façade opens on a bare redis-py client
COORDINATOR_PREFIX = "fencekit"
_ATTR = "_idemlock_fencekit_coordinator"
_opening = threading.Lock()


def integer_response(value: object) -> int:
    """An integer reply, or TypeError naming what came back instead."""
    if isinstance(value, int):
        return value
    raise TypeError(f"expected an integer reply from Redis, got {type(value).__name__}")


@runtime_checkable
class SyncRedis(Protocol):
    """The part of a redis-py client fencekit's signatures named."""

    def set(
        self,
        name: str,
        value: str,
        *,
        nx: bool = False,
        xx: bool = False,
        ex: int | None = None,
        px: int | None = None,
    ) -> object: ...

    def get(self, name: str) -> object: ...

    def delete(self, *names: str) -> object: ...

    def eval(self, script: str, numkeys: int, *keys_and_args: str | int) -> object: ...


class RedisClient:
    """A wrapper of a redis-py client with str replies. The façade uses the wrapped
    client (``raw``) through idemlock's Redis store."""

    def __init__(self, redis: SyncRedis) -> None:
        self._redis = redis

    @property
    def raw(self) -> SyncRedis:
        return self._redis

    def set(
        self,
        name: str,
        value: str,
        *,
        nx: bool = False,
        xx: bool = False,
        ex: int | None = None,
        px: int | None = None,
    ) -> bool:
        return bool(self._redis.set(name, value, nx=nx, xx=xx, ex=ex, px=px))

    def get(self, name: str) -> str | None:
        value = self._redis.get(name)
        if value is None:
            return None
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)

    def delete(self, *names: str) -> int:
        return integer_response(self._redis.delete(*names))

    def eval(self, script: str, numkeys: int, *keys_and_args: str | int) -> object:
        return self._redis.eval(script, numkeys, *keys_and_args)


def coordinator_for(redis: Any) -> Coordinator:
    """The coordinator a fencekit class works through.

    A Coordinator is used as given. A redis-py client gets one coordinator (key
    prefix ``fencekit``), kept on the client object so every class built on it shares
    its connections and timers, and it goes away with the client.
    """
    if isinstance(redis, Coordinator):
        return redis
    if isinstance(redis, RedisClient):
        redis = redis.raw
    from ...aio import AsyncCoordinator

    if isinstance(redis, AsyncCoordinator):
        raise ConfigurationError(
            "fencekit's API is blocking: pass an idemlock.Coordinator (idemlock.connect) "
            "or a redis-py client; for asyncio use idemlock.compat.ports or idemlock.aio"
        )
    try:
        found = getattr(redis, _ATTR, None)
    except Exception:
        found = None
    if isinstance(found, Coordinator):
        return found
    from ... import connect

    with _opening:
        found = getattr(redis, _ATTR, None)
        if isinstance(found, Coordinator):
            return found
        coord = connect(redis, key_prefix=COORDINATOR_PREFIX)
        # A client without __dict__ gets one coordinator per façade object.
        with contextlib.suppress(AttributeError, TypeError):
            setattr(redis, _ATTR, coord)
        return coord


def notify(hooks: Any, name: str, *args: Any) -> None:
    """Call ``hooks.<name>(*args)`` if the hooks object has it. A failing hook never
    changes the outcome of the operation it reports."""
    method = getattr(hooks, name, None) if hooks is not None else None
    if method is None:
        return
    try:
        method(*args)
    except Exception:
        import logging

        from ..._logfields import fields

        logging.getLogger("idemlock").warning(
            "fencekit hook %s raised",
            name,
            exc_info=True,
            extra=fields(operation=name, outcome="error"),
        )
