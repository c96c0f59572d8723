"""The etcd store's calls over etcd's HTTP/JSON gateway, for a process forked from one
that used gRPC (agreement A6).

gRPC's core library is not fork-safe: a child of a process that made channels (its
threads, pollers and locks copied mid-flight) can crash or hang in its first call.
So after ``os.fork()`` the child never touches gRPC again: it sends the very same
request messages as JSON to etcd's gateway (``POST /v3/kv/txn`` ..., on the client
port, enabled by default) with Python's own ``http.client``, and watches keys with
``POST /v3/watch`` streams, one thread each. Same ops, same answers; slower (one
HTTP connection per call), which only a forked child pays.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import socket
import ssl
import threading
import time
from typing import Any

from google.protobuf import json_format

from ..._errors import StoreUnavailable
from ..._logfields import fields as log_fields
from .._local import LocalSubscription
from . import _conf
from ._ops import Rpc
from ._pb.etcdserverpb import rpc_pb2 as _rpc_pb2

log = logging.getLogger("idemlock")

pb: Any = _rpc_pb2

PATHS: dict[str, tuple[str, Any]] = {
    "Range": ("/v3/kv/range", pb.RangeResponse),
    "Txn": ("/v3/kv/txn", pb.TxnResponse),
    "DeleteRange": ("/v3/kv/deleterange", pb.DeleteRangeResponse),
    "Put": ("/v3/kv/put", pb.PutResponse),
    "LeaseGrant": ("/v3/lease/grant", pb.LeaseGrantResponse),
    "LeaseRevoke": ("/v3/lease/revoke", pb.LeaseRevokeResponse),
    "LeaseTimeToLive": ("/v3/lease/timetolive", pb.LeaseTimeToLiveResponse),
    "Authenticate": ("/v3/auth/authenticate", pb.AuthenticateResponse),
}

#: gRPC status codes (as the gateway reports them) worth another attempt
_RETRY_CODES = {4, 14}  # DEADLINE_EXCEEDED, UNAVAILABLE
_AUTH_CODES = {16}  # UNAUTHENTICATED


class _Failed(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _body(msg: Any) -> bytes:
    text: str = json_format.MessageToJson(msg, preserving_proto_field_name=True, indent=None)
    return text.encode()


class GatewayClient:
    """Unary calls as HTTP POSTs, with the same deadline and failover rules as the
    gRPC clients."""

    def __init__(self, conf: _conf.Config) -> None:
        self.conf = conf
        self._current = 0
        self._token: str | None = None
        self._ssl: ssl.SSLContext | None = None
        if conf.tls:
            ctx = ssl.create_default_context()
            if conf.ca:
                ctx.load_verify_locations(cadata=conf.ca.decode())
            if conf.cert and conf.key:
                import os
                import tempfile

                with tempfile.TemporaryDirectory() as tmp:
                    c, k = os.path.join(tmp, "c.pem"), os.path.join(tmp, "k.pem")
                    with open(c, "wb") as f:
                        f.write(conf.cert)
                    with open(k, "wb") as f:
                        f.write(conf.key)
                    ctx.load_cert_chain(c, k)
            self._ssl = ctx

    def connection(self, timeout: float) -> tuple[http.client.HTTPConnection, str]:
        endpoint = self.conf.endpoints[self._current % len(self.conf.endpoints)]
        host, _, port = endpoint.rpartition(":")
        host = host.strip("[]")
        if self._ssl is not None:
            return http.client.HTTPSConnection(
                host, int(port), timeout=timeout, context=self._ssl
            ), endpoint
        return http.client.HTTPConnection(host, int(port), timeout=timeout), endpoint

    def failover(self) -> None:
        self._current += 1

    def headers(self, deadline: float) -> dict[str, str]:
        out = {"Content-Type": "application/json"}
        if self.conf.user is not None:
            if self._token is None:
                req = pb.AuthenticateRequest(name=self.conf.user, password=self.conf.password or "")
                resp = self._post(
                    "Authenticate", req, deadline, {"Content-Type": "application/json"}
                )
                self._token = str(resp.token)
            out["Authorization"] = self._token
        return out

    def _post(self, method: str, request: Any, deadline: float, headers: dict[str, str]) -> Any:
        path, reply = PATHS[method]
        left = max(0.001, min(deadline - time.monotonic(), self.conf.try_timeout(0, 1e9)))
        conn, _ = self.connection(left)
        try:
            conn.request("POST", path, body=_body(request), headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if resp.status != 200:
            try:
                err = json.loads(data)
            except ValueError:
                err = {}
            code = int(err.get("code", 14 if resp.status >= 500 else 2))
            raise _Failed(code, str(err.get("message") or err.get("error") or resp.reason))
        return json_format.Parse(data, reply(), ignore_unknown_fields=True)

    def call(self, rpc: Rpc, deadline: float) -> Any:
        attempt = 0
        last: Exception | None = None
        while True:
            if deadline - time.monotonic() <= 0:
                raise _conf.no_answer(rpc.method, self.conf.timeout, last) from last
            try:
                return self._post(rpc.method, rpc.request, deadline, self.headers(deadline))
            except _Failed as exc:
                if exc.code in _AUTH_CODES or "invalid auth token" in exc.message:
                    self._token = None
                    last = StoreUnavailable(f"etcd {rpc.method}: {exc.message}")
                    if attempt > 2:
                        raise last from exc
                elif exc.code in _RETRY_CODES:
                    last = StoreUnavailable(f"etcd {rpc.method}: {exc.message}")
                    rpc.retried = True
                    self.failover()
                else:
                    raise StoreUnavailable(f"etcd {rpc.method} failed: {exc.message}") from exc
            except (TimeoutError, OSError, http.client.HTTPException) as exc:
                last = StoreUnavailable(f"etcd {rpc.method}: {type(exc).__name__}: {exc}")
                rpc.retried = True
                self.failover()
            attempt += 1
            time.sleep(min(0.2, 0.01 * 2**attempt, max(0.0, deadline - time.monotonic())))

    def background(self, rpc: Rpc) -> None:
        def send() -> None:
            try:
                self.call(rpc, time.monotonic() + self.conf.timeout)
            except Exception:  # a cleanup: the lease ends by itself anyway
                return

        threading.Thread(target=send, name="idemlock-etcd-gw", daemon=True).start()


# ---- watches ---------------------------------------------------------------------------------


def json_wakes(quiet: str | None, events: list[Any] | None) -> bool:
    """As _watches.wakes, on a watch reply's JSON events (a put's type is left out, a
    key is base64): ``quiet`` is the base64 key whose puts wake nobody."""
    if quiet is None:
        return bool(events)
    return any(
        ev.get("type", "PUT") != "PUT" or ev.get("kv", {}).get("key") != quiet
        for ev in events or ()
    )


class _Watch:
    """One ``POST /v3/watch`` stream for one key range, read by a daemon thread."""

    def __init__(
        self, client: GatewayClient, key: bytes, end: bytes, no_put: bool, quiet: bytes | None
    ) -> None:
        self.client = client
        self.key, self.end, self.no_put = key, end, no_put
        #: a key whose puts wake nobody (see _watches.quiet_key)
        self.quiet = None if quiet is None else base64.b64encode(quiet).decode()
        self.lock = threading.Lock()
        self.subs: set[LocalSubscription] = set()
        self.created = threading.Event()
        self.closed = False
        self.conn: http.client.HTTPConnection | None = None
        threading.Thread(target=self._run, name="idemlock-etcd-gw-watch", daemon=True).start()

    def _fire(self) -> None:
        with self.lock:
            for s in self.subs:
                s._fire()

    def remove(self, sub: LocalSubscription) -> None:
        with self.lock:
            self.subs.discard(sub)
            if self.subs:
                return
            self.closed = True
            conn = self.conn
        if conn is not None:
            try:
                sock = conn.sock
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # already closed by the peer: closing is all that was asked

    def _run(self) -> None:
        filters = [pb.WatchCreateRequest.NOPUT] if self.no_put else []
        req = pb.WatchRequest(
            create_request=pb.WatchCreateRequest(key=self.key, range_end=self.end, filters=filters)
        )
        backoff = 0.05
        while not self.closed:
            try:
                conn, _ = self.client.connection(timeout=15.0)
                self.conn = conn
                headers = self.client.headers(time.monotonic() + self.client.conf.timeout)
                conn.request("POST", "/v3/watch", body=_body(req), headers=headers)
                resp = conn.getresponse()
                while not self.closed:
                    line = resp.readline()
                    if not line:
                        break
                    try:
                        result = json.loads(line).get("result", {})
                    except ValueError:
                        continue
                    if result.get("created"):
                        self.created.set()
                    if json_wakes(self.quiet, result.get("events")) or result.get("canceled"):
                        self._fire()
                    backoff = 0.05
            except Exception:
                # The watch is only a hint: waiters re-check the store, so a broken
                # stream is logged and opened again on the next member.
                log.debug(
                    "etcd watch stream ended; reconnecting",
                    exc_info=True,
                    extra=log_fields(store="etcd", operation="watch", outcome="reconnect"),
                )
            self.created.clear()
            self._fire()  # something may have been missed: waiters re-check
            if self.closed:
                return
            self.client.failover()
            time.sleep(backoff)
            backoff = min(1.0, backoff * 2)


class GatewayWatcher:
    """Watches over the gateway, one stream per watched range."""

    def __init__(self, client: GatewayClient) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._watches: dict[tuple[bytes, bytes, bool], _Watch] = {}

    def subscribe(
        self, key: bytes, end: bytes, no_put: bool, quiet: bytes | None = None
    ) -> LocalSubscription:
        with self._lock:
            w = self._watches.get((key, end, no_put))
            if w is None or w.closed:
                w = _Watch(self.client, key, end, no_put, quiet)
                self._watches[(key, end, no_put)] = w
            with w.lock:
                sub = LocalSubscription(w.lock, w.remove)
                w.subs.add(sub)
        w.created.wait(min(1.0, self.client.conf.timeout))
        return sub
