"""The election contract (``coord.election()``), on every store, sync and async: one
leader per key, whose term is a fencing token and whose value everyone can read."""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from datetime import timedelta
from typing import Any

import pytest

import idemlock._base.lock as lock_module
from idemlock import (
    ConfigurationError,
    ElectionSpec,
    FencedOut,
    Leader,
    LockLost,
    LockNotAcquired,
    LockNotHeld,
    LockSpec,
)

from .facade import Facade

SPEC = ElectionSpec("scheduler", ttl=timedelta(seconds=30))


async def _call(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


async def _until(api: Facade, check: Any, what: str, bound: float = 20.0) -> None:
    deadline = time.monotonic() + bound
    while not await check():
        assert time.monotonic() < deadline, what
        if api.harness.clock is not None:
            api.harness.clock.advance(0.05)
        await asyncio.sleep(0.02)


async def test_campaign_leads_and_publishes_its_value(api: Facade) -> None:
    el = api.election(SPEC)
    assert await el.leader("eu-west") is None
    async with el.campaign("eu-west", value="host-a:8080") as term:
        assert term.number > 0 and term.value == "host-a:8080" and not term.lost
        assert term.key == "eu-west"
        assert timedelta(seconds=25) < term.remaining() <= timedelta(seconds=30)
        leader = await el.leader("eu-west")
        assert isinstance(leader, Leader)
        assert (leader.value, leader.term) == ("host-a:8080", term.number)
        await _call(term.proclaim("host-a:9090"))
        leader = await el.leader("eu-west")
        assert leader is not None and (leader.value, leader.term) == ("host-a:9090", term.number)
        assert term.value == "host-a:9090"
        with pytest.raises(LockNotAcquired, match="election scheduler:eu-west"):
            async with el.campaign("eu-west", value="host-b", wait=0):
                pass  # pragma: no cover
        assert await el.leader("other-region") is None
    assert await el.leader("eu-west") is None


async def test_terms_strictly_increase_and_fence_a_resource(api: Facade) -> None:
    el = api.election(SPEC)
    gate = api.fence("schedule")
    numbers = []
    for host in ("a", "b", "c"):
        async with el.campaign("k", value=host, wait=5) as term:
            numbers.append(term.number)
            await gate.check_and_advance(term.number)
    assert numbers == sorted(numbers) and len(set(numbers)) == 3
    with pytest.raises(FencedOut):
        await gate.check_and_advance(numbers[0])


async def test_a_second_candidate_is_elected_when_the_leader_steps_down(api: Facade) -> None:
    el = api.election(SPEC)
    elected = threading.Event()
    numbers: list[int] = []

    def candidate() -> None:
        with api.harness.sync().election(SPEC).campaign("k", value="b") as term:
            numbers.append(term.number)
            elected.set()

    async with el.campaign("k", value="a") as first:
        runner = threading.Thread(target=candidate, daemon=True)
        runner.start()
        await asyncio.sleep(0.1)
        assert not elected.is_set()
    await asyncio.to_thread(elected.wait, 25)
    await asyncio.to_thread(runner.join, 25)
    assert elected.is_set() and numbers[0] > first.number


def _watch(api: Facade, el: Any, seen: list[Leader | None], n: int) -> Any:
    """Observe key "k" in the background (a thread on the sync face) until ``n``
    states were seen."""
    if api.mode == "async":

        async def watch() -> None:
            async for leader in el.raw.observe("k", timeout=30):
                seen.append(leader)
                if len(seen) == n:
                    break

        return asyncio.ensure_future(watch())

    def watch_sync() -> None:
        for leader in el.raw.observe("k", timeout=30):
            seen.append(leader)
            if len(seen) == n:
                break

    return asyncio.ensure_future(asyncio.to_thread(watch_sync))


async def _one_term_observed(api: Facade, el: Any, rival: Any) -> None:
    """``rival`` leads one term, publishes a second value, and steps down; an observer
    on ``el`` sees none, the term, the new value, none: in that order, once each."""
    seen: list[Leader | None] = []
    watcher = _watch(api, el, seen, 4)

    async def count(n: int) -> bool:
        return len(seen) >= n

    await _until(api, lambda: count(1), "observe did not start with the current state")
    async with rival.campaign("k", value="a") as term:
        await _until(api, lambda: count(2), "observe missed the new leader")
        await _call(term.proclaim("a2"))
        await _until(api, lambda: count(3), "observe missed the new value")
    await _until(api, lambda: count(4), "observe missed the end of the term")
    await asyncio.wait_for(watcher, 30)
    assert seen[0] is None and seen[3] is None
    assert seen[1] is not None and (seen[1].value, seen[1].term) == ("a", term.number)
    assert seen[2] is not None and (seen[2].value, seen[2].term) == ("a2", term.number)


async def test_observe_sees_each_change_in_term_order(api: Facade) -> None:
    el = api.election(SPEC)
    await _one_term_observed(api, el, el)


async def test_observers_are_woken_by_a_new_term_and_a_new_value(
    api: Facade, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Woken, not re-reading: with re-reads an hour apart, an observer still sees
    each change another client makes (so a term shorter than the re-read period is
    not missed). Where a store cannot wake other processes, its poll cap bounds the
    re-read instead."""
    monkeypatch.setattr(lock_module, "OBSERVE_REREAD", 3600.0)
    spec = ElectionSpec("scheduler", ttl=600)
    other = api.other()
    try:
        await _one_term_observed(api, api.election(spec), other.election(spec))
    finally:
        await other.close()


async def test_observe_stops_at_its_timeout(api: Facade) -> None:
    el = api.election(SPEC)
    got: list[Leader | None] = []

    async def observe() -> None:
        if api.mode == "async":
            async for leader in el.raw.observe("quiet", timeout=0.3):
                got.append(leader)
        else:
            got.extend(await asyncio.to_thread(lambda: list(el.raw.observe("quiet", timeout=0.3))))

    watcher = asyncio.ensure_future(observe())

    async def ended() -> bool:
        return watcher.done()

    await _until(api, ended, "observe ran past its timeout")
    await watcher
    assert got == [None]


async def test_a_broken_term_is_lost(api: Facade) -> None:
    el = api.election(ElectionSpec("scheduler", ttl=2))
    locks = api.lock(LockSpec("scheduler"))
    with pytest.raises(LockLost, match="term of election scheduler:k"):
        async with el.campaign("k", value="a", renew_every=0.2) as term:
            assert await locks.break_lock("k") is True

            async def lost() -> bool:
                return term.lost

            await _until(api, lost, "the broken term was not reported lost")
            if api.mode == "async":
                await asyncio.sleep(30)  # cancelled by the loss
    with pytest.raises(LockNotHeld, match="already released"):
        await _call(term.proclaim("late"))  # the block ended the term


def test_election_spec_and_value_validation() -> None:
    with pytest.raises(ConfigurationError):
        ElectionSpec("e", ttl=0)
    assert ElectionSpec("e").ttl == timedelta(seconds=15)


async def test_published_values_are_checked(api: Facade) -> None:
    el = api.election(SPEC)
    with pytest.raises(ConfigurationError, match="str"):
        async with el.campaign("k", value=b"bytes"):  # type: ignore[arg-type]
            pass  # pragma: no cover
    with pytest.raises(ConfigurationError, match="4096 bytes"):
        async with el.campaign("k", value="x" * 4097):
            pass  # pragma: no cover
    assert await el.leader("k") is None
