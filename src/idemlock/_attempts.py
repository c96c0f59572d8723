"""The internal API for code that drives one attempt itself instead of through
``@port.idempotent``: the Celery task, ``idemlock run --once`` and PostgreSQL's
``complete_in_transaction`` and ``record_step_in_transaction``.

An attempt is *begun* (claimed, maybe waiting while another attempt is in flight),
kept alive by a heartbeat while its work runs, then *recorded* (its result, or a
listed exception, stored for replay) or *failed* (abandoned, so a retry runs it).
These functions are the only way such code touches a port's internals: the ports
keep their fields private and may change them freely as long as these keep their
meaning. They emit the same events as the public methods.

The functions that call the store take a blocking :class:`~idemlock.IdempotencyPort`
(:func:`abegin` is :func:`begin` for an async port); the others do no I/O and take
either face.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ._core.types import Claim, Claimed, ClaimToken, Completed
from ._errors import ConfigurationError

if TYPE_CHECKING:
    from ._base.idempotency import AttemptBase, Heartbeat, IdempotencyBase
    from ._core.clock import Clock
    from ._decorator import WrapPlan
    from ._sync import IdempotencyPort
    from .aio import AsyncIdempotencyPort

__all__ = [
    "abandon_quietly",
    "abegin",
    "begin",
    "begin_call",
    "clock",
    "completion",
    "default_wait",
    "fail",
    "heartbeat_every",
    "keep_alive",
    "record",
    "stale",
    "step_in_transaction",
    "step_store",
    "stepped_in_transaction",
]


def begin(port: IdempotencyPort, key: str, payload: Any, wait: float | None) -> tuple[Claim, float]:
    """Claim ``key`` (waiting up to ``wait`` seconds while in flight elsewhere; None:
    not at all): the outcome, and the clock's monotonic time its last request was
    sent, from which :func:`keep_alive` counts the claim's local deadline. A recorded
    result is returned undecoded by any declared type."""
    return port._claim_at(key, payload, wait)


async def abegin(
    port: AsyncIdempotencyPort, key: str, payload: Any, wait: float | None
) -> tuple[Claim, float]:
    """:func:`begin` on an async port."""
    return await port._claim_at(key, payload, wait)


def clock(port: IdempotencyBase) -> Clock:
    """The clock of the port's coordinator (the store's, or the one given)."""
    return port._coord.clock


def begin_call(
    port: IdempotencyPort, plan: WrapPlan, args: Any, kwargs: Any, wait: float | None
) -> tuple[Claimed | Completed, float]:
    """:func:`begin` for a call of ``plan``'s function: its key and payload come from
    the arguments, a recorded result is decoded by its return type, and a claim in
    flight raises :class:`~idemlock.InFlightError`."""
    return port._begin_at(plan, args, kwargs, wait)


def default_wait(port: IdempotencyPort) -> float:
    """How long ``on_in_flight="wait"`` waits when no wait is given: one lease."""
    return port._wait_for(None)


def heartbeat_every(port: IdempotencyBase, renew_every: timedelta | float | None) -> float:
    """The renewal interval (a third of the lease unless given; checked against it)."""
    return port._heartbeat_every(renew_every)


def keep_alive(
    port: IdempotencyBase,
    token: ClaimToken,
    sent: float,
    every: float,
    max_run: float | None = None,
    on_lost: Callable[[ClaimToken], object] | None = None,
) -> Heartbeat:
    """Renew ``token``'s claim every ``every`` seconds until ``Heartbeat.stop()``
    (at most ``max_run`` seconds); ``on_lost(token)`` runs if it is lost."""
    return port._heartbeat(token, sent, every, max_run, on_lost)


def record(
    port: IdempotencyPort,
    plan: WrapPlan,
    token: ClaimToken,
    result: Any,
    beat: Heartbeat | None = None,
) -> None:
    """Record ``result`` (encoded by ``plan``'s return type). Raises
    :class:`~idemlock.StaleClaim` if the claim no longer holds its key, or
    :class:`~idemlock.ClaimLost` when ``beat`` saw it lost; an unencodable result
    abandons the claim and raises."""
    port._record_beat(plan, token, result, beat)


def fail(port: IdempotencyPort, plan: WrapPlan, token: ClaimToken, exc: BaseException) -> None:
    """The work raised ``exc``: record it for replay when ``plan`` lists its type in
    ``replay_errors``, otherwise abandon the claim so a retry runs again."""
    port._fail(plan, token, exc)


def abandon_quietly(port: IdempotencyPort, token: ClaimToken) -> None:
    """Abandon the claim; a store error is logged, not raised (the lease frees the key
    anyway, and the caller's own error matters more)."""
    port._abandon_quietly(token)


def completion(
    port: IdempotencyBase, token: ClaimToken, result: Any
) -> tuple[Any, tuple[str, str, str, bytes, int]]:
    """(the port's store, the arguments of its ``complete``) for recording ``result``
    on ``token``'s claim: the key and result in their stored form (keyring, sealing,
    result format) exactly as ``port.complete`` builds them."""
    return port._completion(token, result)


def stale(port: IdempotencyBase, token: ClaimToken, what: str) -> Exception:
    """The :class:`~idemlock.StaleClaim` for a ``what`` ("complete", ...) the store
    refused because the claim no longer holds its key."""
    return port._replies.stale(token, what)


def step_store(attempt: AttemptBase) -> Any:
    """The store that records the steps of ``attempt``; ``ConfigurationError`` for a
    replayed attempt, a store without steps, or anything but an attempt."""
    from ._base.idempotency import AttemptBase

    if not isinstance(attempt, AttemptBase):
        raise ConfigurationError(
            f"expected the attempt of `with port.run(key) as attempt:`, got "
            f"{type(attempt).__name__}"
        )
    return attempt._steps_port()._store


def step_in_transaction(
    attempt: AttemptBase, name: str, value: Any
) -> tuple[tuple[Any, ...], bytes]:
    """(the arguments of the store's ``step``, the encoded value) for recording
    ``value`` as step ``name`` in a transaction of the caller's, encoded exactly as
    ``attempt.step`` encodes it. Raises what ``attempt.step`` would before
    writing (``DuplicateStep``, ``ResultTooLarge``, ``ClaimLost``), and
    ``DuplicateStep`` for a step an earlier attempt recorded."""
    return attempt._txn_step(name, value)


def stepped_in_transaction(
    attempt: AttemptBase, name: str, expires: int | None, data: bytes
) -> None:
    """After the step statement ran in the caller's transaction (``expires``: its
    reply, None when refused): ``ClaimLost`` if refused; else ``attempt.step(name)``
    replays it once that transaction committed."""
    attempt._txn_stepped(name, expires, data)
