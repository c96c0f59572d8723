"""The claim of the ``@idempotent`` call running in this context (thread or task)."""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any

from ._core.types import CURRENT_ATTEMPT, ClaimToken

_CURRENT_CLAIM: ContextVar[ClaimToken | None] = ContextVar("idemlock_claim", default=None)


def current_claim() -> ClaimToken | None:
    """The claim of the ``@idempotent`` call running in this context (thread or task),
    or None. Its ``fence`` is the fencing token for the call's writes."""
    return _CURRENT_CLAIM.get()


def enter_claim(token: ClaimToken, attempt: Any = None) -> tuple[Token[Any], Token[Any]]:
    """``token`` is the current claim, ``attempt`` (its ``Attempt``, for
    ``token.step(...)``) the current attempt, until :func:`leave_claim`."""
    return _CURRENT_CLAIM.set(token), CURRENT_ATTEMPT.set(attempt)


def leave_claim(mark: tuple[Token[Any], Token[Any]]) -> None:
    _CURRENT_CLAIM.reset(mark[0])
    CURRENT_ATTEMPT.reset(mark[1])
