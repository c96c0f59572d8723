"""From a URL or an existing redis-py client to (client, is_cluster, options)."""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, unquote, urlencode

from ..._errors import ConfigurationError, StoreUnavailable
from ..._urls import redact, refuse_unencoded_password
from ._common import OWN_OPTIONS, Options, own_options


def shown(url: str) -> str:
    """``url`` as it may be shown in a message: every password redacted, in the
    userinfo and in the query (``?password=``), by idemlock's one ``redact``."""
    return redact(url)


#: Defaults for clients idemlock builds (the user's URL or keywords override them):
#: bounded waits, and few retries so a dead server is reported quickly.
DEFAULT_TIMEOUT = 5.0


def _default_retry(asynchronous: bool) -> Any:
    """Retry a refused or reset connection (fast), never a timeout: a silent network
    would otherwise stretch one call to several ``timeout``s."""
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError

    errors = (RedisConnectionError,)
    if asynchronous:
        from redis.asyncio.retry import Retry as ARetry

        return ARetry(ExponentialBackoff(cap=0.1, base=0.01), 2, supported_errors=errors)
    from redis.retry import Retry

    return Retry(ExponentialBackoff(cap=0.1, base=0.01), 2, supported_errors=errors)


def _allowed_connection_args(*classes: Any) -> set[str]:
    from redis.connection import URL_QUERY_ARGUMENT_PARSERS

    names = set(URL_QUERY_ARGUMENT_PARSERS)
    for cls in classes:
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is None:
                continue
            for p in inspect.signature(init).parameters.values():
                if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                    names.add(p.name)
    return names - {"self"}


def _split(url: str) -> tuple[str, str, str, str]:
    """(scheme, netloc, path, query) without urlsplit's port parsing (a cluster URL
    has several host:port pairs)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise ConfigurationError(f"not a URL: {shown(url)!r}")
    rest, _, _fragment = rest.partition("#")
    rest, _, query = rest.partition("?")
    netloc, slash, path = rest.partition("/")
    return scheme.lower(), netloc, slash + path, query


def _check_query(url: str, query: dict[str, str], allowed: set[str]) -> None:
    unknown = sorted(set(query) - allowed - set(OWN_OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"unknown option(s) {', '.join(unknown)} in Redis URL {shown(url)!r}; use "
            "redis-py connection options (socket_timeout=, ssl_cert_reqs=, ...) or "
            "idemlock's timeout= and counter_ttl= (seconds), handoff_ms= and durability="
        )


def _check_keywords(options: dict[str, Any], *classes: Any) -> None:
    # redis-py takes any keyword and trips over an unknown one only when it first
    # connects (a raw TypeError), or drops it silently (sync cluster): refuse it now.
    unknown = sorted(set(options) - _allowed_connection_args(*classes) - set(OWN_OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"unknown option(s) {', '.join(unknown)} for the Redis store; it accepts "
            f"idemlock's {', '.join(f'{o}=' for o in OWN_OPTIONS)} and redis-py's client "
            "and connection options (socket_keepalive=, ssl_cert_reqs=, retry=, ...)"
        )


def _db(url: str, path: str, query: dict[str, str]) -> None:
    db = path.strip("/")
    if db and not db.isdigit():
        raise ConfigurationError(
            f"the path of a Redis URL is the database number, got {db!r} in {shown(url)!r}"
        )


class _Target(NamedTuple):
    """What :func:`build` hands the builder of one kind of client."""

    url: str
    scheme: str
    netloc: str
    path: str
    query: dict[str, str]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    asynchronous: bool


def _node_options(
    url: str, userinfo: str, query: dict[str, str], ssl: bool, db: str | None = None
) -> dict[str, Any]:
    """The query values and the credentials of ``url`` as redis-py converts them for
    one node (its host, port and connection class left out; its database too unless
    ``db`` is given)."""
    import redis.connection

    one = f"{'rediss' if ssl else 'redis'}://{userinfo + '@' if userinfo else ''}h"
    if db is not None:
        one += f"/{db}"
    if query:
        one += "?" + urlencode(query)
    try:
        # redis-py leaves parse_url unannotated (nothing to fix on our side)
        parsed: dict[str, Any] = redis.connection.parse_url(one)  # type: ignore[no-untyped-call]
    except ValueError as exc:
        raise ConfigurationError(f"bad option in {shown(url)!r}: {exc}") from exc
    for drop in ("host", "port", "connection_class") + (("db",) if db is None else ()):
        parsed.pop(drop, None)
    if ssl:
        parsed["ssl"] = True
    return parsed


def build(url: str, options: dict[str, Any], asynchronous: bool) -> tuple[Any, bool, Options]:
    """A new client for ``url``: (client, is_cluster, idemlock options)."""
    if not isinstance(url, str):
        raise ConfigurationError(f"a Redis URL must be a str, got {type(url).__name__}")
    # Else its host, port, database or options would be pieces of the password.
    refuse_unencoded_password(url, "Redis URL")
    scheme, netloc, path, query_s = _split(url)
    try:
        query = dict(parse_qsl(query_s, keep_blank_values=True, strict_parsing=False))
    except ValueError as exc:
        raise ConfigurationError(f"cannot parse the options of {shown(url)!r}: {exc}") from exc
    opts_in = dict(options)
    for name in OWN_OPTIONS:
        if name in query:
            opts_in.setdefault(name, query.pop(name))
    own = own_options(opts_in)  # pops idemlock's options; the rest goes to redis-py
    kwargs: dict[str, Any] = {
        "socket_timeout": own.timeout,
        "socket_connect_timeout": own.timeout,
    }
    target = _Target(url, scheme, netloc, path, query, kwargs, opts_in, asynchronous)
    if scheme in ("redis", "rediss", "unix"):
        return (
            _standalone(target),
            False,
            own,
        )
    if scheme in ("redis+cluster", "rediss+cluster"):
        if not own.durability.none:
            raise ConfigurationError(
                f"durability={own.durability} is not supported on Redis Cluster yet; "
                f"remove it from the options of {shown(url)!r} (or use durability=none)"
            )
        return _cluster(target), True, own
    if scheme in ("redis+sentinel", "rediss+sentinel"):
        client = _sentinel(target)
        return client, False, own
    raise ConfigurationError(
        f"{shown(url)!r} is not a Redis URL; use redis://, rediss://, unix://, "
        "redis+cluster://host:port[,host:port...] or "
        "redis+sentinel://host:port[,host:port...]/SERVICE[/DB]"
    )


def _standalone(target: _Target) -> Any:
    url, scheme, netloc, path, query, kwargs, options, asynchronous = target
    import redis
    import redis.asyncio
    import redis.connection

    if scheme != "unix":
        if not netloc.rpartition("@")[2]:
            raise ConfigurationError(f"Redis URL {shown(url)!r} names no host")
        _db(url, path, query)
        host = netloc.rpartition("@")[2]
        port = host.rpartition("]")[2].rpartition(":")[2] if ":" in host else ""
        if port and not port.isdigit():
            raise ConfigurationError(f"bad port {port!r} in Redis URL {shown(url)!r}")
    elif not path.strip("/"):
        raise ConfigurationError(f"unix:// Redis URL {shown(url)!r} names no socket path")
    conn_cls: Any = redis.connection.Connection
    if scheme == "rediss":
        conn_cls = redis.connection.SSLConnection
    elif scheme == "unix":
        conn_cls = redis.connection.UnixDomainSocketConnection
    _check_query(url, query, _allowed_connection_args(conn_cls))
    _check_keywords(options, conn_cls, redis.connection.ConnectionPool, redis.Redis)
    if "retry" not in options:
        kwargs["retry"] = _default_retry(asynchronous)
    kwargs.update(options)
    rebuilt = url.split("?", 1)[0].split("#", 1)[0]
    if query:
        rebuilt += "?" + urlencode(query)
    factory = redis.asyncio.Redis if asynchronous else redis.Redis
    try:
        return factory.from_url(rebuilt, **kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"bad Redis URL or option in {shown(url)!r}: {exc}") from exc


def _hostport(
    url: str, item: str, what: str = "cluster node", port: str = "6379"
) -> tuple[str, int]:
    if item.startswith("["):
        host, _, rest = item[1:].partition("]")
        port_s = rest.removeprefix(":")
    else:
        host, _, port_s = item.rpartition(":")
        if not host:
            host, port_s = port_s, ""
    port_s = port_s or port
    if not host or not port_s.isdigit() or not 0 < int(port_s) < 65536:
        raise ConfigurationError(
            f"bad {what} {item!r} in {shown(url)!r}; write host:port[,host:port...]"
        )
    return unquote(host), int(port_s)


def _cluster(target: _Target) -> Any:
    url, scheme, netloc, path, query, kwargs, options, asynchronous = target
    import redis.connection

    userinfo, _, hosts = netloc.rpartition("@")
    if not hosts:
        raise ConfigurationError(f"cluster URL {shown(url)!r} names no node")
    nodes = [_hostport(url, h) for h in hosts.split(",") if h]
    if not nodes:
        raise ConfigurationError(f"cluster URL {shown(url)!r} names no node")
    db = path.strip("/")
    if db not in ("", "0"):
        raise ConfigurationError(
            f"Redis Cluster has only database 0; remove the path {path!r} from {shown(url)!r}"
        )
    conn_cls = redis.connection.SSLConnection if scheme.startswith("rediss") else None
    _check_query(url, query, _allowed_connection_args(conn_cls or redis.connection.Connection))
    import redis.asyncio.cluster
    import redis.cluster

    _check_keywords(
        options,
        conn_cls or redis.connection.Connection,
        redis.cluster.RedisCluster,
        redis.asyncio.cluster.RedisCluster,
    )
    kwargs.update(_node_options(url, userinfo, query, conn_cls is not None))
    kwargs.update(options)
    try:
        if asynchronous:
            from redis.asyncio.cluster import ClusterNode as ANode
            from redis.asyncio.cluster import RedisCluster as ACluster

            return ACluster(startup_nodes=[ANode(h, p) for h, p in nodes], **kwargs)
        from redis.cluster import ClusterNode

        nodes_ = [ClusterNode(h, p) for h, p in nodes]  # type: ignore[no-untyped-call]
        return _bounded_cluster_class()(startup_nodes=nodes_, **kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"bad Redis Cluster URL or option {shown(url)!r}: {exc}") from exc
    except Exception as exc:
        # The sync client discovers the cluster's slots right away.
        raise StoreUnavailable(
            f"cannot reach Redis Cluster at {shown(url)!r}: {type(exc).__name__}: {exc}"
        ) from exc


#: Options of a Sentinel URL for the Sentinels themselves (the userinfo is the
#: primary's credentials; Sentinels with ``requirepass`` take these).
SENTINEL_OPTIONS = ("sentinel_username", "sentinel_password")


def _sentinel(target: _Target) -> Any:
    """A client of the primary of ``SERVICE`` as the Sentinels name it: each new
    connection asks them where the primary is, and a connection to a demoted primary
    (READONLY) is dropped, so the next call reaches the new one."""
    url, scheme, netloc, path, query, kwargs, options, asynchronous = target
    import redis.asyncio.sentinel
    import redis.connection
    import redis.sentinel

    userinfo, _, hosts = netloc.rpartition("@")
    nodes = [_hostport(url, h, "Sentinel", "26379") for h in hosts.split(",") if h]
    service, _, db = path.strip("/").partition("/")
    if not nodes or not service or "/" in db or (db and not db.isdigit()):
        raise ConfigurationError(
            f"a Sentinel URL is redis+sentinel://[user:password@]host:port[,host:port...]"
            f"/SERVICE[/DB] (SERVICE: the name the Sentinels monitor, DB: a database "
            f"number), got {shown(url)!r}"
        )
    sentinel_kw: dict[str, Any] = {
        k: v for k, v in kwargs.items() if k in ("socket_timeout", "socket_connect_timeout")
    }
    for name in SENTINEL_OPTIONS:
        value = query.pop(name, None)
        value = options.pop(name, value)
        if value is not None:
            sentinel_kw[name.removeprefix("sentinel_")] = unquote(str(value))
    ssl = scheme.startswith("rediss")
    conn_cls = redis.connection.SSLConnection if ssl else redis.connection.Connection
    _check_query(url, query, _allowed_connection_args(conn_cls))
    _check_keywords(options, conn_cls, redis.Redis)
    parsed = _node_options(url, userinfo, query, ssl, db or "0")
    if ssl:
        sentinel_kw["ssl"] = True
    if "retry" not in options:
        kwargs["retry"] = _default_retry(asynchronous)
    # The Sentinels' own clients too: redis-py's default (3 retries, backoff from 1 s)
    # made one call with every Sentinel down take ~11 s per attempt, whatever timeout=.
    sentinel_kw["retry"] = _default_retry(asynchronous)
    kwargs.update(parsed)
    kwargs.update(options)
    try:
        if asynchronous:
            sentinels: Any = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call]
                nodes, sentinel_kwargs=sentinel_kw, **kwargs
            )
        else:
            sentinels = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
                nodes, sentinel_kwargs=sentinel_kw, **kwargs
            )
        return sentinels.master_for(service)
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"bad Redis Sentinel URL or option {shown(url)!r}: {exc}") from exc


_BOUNDED: Any = None


def _bounded_cluster_class() -> Any:
    """redis-py's blocking RedisCluster, with every call bounded by one socket timeout.

    After a timeout redis-py retries the command and first re-reads the slot map from
    every known node, in line: with the nodes stalled (a partition, a paused VM) that
    is one more timeout per node. Here a timeout is not retried (the caller decides,
    and the call may have been applied), and the slot map is re-read on a background
    thread, so a failover is still learnt while the calls stay bounded.
    """
    global _BOUNDED
    if _BOUNDED is not None:
        return _BOUNDED
    import os
    import threading

    from redis.cluster import RedisCluster
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from ._compat import refresh_after_failure

    class BoundedRedisCluster(RedisCluster):
        ERRORS_ALLOW_RETRY = tuple(  # type: ignore[assignment]
            e for e in RedisCluster.ERRORS_ALLOW_RETRY if not issubclass(e, RedisTimeoutError)
        )

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            manager = self.nodes_manager
            inline = manager.initialize
            # One refresh at a time; a new lock in a forked child (a refresh running in
            # the parent at the fork would leave this one held forever).
            busy: dict[int, threading.Lock] = {}  # pid -> lock

            def refresh(lock: threading.Lock, **kw: Any) -> None:
                try:
                    inline(**kw)
                except Exception:
                    pass  # the next failure asks again
                finally:
                    lock.release()

            def initialize(*a: Any, **kw: Any) -> Any:
                if not refresh_after_failure(a, kw):
                    return inline(*a, **kw)
                lock = busy.get(os.getpid())
                if lock is None:
                    busy.clear()
                    lock = busy.setdefault(os.getpid(), threading.Lock())
                # After a failed call: re-read the slot map without holding it up.
                if lock.acquire(blocking=False):
                    t = threading.Thread(
                        target=refresh,
                        args=(lock,),
                        kwargs=kw,
                        name="idemlock-redis-slots",
                        daemon=True,
                    )
                    t.start()
                return None

            manager.initialize = initialize  # type: ignore[method-assign]

    _BOUNDED = BoundedRedisCluster
    return _BOUNDED


def check_aof(client: Any, durability: Any, where: str) -> None:
    """Refuse ``durability=aof...`` now, at connect, when the server cannot honour it:
    found by asking the server (``WAITAOF 1 0 1``, which returns at once), not by its
    version. No WAITAOF (Redis < 7.2), or ``appendonly no``: ConfigurationError."""
    if not durability.aof:
        return
    from redis.exceptions import ResponseError

    try:
        try:
            client.execute_command("WAITAOF", 1, 0, 1)
            return
        except ResponseError as exc:
            refusal = str(exc)
        version = str(client.info("server").get("redis_version", "?"))
    except Exception as exc:
        raise StoreUnavailable(
            f"cannot check that the Redis server at {where} supports durability="
            f"{durability} (WAITAOF): {type(exc).__name__}: {exc}"
        ) from exc
    if "unknown command" in refusal.lower():
        raise ConfigurationError(
            f"durability={durability} needs WAITAOF (Redis >= 7.2), but the server at "
            f"{where} is Redis {version}; upgrade it, or use durability=replicas:N "
            "(WAIT, any version) or durability=none"
        )
    raise ConfigurationError(
        f"durability={durability} needs the append-only file on the server at {where} "
        f"(Redis {version} refused WAITAOF: {refusal}); set appendonly yes there, or use "
        "durability=replicas:N or none"
    )


def check_client(client: Any, asynchronous: bool) -> bool:
    """Whether ``client`` is a cluster client; raises if it is no usable redis-py client."""
    import redis
    import redis.asyncio
    import redis.asyncio.cluster
    import redis.cluster

    if asynchronous:
        if isinstance(client, redis.asyncio.cluster.RedisCluster):
            return True
        if isinstance(client, redis.asyncio.Redis):
            return False
        if isinstance(client, (redis.Redis, redis.cluster.RedisCluster)):
            raise ConfigurationError(
                "idemlock.aio.connect() needs an asyncio client (redis.asyncio.Redis or "
                "redis.asyncio.cluster.RedisCluster); pass this blocking client to "
                "idemlock.connect() instead"
            )
    else:
        if isinstance(client, redis.cluster.RedisCluster):
            return True
        if isinstance(client, redis.Redis):
            return False
        if isinstance(client, (redis.asyncio.Redis, redis.asyncio.cluster.RedisCluster)):
            raise ConfigurationError(
                "idemlock.connect() needs a blocking client (redis.Redis or "
                "redis.cluster.RedisCluster); pass this asyncio client to "
                "idemlock.aio.connect() instead"
            )
    raise ConfigurationError(
        f"cannot use a {type(client).__module__}.{type(client).__name__} as a Redis store; "
        "pass redis.Redis, redis.cluster.RedisCluster or their redis.asyncio versions"
    )


def client_options(options: dict[str, Any], client: Any = None) -> Options:
    opts = dict(options)
    given = "timeout" in opts
    own = own_options(opts)
    if not given and client is not None:
        # The bound of a client we did not build: its own socket timeout, if it has one.
        sock = _client_socket_timeout(client)
        if sock is not None:
            own = replace(own, timeout=sock)
    if opts:
        raise ConfigurationError(
            f"unknown option(s) {', '.join(sorted(opts))} for a Redis store built from a "
            "client; configure the client itself, idemlock only takes timeout=, "
            "counter_ttl=, durability= and handoff_ms="
        )
    return own


def _client_socket_timeout(client: Any) -> float | None:
    try:
        pool = getattr(client, "connection_pool", None)
        if pool is not None:
            kw = pool.connection_kwargs
        else:  # a cluster client: its nodes' connection options
            kw = (
                getattr(client, "connection_kwargs", None) or client.nodes_manager.connection_kwargs
            )
        value = kw.get("socket_timeout")
    except Exception:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
        return float(value)
    return None
