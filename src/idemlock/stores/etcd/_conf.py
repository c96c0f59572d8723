"""The etcd store's URL, options and gRPC error mapping (shared by sync and async)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, unquote

from ..._core.clock import duration
from ..._errors import ConfigurationError, StoreFull, StoreUnavailable
from ..._urls import redact, refuse_unencoded_password, scrub

DEFAULT_TIMEOUT = 5.0

#: one attempt on one member is cut after this share of the call's bound, so a member
#: that went silent leaves time to ask another one
TRY_SHARE = 0.5
#: ... and the first attempt after at most this (seconds): etcd answers in
#: milliseconds, and a proposal forwarded to a leader that just died is only failed
#: by etcd after its request timeout (about 5 s), while the next attempt, on the new
#: leader, succeeds as soon as the election is over
FIRST_TRY = 1.0

OPTIONS = ("timeout", "prefix", "ca", "cert", "key", "user", "password")


@dataclass(frozen=True)
class Config:
    endpoints: tuple[str, ...]
    tls: bool
    timeout: float = DEFAULT_TIMEOUT
    root: bytes = b"idemlock/"
    user: str | None = None
    password: str | None = field(default=None, repr=False)
    ca: bytes | None = field(default=None, repr=False)
    cert: bytes | None = field(default=None, repr=False)
    key: bytes | None = field(default=None, repr=False)

    @property
    def per_try(self) -> float:
        return max(0.2, self.timeout * TRY_SHARE)

    def try_timeout(self, attempt: int, left: float) -> float:
        """The deadline of one attempt: short when another member can be asked (a
        member that is restarting or cut off from the leader makes calls wait), and
        for the first attempt on a single member; longer for its retries."""
        short = attempt == 0 or len(self.endpoints) > 1
        bound = min(self.per_try, FIRST_TRY) if short else self.per_try
        return max(0.001, min(left, bound))

    def channel_options(self) -> list[tuple[str, int]]:
        """gRPC channel options: find a dead connection by itself (etcd allows pings
        every 5 s), reconnect within a second, and give up a connection attempt whose
        handshake got no answer after one attempt's bound (at least a second), not
        gRPC's default of 20 s: a silent network that heals finds the channel
        connecting again at once."""
        connect_ms = max(1000, int(self.per_try * 1000))
        return [
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.max_receive_message_length", 64 * 1024 * 1024),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 1000),
            ("grpc.min_reconnect_backoff_ms", connect_ms),
        ]

    def credentials(self) -> Any:
        import grpc

        return grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert
        )


def _timeout(raw: Any) -> float:
    return duration(raw, "timeout (the bound on one etcd store call)", positive=True, text=True)


def _read(path: Any, what: str) -> bytes:
    try:
        return Path(str(path)).read_bytes()
    except OSError as exc:
        raise ConfigurationError(f"cannot read the etcd {what} file {path!r}: {exc}") from exc


def parse(url: str, options: dict[str, Any]) -> Config:
    """``etcd://[user:password@]host:port[,host:port...][?timeout=&prefix=]`` or
    ``etcds://`` (TLS; ``ca=``, ``cert=``, ``key=`` file paths)."""
    if not isinstance(url, str):
        raise ConfigurationError(f"an etcd URL must be a str, got {type(url).__name__}")
    scheme, sep, rest = url.partition("://")
    scheme = scheme.lower()
    if not sep or scheme not in ("etcd", "etcds"):
        raise ConfigurationError(
            f"{redact(url)!r} is not an etcd URL; write etcd://host:port[,host:port...] "
            "or etcds:// for TLS"
        )
    # Else its endpoints, path or options would be pieces of the password.
    refuse_unencoded_password(url, "etcd URL")
    rest, _, _ = rest.partition("#")
    netloc, _, query_s = rest.partition("?")
    netloc, _, path = netloc.partition("/")
    if path.strip("/"):
        raise ConfigurationError(
            f"an etcd URL has no path; use ?prefix= for a key prefix, in {redact(url)!r}"
        )
    userinfo, at, hosts = netloc.rpartition("@")
    values: dict[str, Any] = {}
    try:
        values.update(parse_qsl(query_s, keep_blank_values=True, strict_parsing=bool(query_s)))
    except ValueError as exc:
        # Not chained: the ValueError quotes the query, secrets and all.
        raise ConfigurationError(
            f"cannot parse the options of {redact(url)!r}: {scrub(str(exc), url)}; write "
            "them name=value&name=value"
        ) from None
    if at:
        name, colon, secret = userinfo.partition(":")
        values.setdefault("user", unquote(name))
        if colon:
            values.setdefault("password", unquote(secret))
    for name, value in options.items():
        values[name] = value
    unknown = sorted(set(values) - set(OPTIONS))
    if unknown:
        raise ConfigurationError(
            f"unknown option(s) {', '.join(unknown)} for the etcd store ({redact(url)!r}); "
            f"accepted: {', '.join(OPTIONS)}"
        )
    endpoints = []
    for item in hosts.split(","):
        item = item.strip()
        if not item:
            continue
        host, _, port = item.rpartition(":") if not item.endswith("]") else (item, "", "")
        if not host:
            host, port = port, ""
        port = port or "2379"
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigurationError(
                f"bad etcd endpoint {item!r} in {redact(url)!r}; write host:port[,host:port...]"
            )
        endpoints.append(f"{host}:{int(port)}")
    if not endpoints:
        raise ConfigurationError(f"etcd URL {redact(url)!r} names no endpoint")
    tls = scheme == "etcds"
    if not tls and any(values.get(k) for k in ("ca", "cert", "key")):
        raise ConfigurationError("ca=, cert= and key= need an etcds:// (TLS) URL")
    if ("cert" in values) != ("key" in values):
        raise ConfigurationError("a client certificate needs both cert= and key=")
    prefix = values.get("prefix", "idemlock/")
    if not isinstance(prefix, str) or not prefix:
        raise ConfigurationError(f"prefix must be a non-empty str, got {prefix!r}")
    user = values.get("user") or None
    password = values.get("password")
    if user is not None and password is None:
        raise ConfigurationError("etcd user given without a password (user:password@host)")
    return Config(
        endpoints=tuple(endpoints),
        tls=tls,
        timeout=_timeout(values.get("timeout", DEFAULT_TIMEOUT)),
        root=prefix.encode("utf-8"),
        user=user,
        password=None if password is None else str(password),
        ca=_read(values["ca"], "CA") if values.get("ca") else None,
        cert=_read(values["cert"], "certificate") if values.get("cert") else None,
        key=_read(values["key"], "key") if values.get("key") else None,
    )


# ---- errors ------------------------------------------------------------------------------

#: what the driver does with a failed attempt
RETRY, REAUTH, FAIL = "retry", "reauth", "fail"


def classify(exc: Any) -> str:
    """RETRY: ask again, maybe another member (the outcome of a write is unknown);
    REAUTH: the auth token expired; FAIL: an answer, not a transient fault."""
    import grpc

    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return RETRY
    if code == grpc.StatusCode.UNAUTHENTICATED or "invalid auth token" in details:
        return REAUTH
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "too many requests" in details:
        return RETRY
    # A member's own request timeout ("context deadline exceeded" when its apply wait
    # runs out on a loaded server) leaves the outcome unknown, like a lost reply.
    if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN) and (
        "leader" in details
        or "timed out" in details
        or "stopped" in details
        or "deadline exceeded" in details
    ):
        return RETRY
    return FAIL


def error(exc: Any, what: str, endpoint: str) -> Exception:
    """The idemlock error for a gRPC failure (the caller chains ``exc``)."""
    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else str(exc)) or str(exc)
    name = getattr(code, "name", type(exc).__name__)
    if "database space exceeded" in details:
        return StoreFull(
            f"etcd {what}: the etcd database is full (its space quota is exceeded): "
            "compact and defragment it, or raise --quota-backend-bytes"
        )
    if "permission denied" in details or name == "PERMISSION_DENIED":
        return StoreUnavailable(
            f"etcd {what} at {endpoint}: permission denied; grant the user read-write on "
            f"the store's key prefix ({details})"
        )
    if "authentication failed" in details:
        return StoreUnavailable(
            f"etcd {what} at {endpoint}: authentication failed (check user and password)"
        )
    return StoreUnavailable(f"etcd {what} at {endpoint} failed: {name}: {details}")


def no_answer(method: str, timeout: float, last: Exception | None) -> StoreUnavailable:
    """The error of a call that got no answer within the store's timeout (``last``: the
    failure of its last try, if any)."""
    why = f": {last}" if last is not None else ""
    return StoreUnavailable(
        f"etcd {method}: no answer within the store's timeout of {timeout}s{why}"
    )
