"""The Redis store on every redis-py release ``pyproject.toml`` admits (issue 21, item 1).

``redis>=5`` admits 5.0.0 to 8.x, but the blocking store called
``Connection.should_reconnect()``, which only redis-py 7+ has: on 5.x and 6.x every
call raised a raw AttributeError. What differs between releases now lives in
``stores/redis/_compat.py``, behind feature tests. Here, in the normal suite (whatever
redis-py is installed):

* no other module of the store touches an attribute that redis-py 5.0.0 (the lowest
  admitted release, its API recorded in ``tests/redis_py_api_5.0.0.json`` by
  ``tools/redis_py_api.py``) lacks, and ``_compat.OPTIONAL`` names every such
  attribute that ``_compat`` reads;
* the store runs on connection, client and retry classes shaped like the old releases
  (the newer methods absent), against real servers, and on the current ones: each
  feature test with both outcomes.

The whole Redis suite on the old releases themselves is the dependency matrix's job
(nox); see the report of this change for the runs made on 5.0.0, 5.3.1 and 6.4.0.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import redis.asyncio
import redis.asyncio.retry
import redis.cluster
import redis.retry
from redis.backoff import NoBackoff

from idemlock._core.port import Acquired
from idemlock.stores.redis import (
    AsyncRedisStore,
    RedisStore,
    _compat,
    _plumbing_sync,
    from_client,
)

from .servers.redis import RedisCluster, RedisServer

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "src" / "idemlock" / "stores" / "redis"
LONG = 60_000


def _ns() -> str:
    return "cp" + uuid.uuid4().hex[:10]


def _api_tool() -> Any:
    spec = importlib.util.spec_from_file_location("redis_py_api", ROOT / "tools/redis_py_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- no attribute an admitted release lacks, outside _compat ---------------------------

#: idemlock's own uses of a name that newer redis-py also has: (name, receiver prefix)
OWN = {
    ("digest", "hashlib."),  # hashlib's
    ("aclose", "listener"),  # idemlock's own listeners, pipes and subscriptions
    ("aclose", "st.listener"),
    ("aclose", "st.backend"),
    ("aclose", "pipe"),
    ("aclose", "sub"),
}


def _uses(path: Path, names: set[str]) -> list[tuple[int, str, str]]:
    """(line, name, receiver) of every ``x.name`` and ``getattr/hasattr(x, "name")``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in names:
            found.append((node.lineno, node.attr, ast.unparse(node.value)))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in names
        ):
            found.append((node.lineno, node.args[1].value, ast.unparse(node.args[0])))
    return found


def test_only_compat_touches_what_the_lowest_admitted_redis_py_lacks() -> None:
    old = json.loads((Path(__file__).parent / "redis_py_api_5.0.0.json").read_text())
    assert old["redis"] == "5.0.0"
    newer = _api_tool().names() - set(old["names"])
    assert "should_reconnect" in newer or redis.__version__.startswith(("5.", "6."))
    bad = []
    for path in sorted(STORE.glob("*.py")):
        for line, name, receiver in _uses(path, newer | set(_compat.OPTIONAL)):
            if path.name == "_compat.py":
                if name not in _compat.OPTIONAL:
                    bad.append(f"_compat.py:{line}: {name} is missing from OPTIONAL")
            elif not any(name == n and receiver.startswith(r) for n, r in OWN):
                bad.append(f"{path.name}:{line}: {receiver}.{name}")
    assert not bad, (
        "the Redis store touches redis-py attributes that redis-py 5.0.0 lacks (redis>=5 "
        "is admitted) without a feature test; go through stores/redis/_compat.py: " + "; ".join(bad)
    )


# ---- classes shaped like the old releases ----------------------------------------------


class _Missing:
    """A method a class does not have: not callable on the class (the feature test
    sees it absent), AttributeError on an instance (as on the old release)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, cls: type | None = None) -> Any:
        if obj is None:
            return self
        raise AttributeError(f"{type(obj).__name__!r} object has no attribute {self.name!r}")


class OldConnection(redis.connection.Connection):
    """A blocking connection of redis-py 5.x/6.x: no should_reconnect()."""

    should_reconnect = _Missing()


class OldRetry(redis.asyncio.retry.Retry):
    """redis-py 5.x/6.x's asyncio Retry: no get_retries()."""

    get_retries = _Missing()


class OldSyncRetry(redis.retry.Retry):
    get_retries = _Missing()


class OldAsyncRedis(redis.asyncio.Redis):
    """redis-py 5.0.0's asyncio client: close() is the coroutine, no aclose()."""

    aclose = _Missing()

    async def close(self, close_connection_pool: bool | None = None) -> None:  # type: ignore[override]
        await _REAL_CLOSE(self, close_connection_pool)


#: the installed redis.asyncio.Redis's own closing coroutine (close() on 5.0.0)
_REAL_CLOSE: Any = getattr(redis.asyncio.Redis, "aclose", None) or redis.asyncio.Redis.close


def test_the_feature_tests_see_what_a_class_has() -> None:
    assert not _compat.provides(OldConnection, "should_reconnect")
    assert not _compat.provides(OldRetry(NoBackoff(), 2), "get_retries")
    assert not _compat.provides(OldAsyncRedis, "aclose")
    # the installed redis-py's own classes: whatever they have, probed, not assumed
    has = callable(getattr(redis.connection.Connection, "should_reconnect", None))
    assert _compat.provides(redis.connection.Connection, "should_reconnect") is has
    assert _compat.SHOULD_RECONNECT is has


@pytest.mark.parametrize("cls", [OldConnection, redis.connection.Connection])
def test_blocking_store_on_connections_with_and_without_should_reconnect(
    redis_server: RedisServer, cls: type
) -> None:
    """The failure of issue 21: every blocking call raised AttributeError on 5.x/6.x."""
    pool = redis.ConnectionPool(port=redis_server.port, connection_class=cls)
    client = redis.Redis(connection_pool=pool)
    store = from_client(client, asynchronous=False)[0]
    assert isinstance(store, RedisStore) and store._direct  # the store's own connections
    ns = _ns()
    try:
        for i in range(3):
            assert isinstance(store.acquire(ns, f"k{i}", "me", LONG), Acquired)
        assert store.fence_advance(ns, "r", 7) == (True, 7)
        assert store._free and all(type(c) is cls for c in store._free)
    finally:
        store.close()
        client.close()


@pytest.mark.parametrize("cls", [OldConnection, redis.connection.Connection])
def test_cluster_store_on_connections_with_and_without_should_reconnect(
    redis_cluster: RedisCluster, cls: type
) -> None:
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=redis_cluster.announced[0])
    for node in client.get_nodes():  # the blocking RedisCluster takes no connection_class
        node.redis_connection.connection_pool.connection_class = cls
    store = from_client(client, asynchronous=False)[0]
    assert isinstance(store, RedisStore) and store._cluster_direct
    ns = _ns()
    try:
        for i in range(12):  # over the three primaries
            assert isinstance(store.acquire(ns, f"k{i}", "me", LONG), Acquired)
        assert store._node_free
        assert all(type(c) is cls for free in store._node_free.values() for c in free)
    finally:
        store.close()
        client.close()


@pytest.mark.parametrize("cls", [OldRetry, redis.asyncio.retry.Retry])
async def test_asyncio_store_reads_its_retry_policy_with_and_without_get_retries(
    redis_server: RedisServer, cls: type
) -> None:
    """On 5.x/6.x the asyncio Retry has no get_retries(): a pipelined call on a broken
    connection was then never sent again, whatever the client's retry policy said."""
    client = redis.asyncio.Redis(port=redis_server.port, retry=cls(NoBackoff(), 2))
    store = from_client(client, asynchronous=True)[0]
    assert isinstance(store, AsyncRedisStore)
    try:
        assert isinstance(await store.acquire(_ns(), "k", "me", LONG), Acquired)
        assert store._state().retries is True
    finally:
        await store.aclose()
        await _compat.aclose_client(client)


@pytest.mark.parametrize("cls", [OldSyncRetry, redis.retry.Retry, OldRetry])
def test_retry_count_with_and_without_get_retries(cls: type) -> None:
    assert _compat.retry_count(cls(NoBackoff(), 3)) == 3
    assert _compat.retry_count(None) == 0


@pytest.mark.parametrize("cls", [OldAsyncRedis, redis.asyncio.Redis])
async def test_asyncio_clients_are_closed_with_and_without_aclose(
    redis_server: RedisServer, cls: type
) -> None:
    client = cls(port=redis_server.port)
    assert await client.ping()
    pool = client.connection_pool
    assert pool._available_connections or pool._in_use_connections
    await _compat.aclose_client(client)
    assert all(c._writer is None for c in pool._available_connections)


@pytest.mark.parametrize("failed_node", [True, False])
def test_a_cluster_slot_map_refresh_after_a_failure_is_told_either_way(
    monkeypatch: pytest.MonkeyPatch, failed_node: bool
) -> None:
    """redis-py 7+ re-reads the slot map after a failed call by
    ``initialize(last_failed_node_name=...)``, older releases by ``initialize()``:
    both are moved off the caller's thread; an explicit reading stays inline."""
    monkeypatch.setattr(_compat, "FAILED_NODE_REFRESH", failed_node)
    after = _compat.refresh_after_failure
    if failed_node:
        assert after((), {"last_failed_node_name": "127.0.0.1:7000"})
        assert not after((), {})
    else:
        assert after((), {})
    assert not after(([("127.0.0.1", 7000)],), {})
    assert not after((), {"additional_startup_nodes_info": []})
    installed = redis.cluster.NodesManager.initialize
    has = "last_failed_node_name" in inspect.signature(installed).parameters
    monkeypatch.undo()
    assert _compat.FAILED_NODE_REFRESH is has


def test_a_single_connection_client_without_redis_py_s_lock_is_told() -> None:
    """redis-py 5.0.x lets threads interleave on a single-connection client's one
    connection (5.1+ holds single_connection_lock around it)."""
    old = SimpleNamespace(connection=object())  # 5.0.x: no single_connection_lock
    assert _compat.unguarded_single_connection(old)
    new = SimpleNamespace(connection=object(), single_connection_lock=threading.RLock())
    assert not _compat.unguarded_single_connection(new)
    assert not _compat.unguarded_single_connection(SimpleNamespace(connection=None))


@pytest.mark.parametrize("guarded_by_redis_py", [True, False])
def test_threads_share_a_single_connection_client_either_way(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, guarded_by_redis_py: bool
) -> None:
    if not guarded_by_redis_py:  # as on redis-py 5.0.x: the store holds its own lock
        monkeypatch.setattr(_plumbing_sync, "unguarded_single_connection", lambda c: True)
    client = redis.Redis(port=redis_server.port, single_connection_client=True)
    store = from_client(client, asynchronous=False)[0]
    assert isinstance(store, RedisStore)
    assert (store._serial is None) is (
        guarded_by_redis_py and not _compat.unguarded_single_connection(client)
    )
    ns = _ns()
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            for i in range(50):
                assert isinstance(store.acquire(ns, f"k{t}.{i}", "o", LONG), Acquired)
            assert len(store.locks(ns)) >= 50
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not errors, errors[0]
        assert len(store.locks(ns)) == 200
    finally:
        store.close()
        client.close()
