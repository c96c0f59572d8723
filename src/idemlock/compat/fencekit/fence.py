"""fencekit's ``FenceGate`` over idemlock's fence gate (resource ``<prefix>.<name>``)."""

from __future__ import annotations

from typing import Any

from ..._errors import FencedOut
from ..._sync import FenceGate as _Gate
from .client import RedisClient, SyncRedis, coordinator_for, notify
from .errors import FencedOutError
from .keys import DEFAULT_PREFIX, KeySpace
from .types import FenceToken

__all__ = ["FenceGate"]


class FenceGate:
    """Accepts fencing tokens at least as high as the highest accepted per resource."""

    def __init__(
        self,
        redis: SyncRedis | RedisClient | Any,
        *,
        prefix: str = DEFAULT_PREFIX,
        hooks: Any = None,
    ) -> None:
        self._keys = KeySpace(prefix)
        self._prefix = prefix
        self._coord = coordinator_for(redis)
        self._hooks = hooks

    def _gate(self, resource: str) -> _Gate:
        return self._coord.fence(f"{self._prefix}.{resource}")

    def _fenced_out(self, token: FenceToken, highest: int | None) -> FencedOutError:
        notify(self._hooks, "fence_rejected", token.resource, token.value)
        return FencedOutError(
            f"token {token.value} for {token.resource!r} is fenced out (max={highest or 0}): "
            "a newer holder has written; stop and re-acquire"
        )

    def current_max(self, resource: str) -> int:
        """The highest token accepted for ``resource`` (0 before the first)."""
        return self._gate(resource).current() or 0

    def check(self, token: FenceToken) -> None:
        """FencedOutError if ``token`` is below the highest accepted. Diagnostic only:
        it changes nothing, so never use it to authorise a later write."""
        highest = self._gate(token.resource).current()
        if highest is not None and token.value < highest:
            raise self._fenced_out(token, highest)

    def check_and_advance(self, token: FenceToken) -> None:
        """Accept ``token`` (it becomes the highest) or raise FencedOutError."""
        try:
            self._gate(token.resource).check_and_advance(token.value)
        except FencedOut as exc:
            raise self._fenced_out(token, getattr(exc, "current", None)) from exc
        notify(self._hooks, "fence_advanced", token.resource, token.value)

    def set_if_fresh(self, token: FenceToken, key: str, value: str) -> None:
        """Atomically accept ``token`` and SET ``key`` to ``value`` (Redis stores), or
        raise FencedOutError and write nothing."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"key must be a non-empty str, got {key!r}")
        try:
            self._gate(token.resource).set_if_fresh(token.value, key, value)
        except FencedOut as exc:
            raise self._fenced_out(token, getattr(exc, "current", None)) from exc
        notify(self._hooks, "fence_advanced", token.resource, token.value)
