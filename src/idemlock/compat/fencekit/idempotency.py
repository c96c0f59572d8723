"""fencekit's ``IdempotencyGuard`` over idemlock's idempotency port.

A begun key is an idemlock claim of spec ``<prefix>.idem`` whose lease is the
``ttl`` given to ``try_begin``; ``mark_done`` completes it. The recorded value is
``[result]``, or ``[]`` when ``mark_done`` had no result, so a recorded ``None``
and "no result" stay apart.
"""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta
from typing import Any

from ..._core.types import Claimed, ClaimToken, Completed, IdempotencySpec
from ..._errors import StaleClaim
from ..._sync import IdempotencyPort
from .canonicalize import dumps_json, loads_json
from .client import RedisClient, SyncRedis, coordinator_for, notify
from .errors import IdempotencyNotOwned, IdempotencyResultMissing
from .keys import DEFAULT_PREFIX, KeySpace
from .lock import DistributedLock
from .types import BeginOutcome

__all__ = ["IdempotencyGuard"]

_MISSING: Any = object()


def _seconds(ttl: timedelta) -> timedelta:
    if ttl.total_seconds() < 1:
        raise ValueError(f"an idempotency ttl must be at least 1 second, got {ttl}")
    return timedelta(seconds=int(ttl.total_seconds()))


class IdempotencyGuard:
    """At most one start of a keyed job; its result recorded for replay.

    The claim a guard wins is proven by the idemlock claim token it keeps, so
    ``mark_done`` works on the guard (or a guard sharing its token table: the same
    object) that began the key.
    """

    def __init__(
        self,
        redis: SyncRedis | RedisClient | Any,
        *,
        prefix: str = DEFAULT_PREFIX,
        owner_id: str | None = None,
        hooks: Any = None,
    ) -> None:
        self._keys = KeySpace(prefix)
        self._coord = coordinator_for(redis)
        self._spec_name = f"{prefix}.idem"
        self._owner_id = owner_id or str(uuid.uuid4())
        self._hooks = hooks
        self._ports: dict[timedelta, IdempotencyPort] = {}
        #: key -> (claim token, ttl it was begun with)
        self._claims: dict[str, tuple[ClaimToken, timedelta]] = {}
        self._mutex = threading.Lock()

    @property
    def owner_id(self) -> str:
        return self._owner_id

    def _port(self, ttl: timedelta) -> IdempotencyPort:
        port = self._ports.get(ttl)
        if port is None:
            spec = IdempotencySpec(self._spec_name, ttl=ttl, lease=ttl)
            port = self._ports.setdefault(ttl, self._coord.idempotency(spec))
        return port

    def _begin(self, key: str, ttl: timedelta) -> Claimed | Completed | None:
        self._keys.idempotency(key)  # fencekit's key checks (non-empty, no whitespace)
        ttl = _seconds(ttl)
        claim = self._port(ttl).claim(key)
        if isinstance(claim, Claimed):
            with self._mutex:
                self._claims[key] = (claim.token, ttl)
            return claim
        return claim if isinstance(claim, Completed) else None

    def try_begin(self, key: str, *, ttl: timedelta) -> bool:
        """True if this caller claimed ``key`` and must run the job."""
        won = isinstance(self._begin(key, ttl), Claimed)
        notify(self._hooks, "idempotency_begin", key, won)
        return won

    def try_begin_or_reclaim(
        self,
        key: str,
        *,
        lock: DistributedLock,
        lock_resource: str,
        ttl: timedelta,
    ) -> BeginOutcome:
        """Begin, or take over a pending claim whose lease ended (a crashed worker).

        The claim's own lease says whether its worker is alive, so ``lock`` and
        ``lock_resource`` are checked for type only: a live claim is IN_PROGRESS
        whatever lock is held.
        """
        if not isinstance(lock, DistributedLock):
            raise TypeError(f"lock must be a DistributedLock, got {type(lock).__name__}")
        before = self.status(key)
        claim = self._begin(key, ttl)
        if isinstance(claim, Claimed):
            outcome = BeginOutcome.RECLAIMED if before == "pending" else BeginOutcome.BEGUN
        elif isinstance(claim, Completed):
            outcome = BeginOutcome.ALREADY_DONE
        else:
            outcome = BeginOutcome.IN_PROGRESS
        notify(self._hooks, "idempotency_outcome", key, outcome)
        return outcome

    def mark_done(self, key: str, *, result: Any = _MISSING, ttl: timedelta | None = None) -> None:
        """Record ``key`` as done (with ``result``, JSON data, if given) for ``ttl``
        (default: the ttl it was begun with). IdempotencyNotOwned if this guard does
        not hold the key's current claim."""
        with self._mutex:
            held = self._claims.get(key)
        if held is None:
            raise IdempotencyNotOwned(
                f"cannot mark {key!r} done: this guard (owner {self._owner_id!r}) did not "
                "begin it, or its claim was already finished"
            )
        token, begun_ttl = held
        value: list[Any] = [] if result is _MISSING else [loads_json(dumps_json(result))]
        port = self._port(begun_ttl if ttl is None else _seconds(ttl))
        try:
            port.complete(token, value)
        except StaleClaim as exc:
            with self._mutex:
                self._claims.pop(key, None)
            raise IdempotencyNotOwned(
                f"cannot mark {key!r} done: the claim of owner {self._owner_id!r} was "
                "taken over by another attempt after its lease ended"
            ) from exc
        with self._mutex:
            self._claims.pop(key, None)
        notify(self._hooks, "idempotency_done", key, result is not _MISSING)

    def get_result(self, key: str) -> Any:
        """The recorded result of a done ``key``; IdempotencyResultMissing if it is
        absent, pending, or was marked done without a result."""
        if self.status(key) != "done":
            raise IdempotencyResultMissing(
                f"no recorded result for {key!r}: it is absent, pending, or not done"
            )
        # Claiming a completed key replays its record and changes nothing. Should it
        # have expired just now, the claim is handed straight back.
        port = next(iter(self._ports.values()), None) or self._port(timedelta(seconds=1))
        claim = port.claim(key)
        if isinstance(claim, Claimed):
            port.abandon(claim.token)
        if not isinstance(claim, Completed):
            raise IdempotencyResultMissing(f"no recorded result for {key!r}: it expired")
        value = claim.result
        if isinstance(value, list) and len(value) == 1:
            return value[0]
        raise IdempotencyResultMissing(
            f"no recorded result for {key!r}: it was completed without a stored result"
        )

    def clear(self, key: str) -> None:
        """Forget ``key`` and its result, so it runs again."""
        with self._mutex:
            self._claims.pop(key, None)
        port = next(iter(self._ports.values()), None) or self._port(timedelta(seconds=1))
        port.forget(key)

    def status(self, key: str) -> str | None:
        """``"pending"``, ``"done"`` or None (absent)."""
        port = next(iter(self._ports.values()), None) or self._port(timedelta(seconds=1))
        found = port.status(key)
        if found is None:
            return None
        return {"in_flight": "pending", "completed": "done"}.get(found.state)
