"""What the decorator, ``run()`` and ``hold()`` do alike on both faces: their options, starting and
stopping the renewal of a held claim or lease, and the warnings of a release that
did not happen. :mod:`idemlock._tasks` and :mod:`idemlock._threads` build their
blocks from these steps, keeping only what differs between a task and a thread."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ._core.clock import duration
from ._core.flows import Renewal, RenewState
from ._core.types import Claim, Claimed, ClaimToken, Completed, Lease
from ._decorator import WrapPlan, heartbeat_options
from ._errors import InFlightError, LockNotAcquired
from ._logfields import port_fields
from ._ports import Attempt, IdempotencyBase, LockBase

log = logging.getLogger("idemlock")


@dataclass(frozen=True, slots=True)
class Wrapping:
    """What ``idempotent()`` wraps a function with, on either face: its port, the key
    function, the errors to replay, the wait for a key in flight and the heartbeat's
    interval, limit and ``on_lost``."""

    port: Any
    key: Callable[..., str] | None
    replay_errors: tuple[type[BaseException], ...]
    wait_s: float | None
    every: float | None
    limit: float | None
    on_lost: Callable[[ClaimToken], object] | None

    def plan(self, fn: Callable[..., Any]) -> WrapPlan:
        return WrapPlan(fn, self.key, self.replay_errors)


class RunSteps(IdempotencyBase):
    """The steps of ``run()``."""

    def _run_options(
        self,
        wait: timedelta | float | None,
        heartbeat: bool,
        renew_every: timedelta | float | None,
        max_run: timedelta | float | None,
        on_lost: Callable[[ClaimToken], object] | None,
    ) -> tuple[float | None, float | None, float | None]:
        """(renewal interval or None, max_run seconds or None, wait seconds or None)."""
        every, limit = heartbeat_options(self, heartbeat, renew_every, max_run, on_lost)
        return every, limit, None if wait is None else self._wait_for(wait)

    def _begun(self, key: str, claim: Claim) -> Attempt | ClaimToken:
        """The replayed attempt of a completed key, or the token of a new claim;
        ``InFlightError`` while another attempt holds the key."""
        if isinstance(claim, Completed):
            return Attempt(key, None, claim.result)
        if not isinstance(claim, Claimed):
            raise InFlightError(key, claim.expires_at)
        return claim.token

    def _not_recorded(self, exc: BaseException, token: ClaimToken, hb: Any) -> BaseException:
        """What leaving a block raises when its completion was refused as stale: the
        claim was lost while the block ran (with a heartbeat), else ``exc`` itself."""
        if hb is None:
            return exc
        lost: BaseException = self._replies.lost_claim(token, hb.reason)
        return lost


class HoldSteps(LockBase):
    """The steps of ``hold()``."""

    def _hold_options(
        self, renew_every: timedelta | float | None, max_hold: timedelta | float | None
    ) -> tuple[float, float | None]:
        limit = None if max_hold is None else duration(max_hold, "max_hold")
        return self._renew_every(renew_every), limit

    def _held(
        self,
        key: str,
        lease: Lease | None,
        wait: timedelta | float | None,
        on_lost: Callable[[Lease], object] | None,
    ) -> tuple[Lease, RenewState]:
        """The lease taken and its renewal state; ``LockNotAcquired`` if none was."""
        if lease is None:
            raise LockNotAcquired(self._not_acquired(key, wait))
        return lease, self._renew_state(lease, on_lost)

    def _start_renewing(
        self,
        state: RenewState,
        every: float,
        max_hold_s: float | None,
        expire: Callable[[], None],
    ) -> tuple[Any, Renewal]:
        """Watch the lease's local deadline (``expire`` runs when it passes) and have
        the coordinator's one renewer renew it, with every claim and lease it keeps."""
        assert state.lease is not None
        watchdog = self._coord._watchdog
        entry = watchdog.watch(state.deadline(), expire)
        state.moved = lambda at: watchdog.move(entry, at)
        renewal = self._renewal(state.lease, every, max_hold_s, state)
        self._coord._renewer.add(renewal)
        return entry, renewal

    def _stop_renewing(self, state: RenewState, entry: Any, renewal: Renewal) -> tuple[bool, Lease]:
        """End the renewal of a hold: (whether the lease was lost, the lease)."""
        lost = state.end(self._coord.clock.monotonic())
        self._coord._watchdog.cancel(entry)
        self._coord._renewer.remove(renewal)
        assert state.lease is not None
        return lost, state.lease

    def _unreleased(self, bound: float, then: str) -> None:
        """Log leaving a hold whose release the store did not answer within ``bound``."""
        log.warning(
            "leaving hold() of a lock of spec %s without its release: the store did not "
            "answer within %gs (its timeout); %s",
            self.spec.name,
            bound,
            then,
            extra=port_fields(self, "release", "timeout"),
        )

    def _release_failed(self) -> None:
        """Log a release that failed (called in an ``except`` block)."""
        log.warning(
            "could not release a lock of spec %s; it frees itself when its lease ends",
            self.spec.name,
            exc_info=True,
            extra=port_fields(self, "release", "error"),
        )
