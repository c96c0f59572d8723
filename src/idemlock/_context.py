"""The claim of the ``@idempotent`` call running in this context (thread or task)."""

from __future__ import annotations

from contextvars import ContextVar, Token

from ._core.types import ClaimToken

_CURRENT_CLAIM: ContextVar[ClaimToken | None] = ContextVar("idemlock_claim", default=None)


def current_claim() -> ClaimToken | None:
    """The claim of the ``@idempotent`` call running in this context (thread or task),
    or None. Its ``fence`` is the fencing token for the call's writes."""
    return _CURRENT_CLAIM.get()


def enter_claim(token: ClaimToken) -> Token[ClaimToken | None]:
    return _CURRENT_CLAIM.set(token)


def leave_claim(mark: Token[ClaimToken | None]) -> None:
    _CURRENT_CLAIM.reset(mark)
