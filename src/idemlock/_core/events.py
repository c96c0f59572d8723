"""The one hook interface: every outcome becomes an :class:`Event` passed to each hook.

Events carry the spec name, the store kind, the outcome and the duration; never the
key or the payload (metrics stay low-cardinality and private). With no hook
registered nothing is built or timed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import table

#: event name -> the outcomes it can have; derived from the state table's reply
#: vocabulary (``table.EVENT_OUTCOMES`` plus the coordinator's own outcomes)
EVENTS: dict[str, tuple[str, ...]] = table.events()

#: (operation, accepted?) -> outcome, for the calls a store accepts or refuses
_ANSWERED: dict[tuple[str, bool], str] = {
    (op, name == table.OK.name): out
    for (op, name), out in table.EVENT_OUTCOMES.items()
    if name in (table.OK.name, table.STALE.name)
}


def answered(op: str, ok: bool) -> str:
    """The outcome of a complete, abandon, release, renew or break that the store
    accepted (``ok``) or refused, as the table names it."""
    return _ANSWERED[(op, ok)]


@dataclass(frozen=True, slots=True)
class Event:
    """One outcome. ``duration`` is in seconds (for ``acquire`` it includes waiting);
    ``kind`` is ``"idempotency"``, ``"lock"``, ``"semaphore"`` or ``"election"``. A store
    call that raised (the store down, a timeout) has outcome ``"error"`` and ``error``,
    the exception's type name (``"StoreUnavailable"``); ``error`` is None for every
    other outcome. ``token`` is the fencing token (an election's term number) of the
    lease an ``acquire`` granted or a ``release`` or ``lost`` ends; None for every other
    event. A semaphore's or election's acquire whose first attempt was refused emits
    ``wait`` ``started``, then ``wait`` ``ended`` (its ``duration`` the wait) once it is
    over, however: granted, timed out, failed or cancelled."""

    name: str
    outcome: str
    kind: str
    spec: str
    store: str
    duration: float
    tenant: str | None = None
    error: str | None = None
    token: int | None = None


Hook = Callable[[Event], None]
