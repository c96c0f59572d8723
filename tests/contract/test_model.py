"""A hypothesis state machine that runs random operation sequences against a store,
sync and async, and checks every reply against the state table itself
(``idemlock._core.table``: the oracle applies the same rows the stores implement).

With a manual clock (the stores that take one) the run also crosses expiries; on
stores judged by a real clock, leases are long so a run never straddles an expiry
boundary (expiry is covered by the row tests of test_table.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from idemlock import (
    Claimed,
    ClaimToken,
    Completed,
    IdempotencySpec,
    InFlight,
    Lease,
    LockSpec,
    PayloadMismatch,
    SemaphoreSpec,
    StaleClaim,
)
from idemlock._core import table as T
from idemlock._core.port import Acquired, Busy, Done, Granted, Mismatch

from .harness import Harness

KEYS = st.sampled_from(["a", "b", "c:d", "{e}"])
PAYLOADS = st.sampled_from([None, {"p": 1}, {"p": 2}])
RESULTS = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=3))
OWNERS = st.sampled_from(["w1", "w2", "w3"])

R = TypeVar("R")


def _unknown_fence() -> int:
    return 0  # the store's fence replaces it (checked to increase)


def make_machine(harness: Harness, mode: str) -> type[RuleBasedStateMachine]:
    manual = harness.clock is not None
    lease_ms, ttl_ms = (1000, 3000) if manual else (600_000, 600_000)

    class StoreModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            harness.prefix = harness.prefix + "x"  # a fresh namespace per run
            self.loop = asyncio.new_event_loop() if mode == "async" else None
            self.coord: Any = harness.sync() if mode == "sync" else self.run(self._aopen)
            spec = IdempotencySpec(
                "m", ttl=timedelta(milliseconds=ttl_ms), lease=timedelta(milliseconds=lease_ms)
            )
            self.port = self.coord.idempotency(spec)
            self.locks = self.coord.lock(LockSpec("m", ttl=timedelta(milliseconds=lease_ms)))
            # Semaphores of the same name share the lock's keys: a lock is their limit-1 case.
            self.ports: dict[int, Any] = {1: self.locks}
            for limit in (2, 3):
                sem = SemaphoreSpec("m", limit=limit, ttl=timedelta(milliseconds=lease_ms))
                self.ports[limit] = self.coord.semaphore(sem)
            self.claims: dict[str, T.ClaimRec | None] = {}
            self.lock_rows: dict[str, T.LockRec | None] = {}
            self.tokens: list[ClaimToken] = []
            self.leases: list[Lease] = []
            self.completions: list[tuple[ClaimToken, Any]] = []
            self.last_fence: dict[str, int] = {}
            self.last_lock_token: dict[str, int] = {}

        async def _aopen(self) -> Any:
            return harness.aio()

        def run(self, fn: Callable[[], Awaitable[R] | R]) -> R:
            """Call ``fn`` (a port method bound to its arguments) in this machine's mode."""
            out = fn()
            if self.loop is not None and asyncio.iscoroutine(out):
                return self.loop.run_until_complete(out)  # type: ignore[no-any-return]
            return out  # type: ignore[return-value]

        def now(self) -> int:
            # Milliseconds as the store computes them, so boundaries agree exactly.
            return 0 if harness.clock is None else int(harness.clock.time() * 1000)

        @rule(key=KEYS, payload=PAYLOADS)
        def claim(self, key: str, payload: Any) -> None:
            rec = self.claims.get(key)
            args = {"fp": json.dumps(payload), "token": object(), "lease_ms": lease_ms}
            row, new, reply = T.apply_claim("claim", rec, self.now(), args, _unknown_fence)
            try:
                got = self.run(lambda: self.port.claim(key, payload=payload))
            except PayloadMismatch:
                assert isinstance(reply, Mismatch), row.id
                return
            if isinstance(reply, Granted):
                assert isinstance(got, Claimed), (row.id, got)
                assert got.fence > self.last_fence.get(key, 0)
                self.last_fence[key] = got.fence
                assert new is not None
                new.token, new.fence = got.token.token, got.fence
                self.claims[key] = new
                self.tokens.append(got.token)
            elif isinstance(reply, Done):
                assert isinstance(got, Completed), (row.id, got)
                assert rec is not None and rec.result == json.dumps(got.result).encode()
            else:
                assert isinstance(reply, Busy) and isinstance(got, InFlight), (row.id, got)

        @rule(data=st.data(), result=RESULTS)
        def complete_any(self, data: st.DataObject, result: Any) -> None:
            if self.tokens:
                self.complete(data.draw(st.sampled_from(self.tokens)), result)

        def complete(self, tok: ClaimToken, result: Any) -> None:
            encoded = json.dumps(result).encode()
            args = {"token": tok.token, "result": encoded, "ttl_ms": ttl_ms}
            row, new, ok = T.apply_claim(
                "complete", self.claims.get(tok.key), self.now(), args, _unknown_fence
            )
            try:
                self.run(lambda: self.port.complete(tok, result))
            except StaleClaim:
                assert not ok, row.id
                return
            assert ok, row.id
            self.claims[tok.key] = new
            self.completions.append((tok, result))

        @rule(data=st.data())
        def complete_resent(self, data: st.DataObject) -> None:
            # A completion re-sent after a lost reply: the same token and result.
            if self.completions:
                tok, result = data.draw(st.sampled_from(self.completions))
                self.complete(tok, result)

        @rule(data=st.data())
        def abandon(self, data: st.DataObject) -> None:
            if not self.tokens:
                return
            tok = data.draw(st.sampled_from(self.tokens))
            row, new, ok = T.apply_claim(
                "abandon",
                self.claims.get(tok.key),
                self.now(),
                {"token": tok.token},
                _unknown_fence,
            )
            try:
                self.run(lambda: self.port.abandon(tok))
            except StaleClaim:
                assert not ok, row.id
                return
            assert ok, row.id
            self.claims[tok.key] = new

        @rule(key=KEYS)
        def forget(self, key: str) -> None:
            row, new, ok = T.apply_claim(
                "forget", self.claims.get(key), self.now(), {}, _unknown_fence
            )
            assert self.run(lambda: self.port.forget(key)) is ok, row.id
            self.claims[key] = new

        @rule(key=KEYS)
        def status(self, key: str) -> None:
            rec = self.claims.get(key)
            state = T.claim_state(rec, self.now())
            got = self.run(lambda: self.port.status(key))
            if state in ("absent", "lapsed"):
                assert got is None, state
            else:
                assert rec is not None and got is not None
                assert (got.state, got.fence) == (rec.state, rec.fence)

        @rule(key=KEYS, owner=OWNERS, limit=st.sampled_from([1, 1, 2, 3]))
        def acquire(self, key: str, owner: str, limit: int) -> None:
            rec = self.lock_rows.get(key)
            args = {"owner": owner, "ttl_ms": lease_ms, "limit": limit}
            row, new, reply = T.apply_lock("acquire", rec, self.now(), args, _unknown_fence)
            got = self.run(lambda: self.ports[limit].acquire(key, owner=owner))
            if not isinstance(reply, Acquired):
                assert got is None, row.id
                return
            assert got is not None and got.token is not None, row.id
            if row.id == "lock.reacquire":
                assert rec is not None and got.token == rec.holders[owner].token
            else:
                assert got.token > self.last_lock_token.get(key, 0)
            self.last_lock_token[key] = got.token
            assert new is not None
            new.holders[owner].token = got.token
            self.lock_rows[key] = new
            self.leases.append(got)

        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            live_leases = [le for le in self.leases if not le._released]
            if not live_leases:
                return
            lease = data.draw(st.sampled_from(live_leases))
            args = {"owner": lease.owner, "token": lease.token}
            row, new, ok = T.apply_lock(
                "release", self.lock_rows.get(lease.key), self.now(), args, _unknown_fence
            )
            assert self.run(lambda: self.locks.release(lease)) is ok, row.id
            if ok:
                self.lock_rows[lease.key] = new
            # Every other object naming the same lease is spent too.
            for other in self.leases:
                if (other.key, other.owner, other.token) == (lease.key, lease.owner, lease.token):
                    other._released = True

        @rule(key=KEYS)
        def holders(self, key: str) -> None:
            rec = self.lock_rows.get(key)
            alive = {} if rec is None else rec.alive(self.now())
            want = sorted((p.token, p.owner) for p in alive.values())
            listed = self.run(lambda: self.ports[2].holders(key))
            assert sorted((h.token, h.owner) for h in listed) == want

        @rule(key=KEYS)
        def lock_owner(self, key: str) -> None:
            rec = self.lock_rows.get(key)
            alive = {} if rec is None else rec.alive(self.now())
            first = min(alive.values(), key=lambda p: p.token, default=None)
            expected = None if first is None else first.owner
            assert self.run(lambda: self.locks.owner(key)) == expected

        if manual:

            @rule(seconds=st.sampled_from([0.2, 0.6, 1.1, 2.5, 3.5]))
            def advance(self, seconds: float) -> None:
                harness.advance(seconds)

        @invariant()
        def listing_matches(self) -> None:
            listed = {r.key: r.state for r in self.run(self.coord.keys)}
            now = self.now()
            expected = {
                k: r.state
                for k, r in self.claims.items()
                if r is not None and T.claim_state(r, now) in ("in_flight", "completed")
            }
            assert listed == expected

        def teardown(self) -> None:
            if self.loop is None:
                self.coord.close()
                return
            self.loop.run_until_complete(self.coord.close())
            self.loop.close()

    return StoreModel


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_store_matches_the_table(harness: Harness, mode: str) -> None:
    machine = make_machine(harness, mode)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=25 if harness.clock is not None else 8,
            stateful_step_count=25,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
