"""The Idempotency-Key steps of :mod:`.core` on a blocking server (WSGI, Django).

:class:`SyncHttp` drives :class:`~.core.HttpCore` over a blocking
:class:`idemlock.Coordinator`: each step is a coroutine whose awaits reach only
blocking store calls, so it runs to its end without an event loop. A framework adapter
builds an ASGI-like ``scope`` (``method``, ``path``, ``query_string``, ``headers`` as
lowercase byte pairs), calls :meth:`SyncHttp.begin`, and then sends the
:class:`~.problem_json.Answer` it got, lets the request pass untouched
(:class:`~.core.Pass`), or runs its handler on the :class:`~.core.Run` and hands the
response to :meth:`SyncHttp.finish` (or calls :meth:`SyncHttp.fail` if it raised).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, TypeVar, cast

from ... import _attempts as attempts
from ..._core.types import Claim, ClaimToken
from ..._errors import ConfigurationError, ResultTooLarge
from ..._sync import Coordinator, IdempotencyPort
from .core import HttpCore, Pass, Run, StoreFace
from .options import HttpOptions, Scope
from .problem_json import Answer

__all__ = ["SyncHttp", "TransactionFailed"]

T = TypeVar("T")

#: bytes read from a request body per step
_CHUNK = 64 * 1024

#: the caller's open transaction (a psycopg connection) in which to record a response
_TX: contextvars.ContextVar[Any] = contextvars.ContextVar("idemlock_http_tx", default=None)


def _drive(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine that never suspends (its awaits reach only blocking calls)."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return cast(T, stop.value)
    coro.close()
    raise RuntimeError("an idemlock HTTP step suspended on a blocking server")  # pragma: no cover


class TransactionFailed(BaseException):
    """Recording in the caller's transaction failed (``cause``): the transaction must
    roll back. A BaseException so the steps' store-failure handling, which keeps the
    claim and records later outside the transaction, does not apply."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(cause)
        self.cause = cause


class BlockingPortFace(StoreFace):
    """A blocking port as the steps' store: each coroutine makes its blocking call and
    returns without suspending."""

    port: IdempotencyPort

    def __init__(self, port: IdempotencyPort) -> None:
        self.port = port

    async def claim(self, key: str, payload: Any) -> tuple[Claim, float]:
        return attempts.begin(self.port, key, payload, None)

    async def complete(self, token: ClaimToken, result: Any) -> None:
        conn = _TX.get()
        if conn is None:
            self.port.complete(token, result)
            return
        from ...stores.postgres.fenced import complete_in_transaction

        try:
            complete_in_transaction(conn, self.port, token, result)
        except ResultTooLarge:
            raise  # refused before any SQL: the steps record it as not replayable
        except Exception as exc:
            raise TransactionFailed(exc) from exc

    async def abandon(self, token: ClaimToken) -> None:
        self.port.abandon(token)

    def later(self, job: Callable[[], Coroutine[Any, Any, None]]) -> None:
        # No event loop on a blocking server: the retry loop runs in its own thread.
        threading.Thread(
            target=asyncio.run, args=(job(),), name="idemlock-http-record", daemon=True
        ).start()


class SyncHttp:
    """The Idempotency-Key table on a blocking :class:`idemlock.Coordinator`; the
    options are :class:`~.core.HttpOptions` (``identity`` is the adapter's: it passes
    the caller's identity to :meth:`begin`)."""

    def __init__(self, coordinator: Coordinator, *, has_identity: bool, **options: Any) -> None:
        opts = HttpOptions.of(options)
        if not isinstance(coordinator, Coordinator):
            raise ConfigurationError(
                "the WSGI/Django idempotency middleware needs a blocking idemlock.Coordinator "
                f"(idemlock.connect(...)), got {type(coordinator).__name__}"
            )
        self.port = coordinator.idempotency(opts.spec)
        self.core = HttpCore(BlockingPortFace(self.port), opts, has_identity=has_identity)
        self.max_body = opts.max_body
        self.max_response_body = opts.max_response_body

    def covers(self, scope: Scope) -> bool:
        """Whether a request of this method and path is subject to the header."""
        return self.core.covers(scope)

    def begin(
        self,
        scope: Scope,
        identity: Callable[[], str | None],
        read: Callable[[int], bytes],
    ) -> Answer | Pass | Run:
        """Decide a request. ``identity`` is called once the key is valid; ``read(n)``
        returns up to n body bytes (b"" at the end) and is called only for keyed
        requests."""
        core = self.core
        headers = list(scope.get("headers") or ())
        key = core.key_of(headers)
        if key is None:
            return Pass()
        if isinstance(key, Answer):
            return key
        ident = identity()
        refused = core.refuse_identity(ident)
        if refused is not None:
            return refused
        if core.declared_too_large(headers):
            return core.problems.too_large()
        chunks: list[bytes] = []
        size = 0
        while chunk := read(_CHUNK):
            size += len(chunk)
            if size > self.max_body:
                return core.problems.too_large()
            chunks.append(chunk)
        return _drive(core.claim(scope, ident, key, b"".join(chunks)))

    def finish(
        self,
        run: Run,
        status: int,
        headers: Iterable[tuple[bytes, bytes]],
        transaction: Any = None,
    ) -> None:
        """Record (or abandon) the handler's response, whose body was added to
        ``run.copy``, before its last bytes go out. With ``transaction`` (a psycopg
        connection inside the caller's open transaction, on the PostgreSQL store's
        database) the record is written in that transaction; then
        :class:`TransactionFailed` means: roll back, then :meth:`abandon`."""
        if run.settled:
            return
        run.start(status, headers)
        reset = _TX.set(transaction)
        try:
            _drive(self.core.settle(run))
        finally:
            _TX.reset(reset)

    def relay(self, run: Run, chunks: Iterable[Any], record: Callable[[], None]) -> Iterator[bytes]:
        """Pass a streamed body on as bytes, copying it into ``run.copy``, and call
        ``record()`` (which finishes the run) before the last chunk leaves: a client that
        has its whole response and retries at once finds the record, never a 409. A
        stream that breaks (the handler raised, or the client went away: GeneratorExit)
        fails the run."""
        try:
            held: bytes | None = None
            for chunk in chunks:
                if held is not None:
                    yield held
                held = bytes(chunk)
                run.copy.add(held)
            record()
            if held is not None:
                yield held
        except BaseException:
            self.fail(run)
            raise

    def abandon(self, run: Run) -> None:
        """Abandon the claim even though its response was settled (its record was
        rolled back with the caller's transaction)."""
        run.settled = True
        _drive(self.core.abandon(run.token))

    def fail(self, run: Run) -> None:
        """The handler raised or gave up without a whole response: abandon the claim."""
        _drive(self.core.fail(run))
