"""The @idempotent wrap: claim, run, complete; replay; abandon on failure; waiting."""

from __future__ import annotations

import asyncio
import threading
from datetime import timedelta
from typing import Any

import pytest

from idemlock import (
    Claimed,
    Completed,
    ConfigurationError,
    IdempotencySpec,
    InFlightError,
    PayloadMismatch,
    ResultEncodeError,
)

from .facade import Facade, each_face
from .harness import Harness

SPEC = IdempotencySpec("charges", lease=timedelta(seconds=30))


async def test_runs_once_and_replays(api: Facade) -> None:
    calls: list[tuple[int, int]] = []

    def charge(order_id: int, amount: int = 5) -> dict[str, Any]:
        calls.append((order_id, amount))
        return {"order": order_id, "amount": amount}

    wrapped = api.wrap(SPEC, charge)
    first = await wrapped(1)
    assert first == {"order": 1, "amount": 5}
    # The same call spelled three ways is one call.
    assert await wrapped(1) == first
    assert await wrapped(1, amount=5) == first
    assert await wrapped(order_id=1, amount=5) == first
    assert calls == [(1, 5)]
    assert await wrapped(2) == {"order": 2, "amount": 5}
    assert calls == [(1, 5), (2, 5)]


async def test_falsy_results_are_replayed(api: Facade) -> None:
    # Every case on one coordinator (a test per case would open one per case on every
    # store and face, most of such a test's time); a failure names its case.
    def returning(result: Any, calls: list[int]) -> Any:
        def op(x: int) -> Any:
            calls.append(x)
            return result

        return op

    for x, result in enumerate([None, 0, False, "", [], {}]):
        calls: list[int] = []
        wrapped = api.wrap(SPEC, returning(result, calls))
        assert await wrapped(x) == result, f"case {result!r}"
        assert await wrapped(x) == result, f"case {result!r}"
        assert calls == [x], f"case {result!r}"


async def test_key_function_and_payload_mismatch(api: Facade) -> None:
    calls = []

    def pay(order_id: str, amount: int) -> int:
        calls.append(amount)
        return amount

    wrapped = api.wrap(SPEC, pay, key=lambda order_id, amount: f"order-{order_id}")
    assert await wrapped("A", 10) == 10
    assert await wrapped("A", 10) == 10
    with pytest.raises(PayloadMismatch):
        await wrapped("A", 11)  # same key, other arguments: never someone else's result
    assert calls == [10]
    status = await api.idem(SPEC).status("order-A")
    assert status is not None and status.state == "completed"


async def test_exception_abandons_and_retry_runs_again(api: Facade) -> None:
    attempts = []

    def flaky(n: int) -> str:
        attempts.append(n)
        if len(attempts) == 1:
            raise RuntimeError("transient")
        return "ok"

    wrapped = api.wrap(SPEC, flaky)
    with pytest.raises(RuntimeError):
        await wrapped(7)
    assert await wrapped(7) == "ok"
    assert await wrapped(7) == "ok"
    assert attempts == [7, 7]


async def test_unencodable_result_is_refused_and_abandoned(api: Facade) -> None:
    results: list[Any] = [object(), "fine"]

    def op(n: int) -> Any:
        return results.pop(0)

    wrapped = api.wrap(SPEC, op, key=lambda n: "enc")
    with pytest.raises(ResultEncodeError) as info:
        await wrapped(1)
    assert "JSON" in str(info.value)
    assert await api.idem(SPEC).status("enc") is None  # nothing recorded, claim released
    assert await wrapped(1) == "fine"


async def test_in_flight_raises(api: Facade) -> None:
    port = api.idem(SPEC)
    running = await port.claim("busy", payload={"n": 1})
    assert isinstance(running, Claimed)

    def op(n: int) -> int:
        raise AssertionError("must not run while another attempt is in flight")

    wrapped = api.wrap(SPEC, op, key=lambda n: "busy")
    with pytest.raises(InFlightError) as info:
        await wrapped(1)
    assert info.value.expires_at == running.token.expires_at
    await port.complete(running.token, 41)
    assert await wrapped(1) == 41


async def _in_flight_wait_replays_the_running_result(api: Facade) -> None:
    other = api.other()
    try:
        running = await other.idem(SPEC).claim("w", payload={"n": 1})
        assert isinstance(running, Claimed)

        def op(n: int) -> int:
            raise AssertionError("must not run: the running attempt completes")

        wrapped = api.wrap(SPEC, op, key=lambda n: "w", on_in_flight="wait", wait=10)
        if api.mode == "sync":
            complete = other.coord.idempotency(SPEC).complete
            timer = threading.Timer(0.1, complete, args=(running.token, 99))
            timer.start()
            assert await wrapped(1) == 99
            timer.join(timeout=60)
            assert not timer.is_alive(), "still running after 60 s"
        else:

            async def later() -> None:
                await asyncio.sleep(0.1)
                await other.idem(SPEC).complete(running.token, 99)

            task = asyncio.ensure_future(later())
            assert await wrapped(1) == 99
            await task
    finally:
        await other.close()


async def test_in_flight_wait_replays_the_running_result(harness: Harness) -> None:
    await each_face(harness, _in_flight_wait_replays_the_running_result)


async def _in_flight_wait_runs_when_the_other_attempt_abandons(api: Facade) -> None:
    other = api.other()
    try:
        running = await other.idem(SPEC).claim("a", payload={"n": 1})
        assert isinstance(running, Claimed)
        wrapped = api.wrap(SPEC, lambda n: n * 2, key=lambda n: "a", on_in_flight="wait", wait=10)
        if api.mode == "sync":
            abandon = other.coord.idempotency(SPEC).abandon
            timer = threading.Timer(0.1, abandon, args=(running.token,))
            timer.start()
            assert await wrapped(1) == 2
            timer.join(timeout=60)
            assert not timer.is_alive(), "still running after 60 s"
        else:

            async def later() -> None:
                await asyncio.sleep(0.1)
                await other.idem(SPEC).abandon(running.token)

            task = asyncio.ensure_future(later())
            assert await wrapped(1) == 2
            await task
        replay = await api.idem(SPEC).claim("a", payload={"n": 1})
        assert isinstance(replay, Completed) and replay.result == 2
    finally:
        await other.close()


async def test_in_flight_wait_runs_when_the_other_attempt_abandons(harness: Harness) -> None:
    await each_face(harness, _in_flight_wait_runs_when_the_other_attempt_abandons)


async def test_in_flight_wait_gives_up_after_wait(api: Facade) -> None:
    port = api.idem(SPEC)
    running = await port.claim("slow", payload={"n": 1})
    assert isinstance(running, Claimed)
    wrapped = api.wrap(SPEC, lambda n: n, key=lambda n: "slow", on_in_flight="wait", wait=0.2)
    with pytest.raises(InFlightError):
        await wrapped(1)


async def test_namespace_is_the_spec_name_not_the_function(api: Facade) -> None:
    calls = []

    def v1(x: int) -> str:
        calls.append("v1")
        return "v1"

    def v2(x: int) -> str:  # a refactor: other name, same spec, same arguments
        calls.append("v2")
        return "v2"

    assert await api.wrap(SPEC, v1)(3) == "v1"
    assert await api.wrap(SPEC, v2)(3) == "v1"
    assert calls == ["v1"]


async def test_spec_by_name(api: Facade) -> None:
    calls = []
    wrapped = api.wrap("by-name", lambda x: calls.append(x) or len(calls))
    assert await wrapped(1) == 1
    assert await wrapped(1) == 1
    assert calls == [1]


async def test_bad_options(api: Facade) -> None:
    with pytest.raises(ConfigurationError):
        api.wrap(SPEC, lambda x: x, on_in_flight="ignore")
    with pytest.raises(ConfigurationError):
        api.wrap(SPEC, lambda x: x, key="not callable")  # type: ignore[arg-type]


async def test_current_claim_gives_the_body_its_fence(api: Facade) -> None:
    from idemlock import current_claim

    seen: list[int] = []

    def op(n: int) -> int:
        claim = current_claim()
        assert claim is not None and claim.key == "fenced"
        seen.append(claim.fence)
        return claim.fence

    assert current_claim() is None
    wrapped = api.wrap(SPEC, op, key=lambda n: "fenced")
    fence = await wrapped(1)
    assert seen == [fence] and fence > 0
    assert current_claim() is None  # reset after the call
    assert await wrapped(1) == fence  # replay: the body did not run
    assert seen == [fence]


async def _claim_with_its_own_lease(api: Facade) -> None:
    port = api.idem(SPEC)  # spec lease: 30 s
    claim = await port.claim("short", lease=0.3)
    assert isinstance(claim, Claimed)
    api.harness.advance(0.45)
    again = await port.claim("short")
    assert isinstance(again, Claimed) and again.fence > claim.fence


async def test_claim_with_its_own_lease(harness: Harness) -> None:
    await each_face(harness, _claim_with_its_own_lease)
