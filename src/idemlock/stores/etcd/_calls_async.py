"""How the asyncio etcd client calls: :func:`drive` runs an op of :mod:`._ops` to its
end, and :class:`AsyncCalls` makes each of its calls within the store's deadline,
authenticated, failing over to another member when one does not answer. The source
of :mod:`._calls_sync`, which tools/async_to_sync.py generates from it; the channels
themselves are made in :mod:`._grpc_aio` and :mod:`._grpc_sync`."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import grpc

from ..._errors import IdemlockError
from . import _conf
from ._ops import WRITES, Op, Rpc
from ._pb.etcdserverpb import rpc_pb2 as _rpc_pb2

if TYPE_CHECKING:
    from ._grpc_sync import _Stubs

pb: Any = _rpc_pb2  # generated without type information


class AsyncCalls:
    """The calls of a client that has ``conf``, ``_token`` (None until authenticated),
    ``stubs()`` (the current endpoint's), ``failover(seen)`` and ``background(rpc)``."""

    conf: _conf.Config
    _token: str | None

    if TYPE_CHECKING:

        def stubs(self) -> _Stubs: ...

        def failover(self, seen: _Stubs) -> None: ...

        def background(self, rpc: Rpc) -> None: ...

    async def pause(self, seconds: float) -> None:
        """The wait before the next attempt."""
        await asyncio.sleep(seconds)

    async def metadata(self, s: _Stubs, deadline: float) -> tuple[tuple[str, str], ...] | None:
        if self.conf.user is None:
            return None
        token = self._token
        if token is None:
            left = deadline - time.monotonic()
            resp = await s.methods["Authenticate"](
                pb.AuthenticateRequest(name=self.conf.user, password=self.conf.password or ""),
                timeout=max(0.01, min(left, self.conf.per_try)),
            )
            token = self._token = str(resp.token)
        return (("token", token),)

    async def call(self, rpc: Rpc, deadline: float) -> Any:
        attempt = 0
        last: Exception | None = None
        while True:
            s = self.stubs()
            left = deadline - time.monotonic()
            if left <= 0:
                raise _conf.no_answer(rpc.method, self.conf.timeout, last) from last
            try:
                md = await self.metadata(s, deadline)
                return await s.methods[rpc.method](
                    rpc.request, timeout=self.conf.try_timeout(attempt, left), metadata=md
                )
            except grpc.RpcError as exc:  # grpc.aio.AioRpcError is one
                action = _conf.classify(exc)
                if action == _conf.FAIL:
                    raise _conf.error(exc, rpc.method, s.endpoint) from exc
                last = _conf.error(exc, rpc.method, s.endpoint)
                if action == _conf.REAUTH:
                    self._token = None
                    if attempt > 2:
                        raise last from exc
                elif rpc.method in WRITES:
                    rpc.retried = True
                self.failover(s)
                attempt += 1
                await self.pause(min(0.2, 0.01 * 2**attempt, max(0.0, deadline - time.monotonic())))


async def drive(client: Any, op: Op) -> Any:
    """Run an op to its end: each Rpc it yields is one bounded call."""
    deadline = time.monotonic() + client.conf.timeout
    value: Any = None
    error: BaseException | None = None
    while True:
        try:
            rpc = op.throw(error) if error is not None else op.send(value)
        except StopIteration as stop:
            return stop.value
        error, value = None, None
        if rpc.background:
            client.background(rpc)
            continue
        try:
            value = await client.call(rpc, deadline)
        except IdemlockError as exc:
            error = exc
