"""A hypothesis state machine that runs random operation sequences against a store
and checks every reply against a small reference model of the claim and lease tables.

With a manual clock (memory) the model also crosses expiries; on stores judged by a
real clock, leases are long so the run never straddles an expiry boundary (expiry is
covered by the explicit contract tests)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import hypothesis.strategies as st
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
    StaleClaim,
)

from .harness import Harness

KEYS = st.sampled_from(["a", "b", "c:d", "{e}"])
PAYLOADS = st.sampled_from([None, {"p": 1}, {"p": 2}])
RESULTS = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5))
OWNERS = st.sampled_from(["w1", "w2", "w3"])


@dataclass
class MClaim:
    state: str
    token: str
    fence: int
    fp: Any
    expires: float
    result: Any = None


@dataclass
class MLock:
    owner: str
    token: int
    expires: float


def make_machine(harness: Harness) -> type[RuleBasedStateMachine]:
    manual = harness.clock is not None
    lease_s, ttl_s = (1.0, 3.0) if manual else (600.0, 600.0)

    class StoreModel(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            harness.prefix = harness.prefix + "x"  # a fresh namespace per run
            self.coord = harness.sync()
            self.port = self.coord.idempotency(
                IdempotencySpec("m", ttl=timedelta(seconds=ttl_s), lease=timedelta(seconds=lease_s))
            )
            self.locks = self.coord.lock(LockSpec("m", ttl=timedelta(seconds=lease_s)))
            self.claims: dict[str, MClaim] = {}
            self.lock_rows: dict[str, MLock] = {}
            self.tokens: list[ClaimToken] = []
            self.leases: list[Lease] = []
            self.last_fence: dict[str, int] = {}
            self.last_lock_token: dict[str, int] = {}

        def now(self) -> float:
            # Milliseconds as the store computes them, so boundaries agree exactly.
            if harness.clock is None:
                return 0.0
            return int(harness.clock.time() * 1000) / 1000

        def now_plus(self, seconds: float) -> float:
            return (int(self.now() * 1000) + int(seconds * 1000)) / 1000

        def live(self, rec: MClaim | MLock | None) -> bool:
            return rec is not None and (not manual or rec.expires > self.now())

        @rule(key=KEYS, payload=PAYLOADS)
        def claim(self, key: str, payload: Any) -> None:
            rec = self.claims.get(key)
            expected_mismatch = self.live(rec) and rec is not None and rec.fp != payload
            try:
                got = self.port.claim(key, payload=payload)
            except PayloadMismatch:
                assert expected_mismatch
                return
            assert not expected_mismatch
            if self.live(rec):
                assert rec is not None
                if rec.state == "completed":
                    assert isinstance(got, Completed) and got.result == rec.result
                else:
                    assert isinstance(got, InFlight)
                return
            assert isinstance(got, Claimed)
            assert got.fence > self.last_fence.get(key, 0)
            self.last_fence[key] = got.fence
            self.claims[key] = MClaim(
                "in_flight", got.token.token, got.fence, payload, self.now_plus(lease_s)
            )
            self.tokens.append(got.token)

        @rule(data=st.data(), result=RESULTS)
        def complete(self, data: st.DataObject, result: Any) -> None:
            if not self.tokens:
                return
            tok = data.draw(st.sampled_from(self.tokens))
            rec = self.claims.get(tok.key)
            # Late completion: also after the lease ended, unless another attempt took over.
            holds = rec is not None and rec.state == "in_flight" and rec.token == tok.token
            try:
                self.port.complete(tok, result)
            except StaleClaim:
                assert not holds
                return
            assert holds and rec is not None
            rec.state, rec.result, rec.expires = "completed", result, self.now_plus(ttl_s)

        @rule(data=st.data())
        def abandon(self, data: st.DataObject) -> None:
            if not self.tokens:
                return
            tok = data.draw(st.sampled_from(self.tokens))
            rec = self.claims.get(tok.key)
            # Late completion: also after the lease ended, unless another attempt took over.
            holds = rec is not None and rec.state == "in_flight" and rec.token == tok.token
            try:
                self.port.abandon(tok)
            except StaleClaim:
                assert not holds
                return
            assert holds
            del self.claims[tok.key]

        @rule(key=KEYS)
        def forget(self, key: str) -> None:
            was_live = self.live(self.claims.get(key))
            assert self.port.forget(key) is was_live
            self.claims.pop(key, None)

        @rule(key=KEYS)
        def status(self, key: str) -> None:
            rec = self.claims.get(key)
            got = self.port.status(key)
            if not self.live(rec):
                assert got is None
            else:
                assert rec is not None and got is not None
                assert (got.state, got.fence) == (rec.state, rec.fence)

        @rule(key=KEYS, owner=OWNERS)
        def acquire(self, key: str, owner: str) -> None:
            row = self.lock_rows.get(key)
            got = self.locks.acquire(key, owner=owner)
            if self.live(row) and row is not None and row.owner != owner:
                assert got is None
                return
            assert got is not None and got.token is not None
            if self.live(row) and row is not None:
                assert got.token == row.token
            else:
                assert got.token > self.last_lock_token.get(key, 0)
            self.last_lock_token[key] = got.token
            self.lock_rows[key] = MLock(owner, got.token, self.now_plus(lease_s))
            self.leases.append(got)

        @rule(data=st.data())
        def release(self, data: st.DataObject) -> None:
            live_leases = [le for le in self.leases if not le._released]
            if not live_leases:
                return
            lease = data.draw(st.sampled_from(live_leases))
            row = self.lock_rows.get(lease.key)
            holds = (
                self.live(row)
                and row is not None
                and (row.owner, row.token) == (lease.owner, lease.token)
            )
            assert self.locks.release(lease) is holds
            if holds:
                del self.lock_rows[lease.key]
            # Every other object naming the same lease is spent too.
            for other in self.leases:
                if (other.key, other.owner, other.token) == (lease.key, lease.owner, lease.token):
                    other._released = True

        @rule(key=KEYS)
        def lock_owner(self, key: str) -> None:
            row = self.lock_rows.get(key)
            expected = row.owner if self.live(row) and row is not None else None
            assert self.locks.owner(key) == expected

        if manual:

            @rule(seconds=st.sampled_from([0.2, 0.6, 1.1, 2.5, 3.5]))
            def advance(self, seconds: float) -> None:
                harness.advance(seconds)

        @invariant()
        def listing_matches(self) -> None:
            listed = {r.key: r.state for r in self.coord.keys()}  # noqa: SIM118 - not a dict
            expected = {k: r.state for k, r in self.claims.items() if self.live(r)}
            assert listed == expected

        def teardown(self) -> None:
            self.coord.close()

    return StoreModel


def test_store_matches_model(harness: Harness) -> None:
    machine = make_machine(harness)
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=40 if harness.clock is not None else 15,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        ),
    )
