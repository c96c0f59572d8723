"""What the Celery integration reads from and writes into task messages and requests
(headers of re-sends and send leases, countdowns), and the per-process state of a task:
plain Python, apart from the port calls, so that ``celery.py`` holds the task itself."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timezone
from typing import Any

from ..._core.types import ClaimToken
from ..._decorator import WrapPlan
from ..._errors import StoreFull, StoreUnavailable
from ..._sync import Coordinator, IdempotencyPort

#: store failures that may pass: the task is retried (before the body) or its
#: outcome written again (after it)
_STORE_ERRORS = (StoreUnavailable, StoreFull)
#: the message header counting re-sends after store failures (for the backoff)
_STORE_TRIES_HEADER = "idemlock_store_tries"
#: the message header of a task sent by apply_async_once: its send lease's seconds
SEND_HEADER = "idemlock_send_lease"


@dataclasses.dataclass
class _ProcessState:
    """What one worker process resolved for one task: never shared across a fork."""

    pid: int
    coord: Coordinator
    plan: WrapPlan
    ports: dict[int, IdempotencyPort] = dataclasses.field(default_factory=dict)
    #: the task's concurrency limit (a ``Permits``), None without ``idemlock_concurrency``
    permits: Any = None


def _recorded(port: IdempotencyPort, token: ClaimToken) -> bool:
    """Whether the store holds this claim's outcome (completed with its fence)."""
    try:
        status = port.status(token.key)
    except _STORE_ERRORS:
        return False
    return status is not None and status.state == "completed" and status.fence == token.fence


def _store_tries(request: Any, headers: dict[str, Any]) -> int:
    """How many store failures in a row sent this task again (a message header)."""
    value = headers.get(_STORE_TRIES_HEADER, getattr(request, _STORE_TRIES_HEADER, 0))
    try:
        return max(0, int(value or 0))
    except (TypeError, ValueError):
        return 0


def _wait_seconds(options: dict[str, Any]) -> float:
    """How long a ``countdown`` or ``eta`` holds the task back before it may run."""
    countdown = options.get("countdown")
    if countdown is not None:
        return max(0.0, float(countdown))
    eta = options.get("eta")
    if isinstance(eta, datetime):
        when = eta if eta.tzinfo else eta.replace(tzinfo=timezone.utc)
        return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())
    return 0.0


def _send_lease(request: Any) -> float | None:
    """The send lease of a task sent by apply_async_once (a message header), or None."""
    headers = request.headers or {}
    value = headers.get(SEND_HEADER, getattr(request, SEND_HEADER, None))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        return None
    return float(value)
