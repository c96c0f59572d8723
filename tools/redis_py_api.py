"""Print the attribute names of the redis-py classes the Redis store uses, as JSON.

    /tmp/venv-redis5/bin/python tools/redis_py_api.py > tests/redis_py_api_5.0.0.json

Run with the lowest redis-py that ``pyproject.toml`` admits: tests/test_redis_compat.py
checks that the store touches an attribute that release lacks only behind a feature
test (in ``stores/redis/_compat.py``). Names are the classes' ``dir()`` and the
``self.<name>`` their ``__init__`` methods set.
"""

from __future__ import annotations

import ast
import inspect
import json
import sys
import textwrap

import redis
import redis.asyncio.client
import redis.asyncio.cluster
import redis.asyncio.connection
import redis.asyncio.retry
import redis.client
import redis.cluster
import redis.connection
import redis.retry

CLASSES = [
    redis.connection.Connection,
    redis.connection.SSLConnection,
    redis.connection.UnixDomainSocketConnection,
    redis.connection.ConnectionPool,
    redis.connection.BlockingConnectionPool,
    redis.client.Redis,
    redis.client.Pipeline,
    redis.retry.Retry,
    redis.cluster.RedisCluster,
    redis.cluster.NodesManager,
    redis.cluster.ClusterNode,
    redis.cluster.ClusterPipeline,
    redis.asyncio.connection.Connection,
    redis.asyncio.connection.SSLConnection,
    redis.asyncio.connection.UnixDomainSocketConnection,
    redis.asyncio.connection.ConnectionPool,
    redis.asyncio.connection.BlockingConnectionPool,
    redis.asyncio.client.Redis,
    redis.asyncio.client.Pipeline,
    redis.asyncio.retry.Retry,
    redis.asyncio.cluster.RedisCluster,
    redis.asyncio.cluster.NodesManager,
    redis.asyncio.cluster.ClusterNode,
    redis.asyncio.cluster.ClusterPipeline,
]


def names() -> set[str]:
    found: set[str] = set()
    for cls in CLASSES:
        found |= set(dir(cls))
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None or not hasattr(init, "__code__"):
                continue
            try:
                tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
            except (OSError, TypeError):
                continue
            for node in ast.walk(tree):
                if (
                    isinstance(node, ast.Attribute)
                    and isinstance(node.value, ast.Name)
                    and node.value.id == "self"
                ):
                    found.add(node.attr)
    return found


if __name__ == "__main__":
    json.dump({"redis": redis.__version__, "names": sorted(names())}, sys.stdout, indent=0)
    sys.stdout.write("\n")
