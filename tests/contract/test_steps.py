"""Steps inside one operation (rows ``step.*``): a retry after a failure resumes after the
last finished step, on every store that declares ``steps``, sync and async. A store
that does not declare them refuses ``attempt.step`` with a ConfigurationError naming
itself, so no store's run of these tests is skipped."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

import idemlock
from idemlock import (
    ClaimLost,
    ConfigurationError,
    DuplicateStep,
    IdempotencySpec,
    ResultTooLarge,
    StepInterrupted,
)

from .facade import Facade, Proxy, each_face
from .harness import Harness

SPEC = IdempotencySpec("steps", ttl=timedelta(seconds=60))
#: seconds; a lease short enough to lapse in a test (SHORT_SPEC)
LEASE = 1.0
SHORT_SPEC = IdempotencySpec("steps-short", ttl=timedelta(seconds=60), lease=LEASE)


class Declined(Exception):
    """A step's outcome that is recorded and replayed (``replay_errors``)."""


class Crash(Exception):
    """A failure in the middle of an operation: nothing recorded for its step."""


@contextlib.asynccontextmanager
async def run(api: Facade, spec: IdempotencySpec, key: str, **options: Any) -> AsyncIterator[Any]:
    """``port.run(key)`` on the facade's face; the attempt's methods awaitable on both
    (its ``raw`` the attempt itself, to set ``result``)."""
    block = api.coord.idempotency(spec).run(key, **options)
    if api.mode == "sync":
        with block as attempt:
            yield Proxy(attempt, api.mode)
    else:
        async with block as attempt:
            yield Proxy(attempt, api.mode)


def declares_steps(api: Facade) -> bool:
    return bool(api.coord.store.capabilities.steps)


async def _refused_without_the_capability(api: Facade) -> bool:
    """On a store without ``steps``: the step is refused, clearly, and nothing ran."""
    if declares_steps(api):
        return False
    ran: list[int] = []
    with pytest.raises(ConfigurationError, match=f"the {api.coord.store.kind} store does not"):
        async with run(api, SPEC, "no-steps") as attempt:
            await attempt.step("a", ran.append, 1)
    assert ran == []
    return True


async def _a_retry_resumes_after_the_finished_steps(api: Facade) -> None:
    if await _refused_without_the_capability(api):
        return
    calls: list[str] = []

    def charge(amount: int) -> dict[str, Any]:
        calls.append("charge")
        return {"id": "ch_1", "amount": amount}

    def send(charge_id: str, *, fail: bool) -> int:
        calls.append("email")
        if fail:
            raise Crash("smtp down")
        return 7

    keys = []
    with pytest.raises(Crash):
        async with run(api, SPEC, "order-1", payload={"o": 1}) as attempt:
            first_fence = attempt.raw.fence
            got = await attempt.step("charge", charge, 5)
            keys.append(attempt.raw.key_for("charge"))
            await attempt.step("email", send, got["id"], fail=True)
    assert calls == ["charge", "email"]
    async with run(api, SPEC, "order-1", payload={"o": 1}) as attempt:
        assert attempt.raw.fence > first_fence
        got = await attempt.step("charge", charge, 5)  # recorded: not run again
        assert got == {"id": "ch_1", "amount": 5}
        receipt = await attempt.step("email", send, got["id"], fail=False)
        keys.append(attempt.raw.key_for("charge"))
        assert attempt.raw.key_for("email") != keys[-1]
        with pytest.raises(DuplicateStep, match="'charge'"):
            await attempt.step("charge", charge, 5)
        attempt.raw.result = {"receipt": receipt}
    assert calls == ["charge", "email", "email"]
    assert keys[0] == keys[1] and keys[0].startswith("idemlock-")
    status = await api.idem(SPEC).status("order-1")
    assert status is not None and status.state == "completed"
    assert [(s.name, s.state, s.fence) for s in status.steps] == [
        ("charge", "done", first_fence),  # recorded by the first attempt
        ("email", "done", status.fence),
    ]
    assert all(s.size > 0 for s in status.steps)
    async with run(api, SPEC, "order-1", payload={"o": 1}) as attempt:
        assert attempt.raw.replayed and attempt.raw.result == {"receipt": 7}
        with pytest.raises(ConfigurationError, match="completed already"):
            await attempt.step("charge", charge, 5)
    # Forgetting the operation forgets its steps: the next run starts over.
    await api.idem(SPEC).forget("order-1")
    async with run(api, SPEC, "order-1", payload={"o": 1}) as attempt:
        await attempt.step("charge", charge, 5)
    assert calls == ["charge", "email", "email", "charge"]


async def test_a_retry_resumes_after_the_finished_steps(harness: Harness) -> None:
    await each_face(harness, _a_retry_resumes_after_the_finished_steps)


async def _once_steps_replayed_errors_and_limits(api: Facade) -> None:
    if await _refused_without_the_capability(api):
        return
    ran: list[str] = []

    def declined() -> None:
        ran.append("declined")
        raise Declined("card declined", 402)

    # A crash inside a once=True step leaves its marker: the retry does not run it.
    with pytest.raises(Crash):
        async with run(api, SPEC, "pay") as attempt:
            fence = attempt.raw.fence
            with pytest.raises(Declined):
                await attempt.step("card", declined, replay_errors=(Declined,))
            await attempt.step("wire", lambda: (ran.append("wire"), 1)[1], once=True)
            await attempt.step("ledger", lambda: (_ for _ in ()).throw(Crash()), once=True)
    assert ran == ["declined", "wire"]
    with pytest.raises(StepInterrupted) as info:
        async with run(api, SPEC, "pay") as attempt:
            with pytest.raises(Declined, match="card declined"):  # replayed, not run
                await attempt.step("card", declined, replay_errors=(Declined,))
            assert await attempt.step("wire", lambda: 2, once=True) == 1
            status = await api.idem(SPEC).status("pay")
            assert status is not None
            assert {(s.name, s.state) for s in status.steps} == {
                ("card", "done"),
                ("wire", "done"),
                ("ledger", "started"),
            }
            await attempt.step("ledger", lambda: ran.append("ledger"), once=True)
    assert (info.value.name, info.value.fence) == ("ledger", fence)
    assert ran == ["declined", "wire"]
    # The caller decides: settle records what happened; retry_step allows one more run.
    async with run(api, SPEC, "pay") as attempt:
        await attempt.settle("ledger", {"entry": 9})
        assert await attempt.step("wire", lambda: 3, once=True) == 1
        await attempt.retry_step("card")
        with pytest.raises(Declined):
            await attempt.step("card", declined, replay_errors=(Declined,))
        attempt.raw.result = "paid"
    assert ran == ["declined", "wire", "declined"]
    # A result over the limit is refused before anything is written, naming the step.
    small = idemlock.IdempotencySpec("steps-small", ttl=timedelta(seconds=60))
    big = "x" * 2048
    options = {"max_result_bytes": 1024}
    coord = api.harness.sync(**options) if api.mode == "sync" else api.harness.aio(**options)
    try:
        block = coord.idempotency(small).run("big")
        if api.mode == "sync":
            with block as attempt:
                with pytest.raises(ResultTooLarge, match="step 'blob'"):
                    attempt.step("blob", lambda: big)
                assert attempt.step("blob2", lambda: "small") == "small"
        else:
            async with block as attempt:
                with pytest.raises(ResultTooLarge, match="step 'blob'"):
                    await attempt.step("blob", lambda: big)
                assert await attempt.step("blob2", lambda: "small") == "small"
    finally:
        closed = coord.close()
        if closed is not None:
            await closed


async def test_once_steps_replayed_errors_and_limits(harness: Harness) -> None:
    await each_face(harness, _once_steps_replayed_errors_and_limits)


async def _an_interrupted_step_is_settled_in_the_attempt_that_found_it(api: Facade) -> None:
    if await _refused_without_the_capability(api):
        return
    with pytest.raises(Crash):
        async with run(api, SPEC, "found") as attempt:
            await attempt.step("wire", lambda: (_ for _ in ()).throw(Crash()), once=True)
    ran: list[str] = []
    # The caller checks the outside world where the step failed, records what happened,
    # and goes on in the same attempt (or allows one more run).
    async with run(api, SPEC, "found") as attempt:
        with pytest.raises(StepInterrupted):
            await attempt.step("wire", lambda: ran.append("wire"), once=True)
        await attempt.settle("wire", {"sent": False})
        attempt.raw.result = "settled"
    assert ran == []
    status = await api.idem(SPEC).status("found")
    assert status is not None and status.state == "completed"
    assert [(s.name, s.state) for s in status.steps] == [("wire", "done")]
    with pytest.raises(Crash):
        async with run(api, SPEC, "again") as attempt:
            await attempt.step("wire", lambda: (_ for _ in ()).throw(Crash()), once=True)
    async with run(api, SPEC, "again") as attempt:
        with pytest.raises(StepInterrupted):
            await attempt.step("wire", lambda: ran.append("wire"), once=True)
        await attempt.retry_step("wire")
        await attempt.step("wire", lambda: ran.append("wire"), once=True)
        attempt.raw.result = "retried"
    assert ran == ["wire"]


async def test_an_interrupted_step_is_settled_in_the_attempt_that_found_it(
    harness: Harness,
) -> None:
    await each_face(harness, _an_interrupted_step_is_settled_in_the_attempt_that_found_it)


async def _a_step_of_an_attempt_that_lost_its_claim_is_refused(api: Facade) -> None:
    if await _refused_without_the_capability(api):
        return
    first = await api.idem(SHORT_SPEC).claim("k")
    api.harness.advance(LEASE + 0.5)  # the lease lapsed: another attempt takes over
    async with run(api, SHORT_SPEC, "k", heartbeat=False) as attempt:
        assert attempt.raw.fence > first.token.fence
        await attempt.step("a", lambda: 1)
        # The first attempt, resumed late (a paused process), tries a step: refused,
        # so two executors never both record one. run() builds its attempt the same way.
        late = Proxy(type(attempt.raw)("k", first.token, port=attempt.raw._port), api.mode)
        with pytest.raises(ClaimLost, match="refused step 'b'"):
            await late.step("b", lambda: 2)
    ns = api.coord.idempotency(SHORT_SPEC)._ns
    steps = await Proxy(api.coord.store, api.mode).steps(ns, "k")
    assert [(s.name, s.fence) for s in steps] == [("a", attempt.raw.fence)]


async def test_a_step_of_an_attempt_that_lost_its_claim_is_refused(harness: Harness) -> None:
    await each_face(harness, _a_step_of_an_attempt_that_lost_its_claim_is_refused)


async def _steps_through_the_current_claim(api: Facade) -> None:
    """In a decorated function, ``idemlock.current_claim().step(...)`` is the attempt's
    step: plain functions and ``async def`` on the blocking coordinator (its store
    called in worker threads), ``async def`` on the asyncio one."""
    ran: list[int] = []

    def charge(n: int) -> int:
        ran.append(n)
        return n * 10

    dec = api.coord.idempotent("steps-dec", key=lambda n, fail: f"job-{n}")
    if api.mode == "sync":

        @dec
        def plain(n: int, fail: bool) -> int:
            claim = idemlock.current_claim()
            assert claim is not None
            got: int = claim.step("charge", charge, n)
            if fail:
                raise Crash("after the step")
            return got + 1

        @api.coord.idempotent("steps-dec-async", key=lambda n, fail: f"job-{n}")
        async def threaded(n: int, fail: bool) -> int:
            claim = idemlock.current_claim()
            assert claim is not None
            got: int = await claim.step("charge", charge, n)
            if fail:
                raise Crash("after the step")
            return got + 1

        async def call_plain(n: int, fail: bool) -> int:
            return plain(n, fail)

        calls = [call_plain, threaded]
    else:

        @dec
        async def native(n: int, fail: bool) -> int:
            claim = idemlock.current_claim()
            assert claim is not None
            got: int = await claim.step("charge", charge, n)
            if fail:
                raise Crash("after the step")
            return got + 1

        calls = [native]
    for i, call in enumerate(calls):
        n = 100 + i
        if not declares_steps(api):
            with pytest.raises(ConfigurationError, match="does not record steps"):
                await call(n, False)
            continue
        with pytest.raises(Crash):
            await call(n, True)
        assert await call(n, False) == n * 10 + 1  # the step replayed, not run again
        assert ran.count(n) == 1, (call, ran)
    assert idemlock.current_claim() is None
    with pytest.raises(ConfigurationError, match="inside the operation"):
        idemlock.ClaimToken("k", "t", 1, datetime.now(timezone.utc), "s").step("x", charge, 1)


async def test_steps_through_the_current_claim(harness: Harness) -> None:
    await each_face(harness, _steps_through_the_current_claim)


async def _steps_report_events(api: Facade) -> None:
    """Event ``step``: recorded, replayed, interrupted and stale (a late attempt's
    write refused), each with the spec and store; a once=True marker and a drop
    (``retry_step``) are no step of their own."""
    if await _refused_without_the_capability(api):
        return
    events: list[idemlock.Event] = []
    api.coord.add_hook(events.append)
    with pytest.raises(Crash):
        async with run(api, SHORT_SPEC, "ev", heartbeat=False) as attempt:
            await attempt.step("a", lambda: 1)
            first = attempt.raw.token

            def crash() -> None:
                raise Crash("inside b")

            await attempt.step("b", crash, once=True)
    await api.idem(SHORT_SPEC).claim("ev-other")  # (a claim event between)
    api.harness.advance(LEASE + 0.5)
    async with run(api, SHORT_SPEC, "ev", heartbeat=False) as attempt:
        assert await attempt.step("a", lambda: 10) == 1
        with pytest.raises(StepInterrupted):
            await attempt.step("b", lambda: 20, once=True)
        await attempt.retry_step("c")
        await attempt.settle("c", 3)
        late = Proxy(type(attempt.raw)("ev", first, port=attempt.raw._port), api.mode)
        with pytest.raises(ClaimLost):
            await late.step("d", lambda: 4)
    steps = [(e.outcome, e.kind, e.spec, e.store) for e in events if e.name == "step"]
    expected = ["recorded", "replayed", "interrupted", "recorded", "stale"]
    assert [s[0] for s in steps] == expected, [(e.name, e.outcome) for e in events]
    kind = api.coord.store.kind
    assert {s[1:] for s in steps} == {("idempotency", SHORT_SPEC.name, kind)}
    assert all(e.duration >= 0 and e.error is None for e in events)


async def test_steps_report_events(harness: Harness) -> None:
    await each_face(harness, _steps_report_events)
