"""Duplicate sends, for any queue: ``enqueue_once`` takes a send lease on the job's key
(refused while the key is queued or running), and the job releases it when it runs.
A job lost before it ran frees its key when that lease ends."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

from ..._core.types import IdempotencySpec, LockSpec
from ..._errors import StoreFull, StoreUnavailable
from ..._logfields import fields as log_fields
from ..._sync import Coordinator
from .options import spec_name

log = logging.getLogger("idemlock.jobs")

#: store failures before the body that make a job come back later
STORE_ERRORS = (StoreUnavailable, StoreFull)

T = TypeVar("T")


def send_lock_spec(spec: IdempotencySpec | str, lease: float) -> LockSpec:
    return LockSpec(f"{spec_name(spec)}.send", ttl=timedelta(seconds=lease))


def reserve_send(
    coord: Coordinator, spec: IdempotencySpec | str, key: str, owner: str, lease: float
) -> bool:
    """Take the send lease of ``key`` for the job ``owner``; False when the key is
    queued (another send holds its lease) or running (its claim is in flight)."""
    status = coord.idempotency(spec).status(key)
    if status is not None and status.state == "in_flight":
        return False
    held = coord.lock(send_lock_spec(spec, lease)).acquire(key, owner=owner)
    return held is not None and held.owner == owner


def free_send(
    coord: Coordinator, spec: IdempotencySpec | str, key: str, owner: str, lease: float
) -> None:
    """Release the send lease ``owner`` took (if it still holds it)."""
    port = coord.lock(send_lock_spec(spec, lease))
    try:
        held = port.acquire(key, owner=owner)
        if held is not None:
            port.release(held)
    except STORE_ERRORS as exc:
        _not_released(spec, exc)


def send_under_lease(
    coord: Coordinator,
    spec: IdempotencySpec | str,
    key: str,
    owner: str,
    lease: float,
    send: Callable[[], T],
) -> T | None:
    """``send()`` under the send lease of ``key`` (None, nothing sent, when the key is
    queued or running); a send that fails releases the lease it took."""
    if not reserve_send(coord, spec, key, owner, lease):
        return None
    try:
        return send()
    except BaseException:
        free_send(coord, spec, key, owner, lease)
        raise


async def areserve_send(
    coord: Any, spec: IdempotencySpec | str, key: str, owner: str, lease: float
) -> bool:
    """:func:`reserve_send` on an AsyncCoordinator."""
    status = await coord.idempotency(spec).status(key)
    if status is not None and status.state == "in_flight":
        return False
    held = await coord.lock(send_lock_spec(spec, lease)).acquire(key, owner=owner)
    return held is not None and bool(held.owner == owner)


async def afree_send(
    coord: Any, spec: IdempotencySpec | str, key: str, owner: str, lease: float
) -> None:
    """:func:`free_send` on an AsyncCoordinator."""
    port = coord.lock(send_lock_spec(spec, lease))
    try:
        held = await port.acquire(key, owner=owner)
        if held is not None:
            await port.release(held)
    except STORE_ERRORS as exc:
        _not_released(spec, exc)


async def asend_under_lease(
    coord: Any,
    spec: IdempotencySpec | str,
    key: str,
    owner: str,
    lease: float,
    send: Callable[[], Awaitable[T | None]],
) -> T | None:
    """:func:`send_under_lease` on an AsyncCoordinator; ``send()`` returning None (the queue
    refused the job) releases the lease too."""
    if not await areserve_send(coord, spec, key, owner, lease):
        return None
    sent: T | None = None
    try:
        sent = await send()
    finally:
        if sent is None:
            await afree_send(coord, spec, key, owner, lease)
    return sent


def _not_released(spec: IdempotencySpec | str, exc: BaseException) -> None:
    # It ends with its lease: a duplicate is refused until then at worst.
    log.warning(
        "could not release a send lease (%s)",
        exc,
        extra=log_fields(spec=spec_name(spec), operation="release", outcome="error", kind="lock"),
    )
