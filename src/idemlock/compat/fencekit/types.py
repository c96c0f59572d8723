"""fencekit's value types: begin outcomes, fencing tokens and lock handles."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import Any

__all__ = ["BeginOutcome", "FenceToken", "LockHandle"]


class BeginOutcome(str, Enum):
    """What ``IdempotencyGuard.try_begin_or_reclaim`` decided."""

    #: this caller claimed a free key and runs the job
    BEGUN = "begun"
    #: this caller took over a pending claim whose lease had ended
    RECLAIMED = "reclaimed"
    #: the job is done; read its result with ``get_result``
    ALREADY_DONE = "already_done"
    #: another attempt holds a live claim; do not start
    IN_PROGRESS = "in_progress"


@dataclass(frozen=True, slots=True)
class FenceToken:
    """A lock's fencing token (an idemlock lease token) and the resource it fences."""

    value: int
    resource: str

    def __post_init__(self) -> None:
        if self.value < 1:
            raise ValueError(f"a fence token must be positive, got {self.value}")
        if not self.resource:
            raise ValueError("a fence token needs a non-empty resource")


@dataclass(frozen=True, slots=True)
class LockHandle:
    """A held lock, as ``DistributedLock.acquire`` returns it.

    It carries the idemlock :class:`~idemlock.Lease` it maps to; a handle built by
    hand (e.g. after a restart) has none and is acted on by owner id instead.
    """

    resource: str
    owner_id: str
    token: FenceToken
    ttl: timedelta
    _lease: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.owner_id:
            raise ValueError("a lock handle needs a non-empty owner_id")
        if self.token.resource != self.resource:
            raise ValueError(
                f"the handle's token fences {self.token.resource!r}; it must match "
                f"the handle's resource {self.resource!r}"
            )
        if self.ttl.total_seconds() <= 0:
            raise ValueError(f"a lock ttl must be positive, got {self.ttl}")
