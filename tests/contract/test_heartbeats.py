"""Heartbeats (issue 11), on every store, sync and async: a claim that spans work is
renewed by its coordinator's renewer, so the lease bounds how long a crashed worker
blocks the key, not how long the work may run.

* a body running 3x its lease keeps its key: a competitor sees InFlight all along and
  the body runs once;
* a worker SIGKILLed in a long body frees its key within lease + one renewal interval;
* a worker SIGSTOPped past its lease loses the claim: a competitor takes the key over,
  and the paused attempt's completion is refused (ClaimLost, nothing recorded).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest

from idemlock import (
    Claimed,
    ClaimLost,
    Completed,
    IdempotencySpec,
    InFlight,
    StaleClaim,
    current_claim,
)

from ..servers._proc import popen
from .facade import Facade, each_face
from .harness import Harness

# 1.5 s: a renewal is confirmed within lease - interval = 1 s even on a loaded 2-core
# CI machine running two test workers (0.6 s left 0.4 s, and an etcd renewal missed it)
LEASE = 1.5
EVERY = LEASE / 3
SPEC = IdempotencySpec("beat", ttl=timedelta(seconds=60), lease=timedelta(seconds=LEASE))


def _step(api: Facade) -> float:
    """Let time pass for the store; returns how long to really sleep (a manual clock
    is moved and the renewer, on real time, gets a moment to act)."""
    h = api.harness
    if h.clock is not None:
        h.clock.advance(EVERY / 2)
        return 0.05
    return EVERY / 2


async def _pause(api: Facade) -> None:
    real = _step(api)
    if api.mode == "sync":
        time.sleep(real)  # noqa: ASYNC251  (a sync body blocks its caller, as users' do)
    else:
        await asyncio.sleep(real)


async def _body_running_three_leases_keeps_its_key(api: Facade) -> None:
    competitor = api.harness.sync()
    rival = competitor.idempotency(SPEC)
    runs: list[str] = []
    seen: list[str] = []
    steps = 6 * 3  # 3 leases in steps of half an interval

    def check(key: str) -> None:
        seen.append(rival.claim(key, payload={"key": key}).kind)
        claim = current_claim()
        assert claim is not None and not claim.lost

    if api.mode == "sync":

        def work(key: str) -> str:
            runs.append(key)
            for _ in range(steps):
                time.sleep(_step(api))
                check(key)
            return "done"

    else:

        async def work(key: str) -> str:  # type: ignore[misc]
            runs.append(key)
            for _ in range(steps):
                await asyncio.sleep(_step(api))
                check(key)
            return "done"

    call = api.wrap(SPEC, work, key=lambda key: key)
    try:
        assert await call("long") == "done"
        assert len(seen) == steps and set(seen) == {"in_flight"}, seen
        assert runs == ["long"]
        replay = rival.claim("long", payload={"key": "long"})
        assert isinstance(replay, Completed) and replay.result == "done"
        assert await call("long") == "done"  # a retry replays, the body does not run
        assert runs == ["long"]
    finally:
        competitor.close()


async def test_body_running_three_leases_keeps_its_key(harness: Harness) -> None:
    await each_face(harness, _body_running_three_leases_keeps_its_key)


async def _without_heartbeat_a_long_body_loses_its_key(api: Facade) -> None:
    """The test above can fail: with ``heartbeat=False`` a competitor takes over."""
    competitor = api.harness.sync()
    rival = competitor.idempotency(SPEC)
    kinds: list[str] = []

    def take(key: str) -> None:
        api.harness.advance(0.0)  # etcd's harness ends the leases that are due
        claim = rival.claim(key, payload={"key": key})
        kinds.append(claim.kind)
        assert isinstance(claim, Claimed)
        rival.complete(claim.token, "rival")

    if api.mode == "sync":

        def work(key: str) -> str:
            for _ in range(12):
                time.sleep(_step(api))
            take(key)
            return "late"

    else:

        async def work(key: str) -> str:  # type: ignore[misc]
            for _ in range(12):
                await asyncio.sleep(_step(api))
            take(key)
            return "late"

    call = api.wrap(SPEC, work, key=lambda key: key, heartbeat=False)
    try:
        with pytest.raises(StaleClaim) as caught:
            await call("k")
        assert not isinstance(caught.value, ClaimLost)  # no heartbeat: the plain error
        assert kinds == ["claimed"]
    finally:
        competitor.close()


async def test_without_heartbeat_a_long_body_loses_its_key(harness: Harness) -> None:
    """The test above can fail: with ``heartbeat=False`` a competitor takes over."""
    await each_face(harness, _without_heartbeat_a_long_body_loses_its_key)


async def _port_run_keeps_its_key_and_records(api: Facade) -> None:
    competitor = api.harness.sync()
    rival = competitor.idempotency(SPEC)
    port = api.coord.idempotency(SPEC)
    try:
        if api.mode == "sync":
            with port.run("blk", payload={"n": 1}) as attempt:
                assert not attempt.replayed and attempt.fence is not None
                for _ in range(6):
                    await _pause(api)
                    assert isinstance(rival.claim("blk", payload={"n": 1}), InFlight)
                attempt.result = {"ok": 1}
            with port.run("blk", payload={"n": 1}) as again:
                assert again.replayed and again.result == {"ok": 1}
            with pytest.raises(RuntimeError), port.run("err", payload={}):
                raise RuntimeError("boom")
        else:
            async with port.run("blk", payload={"n": 1}) as attempt:
                assert not attempt.replayed and attempt.fence is not None
                for _ in range(6):
                    await _pause(api)
                    assert isinstance(rival.claim("blk", payload={"n": 1}), InFlight)
                attempt.result = {"ok": 1}
            async with port.run("blk", payload={"n": 1}) as again:
                assert again.replayed and again.result == {"ok": 1}
            with pytest.raises(RuntimeError):
                async with port.run("err", payload={}):
                    raise RuntimeError("boom")
        replay = rival.claim("blk", payload={"n": 1})
        assert isinstance(replay, Completed) and replay.result == {"ok": 1}
        # An exception abandoned the claim: a retry runs.
        assert isinstance(rival.claim("err", payload={}), Claimed)
    finally:
        competitor.close()


async def test_port_run_keeps_its_key_and_records(harness: Harness) -> None:
    await each_face(harness, _port_run_keeps_its_key_and_records)


# ---- real processes: SIGKILL and SIGSTOP -------------------------------------------

CHILD = r"""
import asyncio, sys, time
import idemlock, idemlock.aio
from datetime import timedelta
from typing import Any
from idemlock import IdempotencySpec, ClaimLost, current_claim

url, prefix, mode, key, lease, body = sys.argv[1:]
# body: seconds the work takes, or "go": until the test writes a line to stdin
lease = float(lease)
spec = IdempotencySpec("beat-proc", ttl=timedelta(seconds=60), lease=timedelta(seconds=lease))

def say(*words):
    print(*words, flush=True)

if mode == "sync":
    coord = idemlock.connect(url, key_prefix=prefix)

    @coord.idempotent(spec, key=lambda: key)
    def work() -> str:
        say("started", current_claim().fence)
        sys.stdin.readline() if body == "go" else time.sleep(float(body))
        say("returning", current_claim().lost)
        return "child"

    try:
        work()
        say("recorded")
    except ClaimLost:
        say("ClaimLost")
else:
    async def main():
        coord = idemlock.aio.connect(url, key_prefix=prefix)

        @coord.idempotent(spec, key=lambda: key)
        async def work() -> str:
            say("started", current_claim().fence)
            if body == "go":
                await asyncio.to_thread(sys.stdin.readline)
            else:
                await asyncio.sleep(float(body))
            say("returning", current_claim().lost)
            return "child"

        try:
            await work()
            say("recorded")
        except ClaimLost:
            say("ClaimLost")
        await coord.close()

    asyncio.run(main())
"""

PROC_LEASE = 1.0


def _spawn(h: Harness, mode: str, key: str, body: float | str) -> subprocess.Popen[str]:
    """A worker running one decorated call on ``key`` whose body takes ``body`` seconds,
    or, with ``"go"``, lasts until the test writes a line to its stdin."""
    assert h.url is not None
    return popen(
        [sys.executable, "-c", CHILD, h.url, h.prefix, mode, key, str(PROC_LEASE), str(body)],
        stdin=subprocess.PIPE if body == "go" else None,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=False,
    )


def _started(proc: subprocess.Popen[str]) -> int:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("started"), line
    return int(line.split()[1])


MODES = ("sync", "async")
#: the spec the test process claims with, as the children do
PROC_SPEC = IdempotencySpec(
    "beat-proc", ttl=timedelta(seconds=60), lease=timedelta(seconds=PROC_LEASE)
)


def test_sigkilled_worker_frees_its_key_within_lease_and_one_interval(
    process_harness: Harness,
) -> None:
    """A sync and an async worker (at once, on keys of their own: the waits are spent
    once for both) hold their keys past the lease by heartbeats; SIGKILLed, each key
    frees itself within a lease and one renewal interval of the kill."""
    h = process_harness
    coord = h.sync()
    port = coord.idempotency(PROC_SPEC)
    procs = {mode: _spawn(h, mode, f"kill-me-{mode}", 60.0) for mode in MODES}
    try:
        fences = {mode: _started(proc) for mode, proc in procs.items()}
        time.sleep(2.5 * PROC_LEASE)  # past its lease: still held, thanks to heartbeats
        for mode in MODES:
            assert isinstance(port.claim(f"kill-me-{mode}", payload={}), InFlight), mode
        killed = {}
        for mode, proc in procs.items():
            os.kill(proc.pid, signal.SIGKILL)
            killed[mode] = time.monotonic()
        for proc in procs.values():
            proc.wait(10)
        # The last refusal is judged by the store after it was sent: the lease was still
        # live then. A slow poll (a loaded machine) only makes that moment earlier.
        held_until: dict[str, float] = {}
        claims: dict[str, Any] = {}
        while len(claims) < len(MODES):
            for mode in MODES:
                if mode in claims:
                    continue
                sent = time.monotonic()
                claim = port.claim(f"kill-me-{mode}", payload={})
                if isinstance(claim, Claimed):
                    claims[mode] = claim
                else:
                    held_until[mode] = sent
                    assert sent - killed[mode] < 10 * PROC_LEASE, f"{mode}: never freed"
            time.sleep(0.02)
        for mode in MODES:
            # The last renewal confirmed at most one interval before the kill reserves
            # the key for one lease from then (plus slack for the store's own delay).
            held = held_until.get(mode, killed[mode]) - killed[mode]
            assert held <= PROC_LEASE + PROC_LEASE / 3 + 0.5, (mode, held)
            assert claims[mode].token.fence > fences[mode], mode
            port.complete(claims[mode].token, "after the crash")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        coord.close()


def test_sigstopped_worker_loses_its_claim_and_its_completion_is_refused(
    process_harness: Harness,
) -> None:
    """A sync and an async worker (at once, on keys of their own) SIGSTOPped past their
    lease: a rival takes each key over, and each paused attempt's completion is refused
    (ClaimLost, nothing recorded)."""
    h = process_harness
    coord = h.sync()
    port = coord.idempotency(PROC_SPEC)
    # Each body lasts until the test says "go": on a loaded machine a timed body could
    # end (and record) before the test got to pause its worker.
    procs = {mode: _spawn(h, mode, f"pause-me-{mode}", "go") for mode in MODES}
    try:
        fences = {mode: _started(proc) for mode, proc in procs.items()}
        for proc in procs.values():
            os.kill(proc.pid, signal.SIGSTOP)
        # The rival's own lease is long: the paused worker's shutdown may take a while
        # on a loaded machine, and the rival must still hold the key after it.
        rival = coord.idempotency(
            IdempotencySpec("beat-proc", ttl=timedelta(seconds=60), lease=timedelta(seconds=60))
        )
        # The rival takes each key over once the paused worker's lease has run out: it
        # tries until then (each refusal is InFlight), not for a fixed time.
        stopped = time.monotonic()
        taken: dict[str, Any] = {}
        while len(taken) < len(MODES):
            if h.name.startswith("etcd"):
                h.advance(0.0)  # the harness ends the etcd leases that are due
            for mode in MODES:
                if mode in taken:
                    continue
                claim = rival.claim(f"pause-me-{mode}", payload={})
                if isinstance(claim, Claimed):
                    taken[mode] = claim
                else:
                    assert isinstance(claim, InFlight), (mode, claim)
                    assert time.monotonic() - stopped < 20 * PROC_LEASE, f"{mode}: never freed"
            time.sleep(0.05)
        for mode in MODES:
            assert taken[mode].token.fence > fences[mode], mode
        for proc in procs.values():
            os.kill(proc.pid, signal.SIGCONT)
        for mode, proc in procs.items():
            out, _ = proc.communicate("go\n", timeout=30)
            assert "ClaimLost" in out.split(), (mode, out)
            assert "recorded" not in out.split(), (mode, out)
        for mode in MODES:
            key = f"pause-me-{mode}"
            # The paused attempt recorded nothing; the one that took over is intact.
            assert isinstance(port.claim(key, payload={}), InFlight), mode
            port.complete(taken[mode].token, "rival")
            replay = port.claim(key, payload={})
            assert isinstance(replay, Completed) and replay.result == "rival", mode
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=30)
        coord.close()


def test_renewer_is_one_per_coordinator(harness: Harness) -> None:
    """Many concurrent decorated calls share the coordinator's one renewer (one thread),
    and renew in batches where the store has ``renew_many``."""
    coord = harness.sync()
    try:
        import threading

        before = [t for t in threading.enumerate() if t.name == "idemlock-renewer"]
        assert coord._renewer is coord.for_tenant("x")._renewer
        spec = IdempotencySpec("beat-many", lease=timedelta(seconds=LEASE))
        gate = threading.Barrier(21)

        @coord.idempotent(spec, key=lambda i: f"m{i}")
        def work(i: int) -> int:
            gate.wait(10)  # all 20 in flight at once
            gate.wait(10)
            return i

        threads = [threading.Thread(target=work, args=(i,)) for i in range(20)]
        for t in threads:
            t.start()
        gate.wait(10)
        renewers = [t for t in threading.enumerate() if t.name == "idemlock-renewer"]
        # Other tests' renewers may still be winding down; this one added one at most.
        assert len(renewers) - len(before) <= 1
        assert coord._renewer._thread is not None
        gate.wait(10)
        for t in threads:
            t.join(10)
        assert isinstance(coord.idempotency(spec).claim("m3", payload={"i": 3}), Completed)
    finally:
        coord.close()


async def _a_refused_renewal_is_loud(api: Facade) -> None:
    """Another party ends the claim mid-body (an operator's forget, then a new claim):
    the next renewal is refused, ``current_claim().lost`` turns True, ``on_lost`` runs,
    an async body is cancelled, and the call raises ClaimLost recording nothing."""
    competitor = api.harness.sync()
    rival = competitor.idempotency(SPEC)
    told: list[int] = []
    after: list[bool] = []
    taken: list[int] = []

    def take_over(key: str) -> None:
        assert rival.forget(key)
        claim = rival.claim(key, payload={"key": key})
        assert isinstance(claim, Claimed)
        taken.append(claim.token.fence)

    if api.mode == "sync":

        def work(key: str) -> str:
            take_over(key)
            deadline = time.monotonic() + 20  # bounded: the watchdog may run late
            while time.monotonic() < deadline:
                time.sleep(_step(api))
                claim = current_claim()
                assert claim is not None
                if claim.lost and told:  # on_lost runs right after the flag is set
                    break
            after.append(bool(current_claim() and current_claim().lost))  # type: ignore[union-attr]
            return "late"

    else:

        async def work(key: str) -> str:  # type: ignore[misc]
            take_over(key)
            try:
                for _ in range(400):  # 20 s or more: the watchdog may run late
                    await asyncio.sleep(_step(api))
            except asyncio.CancelledError:
                after.append(True)
                raise
            after.append(False)
            return "late"

    call = api.wrap(SPEC, work, key=lambda key: key, on_lost=lambda token: told.append(token.fence))
    try:
        with pytest.raises(ClaimLost, match="lost the claim"):
            await call("gone")
        assert len(told) == 1 and after == [True]
        status = rival.status("gone")
        # The attempt that took over is untouched: nothing of the lost one was recorded.
        assert status is not None and (status.state, status.fence) == ("in_flight", taken[0])
    finally:
        competitor.close()


async def test_a_refused_renewal_is_loud(harness: Harness) -> None:
    """Another party ends the claim mid-body (an operator's forget, then a new claim):
    the next renewal is refused, ``current_claim().lost`` turns True, ``on_lost`` runs,
    an async body is cancelled, and the call raises ClaimLost recording nothing."""
    await each_face(harness, _a_refused_renewal_is_loud)
