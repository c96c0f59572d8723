"""The one hook interface: every outcome becomes an :class:`Event` passed to each hook.

Events carry the spec name, the store kind, the outcome and the duration; never the
key or the payload (metrics stay low-cardinality and private). With no hook
registered nothing is built or timed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: event name -> the outcomes it can have
EVENTS: dict[str, tuple[str, ...]] = {
    "claim": ("claimed", "in_flight", "replayed", "mismatch", "error"),
    "complete": ("ok", "stale", "error"),
    "abandon": ("ok", "stale", "error"),
    "acquire": ("acquired", "waited", "timeout", "error"),
    "release": ("ok", "not_held", "error"),
    "renew": ("ok", "failed", "error"),
    "break": ("broken", "not_held", "error"),
    "lost": ("lost",),
}


@dataclass(frozen=True, slots=True)
class Event:
    """One outcome. ``duration`` is in seconds (for ``acquire`` it includes waiting);
    ``kind`` is ``"idempotency"`` or ``"lock"``. A store call that raised (the store
    down, a timeout) has outcome ``"error"`` and ``error``, the exception's type name
    (``"StoreUnavailable"``); ``error`` is None for every other outcome."""

    name: str
    outcome: str
    kind: str
    spec: str
    store: str
    duration: float
    tenant: str | None = None
    error: str | None = None


Hook = Callable[[Event], None]
