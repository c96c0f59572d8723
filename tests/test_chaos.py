"""The fault-injection runner, ``benchmarks/chaos.py``, in its CI configuration.

Each test runs ``chaos.py --short --json`` in a subprocess (it starts its own
throwaway servers on loopback ports, its worker processes and its faults) and reads
the report: the runner has already checked the data (one effect row per job, no
stale token accepted, completed keys replay the effect's value, nothing left
claimed; exactly-once effects in the same-transaction mode). Here we assert that it
found no violation and that every kind of fault that applies to the store was really
injected, so a green run cannot be a run where nothing happened.

The lock workload (``--workload lock``) runs ``hold()`` with renewals and fenced writes
under the lock while workers are killed, paused past the ttl and the network goes silent
(blackholes); the runner checks the write history (no stale write accepted, no two
holders' writes interleaved, tokens increase, no write while ``remaining()`` claimed a
lease another holder had been granted). The checker itself is tested on crafted
histories here, and its plain (unfenced) mode must find what the fence prevents.

The steps workload of issue 25 (``--workload steps``) runs each job in three steps
(``attempt.step``), each an effect with its own fenced row, the second ``once=True``;
the runner checks that no step an attempt finished ran again, that the ``once=True``
step never ran twice (found interrupted, it is settled), and that completed jobs replay
their steps' values; its plain mode (the steps called directly) must show finished
steps running again.

The counted leases of issue 24 run the same way: ``--workload permits`` (a semaphore's
``hold()``, 2 permits of one key for 4 workers, writes through a counted fence: never more
than 2 holders' writes interleaved, no token reused, tokens increasing as granted; its
plain mode shows more) and ``--workload election`` (``campaign()``, the term's number as
the token, the lock's checker: no two leaders' writes interleaved, terms increasing).

``--short`` ends each run's faults as soon as every kind that applies has landed and
the run shows what it is about (``--until-faults 1``: jobs done, or a paused worker's
effect run twice in plain mode; leases changed hands, were written under and lost to the
faults, the permits' keys full; the negative controls' findings), rather than after a
fixed window: a few seconds per store and workload on an idle machine, the whole window
and more on a busy one.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import idemlock

ROOT = Path(__file__).resolve().parents[1]
CHAOS = ROOT / "benchmarks" / "chaos.py"
#: the faults that apply to each store (SQLite has no server to restart or connection
#: to cut)
KINDS = {
    "sqlite": ("kill", "stop"),
    "redis": ("kill", "stop", "restart", "cut", "blackhole"),
    "redis-cluster": ("kill", "stop", "restart", "cut", "blackhole"),
    "postgres": ("kill", "stop", "restart", "cut", "blackhole"),
    # etcd's "restart": a SIGKILL of the leader and its restart, or a member paused
    "etcd": ("kill", "stop", "restart", "cut", "blackhole"),
    # Sentinel's "restart": a failover (the primary SIGKILLed, the replica promoted)
    "redis-sentinel": ("kill", "stop", "restart"),
}
#: the lock workload's faults (no Redis restarts: an empty Redis forgets its leases)
LOCK_KINDS = {
    "sqlite": ("kill", "stop"),
    "redis": ("kill", "stop", "cut", "blackhole"),
    "redis-cluster": ("kill", "stop", "cut", "blackhole"),
    "postgres": ("kill", "stop", "restart", "cut", "blackhole"),
    "etcd": ("kill", "stop", "restart", "cut", "blackhole"),
    "redis-sentinel": ("kill", "stop", "restart"),
}
#: every store the runner drives (etcd: a 3-member cluster, each member behind a proxy)
STORES = ["sqlite", "redis", "redis-cluster", "redis-sentinel", "postgres", "etcd"]
SEED = "20261129"


def run_chaos(*args: str) -> tuple[int, dict[str, Any]]:
    cmd = [sys.executable, str(CHAOS), "--short", "--json", "--seed", SEED, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(
            f"chaos.py {' '.join(args)} printed no JSON report (exit {proc.returncode}):\n"
            f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
        )
    (run,) = report["runs"]
    return proc.returncode, run


def assert_ran_under_faults(run: dict[str, Any], store: str) -> None:
    assert run["store"] == store
    assert run["jobs"] > 0
    for kind in KINDS[store]:
        assert run["faults"][kind] > 0, f"no {kind} fault was injected: {run['faults']}"
    # Every job ran its effect at least once; redeliveries happened.
    assert run["effects_run"] >= run["jobs"]
    assert run["deliveries"] >= run["jobs"]
    assert run["effects_run"] == run["jobs"] + run["repeated_effects"]


def assert_etcd_member_faults(run: dict[str, Any]) -> None:
    # Every etcd "restart" was a leader's SIGKILL and restart or a member's pause.
    etcd = run["etcd_faults"]
    assert sum(etcd.values()) == run["faults"]["restart"] > 0, etcd
    assert set(etcd) <= {"leader_kill", "member_pause"}, etcd


@pytest.mark.timeout(300)
@pytest.mark.parametrize("store", STORES)
def test_idemlock_effects_hold_under_faults(store: str) -> None:
    code, run = run_chaos("--store", store)
    assert run["violations_total"] == 0, "\n".join(run["examples"])
    assert code == 0
    assert run["mode"] == "idemlock" and not run["same_transaction"]
    assert_ran_under_faults(run, store)
    assert run["stale_writes_accepted"] == 0
    if store in ("redis", "redis-cluster"):
        # Restarts of an unpersisted Redis lose records: that is the fault, not a bug.
        assert run["records_lost_with_data"] >= 0
    else:
        assert run["records_lost_with_data"] == 0
    if store == "etcd":
        assert_etcd_member_faults(run)


@pytest.mark.timeout(300)
def test_same_transaction_mode_runs_each_effect_exactly_once() -> None:
    code, run = run_chaos("--store", "postgres", "--same-transaction")
    assert run["violations_total"] == 0, "\n".join(run["examples"])
    assert code == 0
    assert run["same_transaction"]
    assert_ran_under_faults(run, "postgres")
    # The effect, its log row and the completion commit together: no window left.
    assert run["repeated_effects"] == 0
    assert run["effects_run"] == run["jobs"]


@pytest.mark.timeout(300)
def test_plain_mode_completes_and_reports_duplicates() -> None:
    code, run = run_chaos("--store", "sqlite", "--mode", "plain")
    # Duplicates are what plain mode shows, not a failure of the runner.
    assert code == 0
    assert run["violations_total"] == 0, "\n".join(run["examples"])
    assert run["mode"] == "plain"
    assert_ran_under_faults(run, "sqlite")
    assert run["stale_writes_refused"] == 0  # nothing is fenced
    # A worker paused (holding a job) for longer than the visibility timeout has its
    # job delivered again while it still runs it: both write the effect.
    assert run["repeated_effects"] > 0


# ---- the steps workload (issue 25) ------------------------------------------------------


@pytest.mark.timeout(300)
@pytest.mark.parametrize("store", STORES)
def test_finished_steps_never_run_again_under_faults(store: str) -> None:
    # Each job runs three steps through attempt.step, each an effect with its own fenced
    # row (the second with once=True). The runner found no step that an attempt had
    # finished (recorded) running again, no once=True step running twice, no stale step
    # write accepted, and every completed job replaying its steps' values.
    code, run = run_chaos("--store", store, "--workload", "steps")
    assert run["violations_total"] == 0, "\n".join(run["examples"])
    assert code == 0
    assert run["workload"] == "steps" and run["store"] == store and run["mode"] == "idemlock"
    for kind in KINDS[store]:
        assert run["faults"][kind] > 0, f"no {kind} fault was injected: {run['faults']}"
    assert run["jobs"] > 0 and run["deliveries"] >= run["jobs"]
    # Every step of every job ran, but a once=True step found interrupted before its
    # effect ran (settled, never run again); repeats are steps in flight at a fault.
    assert run["steps_run"] >= run["steps"] * run["jobs"] - run["steps_interrupted"]
    assert run["stale_writes_accepted"] == 0
    assert run["unguarded_findings"] == {}
    if store not in ("redis", "redis-cluster"):
        # Only a restart of an unpersisted Redis forgets records (and so steps).
        assert run["records_lost_with_data"] == run["steps_rerun_after_data_loss"] == 0
    if store == "etcd":
        assert_etcd_member_faults(run)


@pytest.mark.timeout(300)
def test_steps_plain_mode_shows_finished_steps_running_again() -> None:
    # The negative control: the same steps called directly, without records. A job
    # redelivered after a fault runs its finished steps again, and the checker must
    # find it (what the steps' records prevent, so not violations of this run).
    code, run = run_chaos("--store", "sqlite", "--workload", "steps", "--mode", "plain")
    assert run["violations_total"] == 0, "\n".join(run["examples"])
    assert code == 0
    assert run["mode"] == "plain"
    assert run["faults"]["stop"] > 0 and run["faults"]["kill"] > 0, run["faults"]
    assert run["unguarded_findings"]["finished_step_ran_again"] > 0, run


# ---- the lock workload ------------------------------------------------------------------


def run_lease_workload(store: str, workload: str) -> dict[str, Any]:
    """A short run of a lease workload (lock, permits, election) with no violation, in
    which the faults reached the holders. The runner's faults go on until they did (for
    ``--duration`` and half a minute more); a loaded machine may still leave a run
    without them: that run proves nothing either way, so it runs again (at most three
    times). Every run, the first ones included, must have no violation."""
    for _ in range(3):
        code, run = run_chaos("--store", store, "--workload", workload)
        assert run["violations_total"] == 0, "\n".join(run["examples"])
        assert code == 0
        ev = run["worker_events"]
        hit = ev.get("lock_lost", 0) + ev.get("store_error", 0) + ev.get("fx_error", 0)
        full = workload != "permits" or run["most_holders_interleaved"] == run["limit"]
        if hit > 0 and (store == "postgres" or run["leases_lost"] > 0) and full:
            break
    assert run["workload"] == workload and run["store"] == store and run["mode"] == "idemlock"
    for kind in LOCK_KINDS[store]:
        assert run["faults"][kind] > 0, f"no {kind} fault was injected: {run['faults']}"
    # Leases changed hands and were written under, and the faults reached the holders:
    # leases lost (and on_lost told), or blocks ended by a store failure (PostgreSQL's
    # crashes and cuts end most of its holds that way).
    assert run["holds"] > 3
    assert run["writes_accepted"] > 0
    assert hit > 0, ev
    assert run["leases_lost"] == ev.get("lock_lost", 0)
    if store != "postgres":
        assert run["leases_lost"] > 0 and run["on_lost_calls"] > 0, ev
    if store == "etcd":
        assert_etcd_member_faults(run)
    return run


@pytest.mark.timeout(720)
@pytest.mark.parametrize("store", STORES)
def test_lock_writes_stay_fenced_under_faults(store: str) -> None:
    run = run_lease_workload(store, "lock")
    fence = {"etcd": "check_and_advance"}.get(store, "sql")
    assert run["fence"] == ("set_if_fresh" if store.startswith("redis") else fence)


@pytest.mark.timeout(720)
@pytest.mark.parametrize("store", STORES)
def test_permit_writes_never_exceed_the_limit_under_faults(store: str) -> None:
    # Workers contend for 2 permits of one key (4 workers) and write through a counted
    # fence; the checker found no more than 2 holders' writes interleaved, no token
    # reused, tokens increasing as granted (violations_total == 0 above).
    run = run_lease_workload(store, "permits")
    assert run["fence"] == "counted" and run["limit"] == 2
    # The key was full: two holders' writes did interleave (the limit was reached,
    # never passed).
    assert run["most_holders_interleaved"] == run["limit"], run


@pytest.mark.timeout(720)
@pytest.mark.parametrize("store", STORES)
def test_election_leaders_writes_stay_fenced_under_faults(store: str) -> None:
    # campaign() in place of hold(), the term's number as the token: the checker found
    # no two leaders' writes interleaved, terms strictly increasing, none reused.
    run = run_lease_workload(store, "election")
    fence = {"etcd": "check_and_advance"}.get(store, "sql")
    assert run["fence"] == ("set_if_fresh" if store.startswith("redis") else fence)


@pytest.mark.timeout(300)
def test_lock_plain_mode_shows_what_the_fence_prevents() -> None:
    # The negative control: the same workload with unfenced writes, paused holders.
    # The checker must find their late writes landing over a newer holder's.
    code, run = run_chaos("--store", "sqlite", "--workload", "lock", "--mode", "plain")
    assert run["violations_total"] == 0, "\n".join(run["examples"])
    assert code == 0
    assert run["mode"] == "plain" and run["fence"] == "none"
    assert run["faults"]["stop"] > 0 and run["faults"]["kill"] > 0, run["faults"]
    found = run["unfenced_findings"]
    assert found["stale_write_accepted"] + found["writes_interleaved"] > 0, run


@pytest.mark.timeout(300)
def test_permits_plain_mode_shows_what_the_counted_fence_prevents() -> None:
    # The negative control of the permits workload: unfenced writes, paused holders
    # waking after their permit went to a waiter. The checker must find more holders'
    # writes interleaved than the limit allows.
    code, run = run_chaos("--store", "sqlite", "--workload", "permits", "--mode", "plain")
    assert run["violations_total"] == 0, "\n".join(run["examples"])
    assert code == 0
    assert run["mode"] == "plain" and run["fence"] == "none"
    assert run["faults"]["stop"] > 0 and run["faults"]["kill"] > 0, run["faults"]
    assert run["unfenced_findings"]["too_many_holders"] > 0, run
    assert run["most_holders_interleaved"] > run["limit"], run


def _chaos_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("chaos_under_test", CHAOS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


chaos = _chaos_module()


class History:
    """A crafted lock history: holds and write log rows as the workers record them."""

    def __init__(self) -> None:
        self.holds: list[tuple[Any, ...]] = []
        self.log: list[tuple[Any, ...]] = []

    def hold(self, holder: str, token: int, before: float, after: float, res: str = "r") -> None:
        self.holds.append((res, holder, token, before, after))

    def write(
        self,
        holder: str,
        token: int,
        sent: float,
        done: float | None = None,
        accepted: bool | None = True,
        left: float = 0.5,
        res: str = "r",
    ) -> None:
        row_id = len(self.log) + 1
        self.log.append((row_id, res, holder, token, row_id, sent, done, accepted, left <= 0, left))

    def check(self, exact: bool) -> dict[str, Any]:
        return dict(chaos.check_lock_history(self.holds, self.log, exact=exact))


def clean_history(timed: bool) -> History:
    h = History()
    h.hold("a", 1, 0.0, 0.01)
    h.write("a", 1, 0.02, 0.03 if timed else None, left=0.9)
    h.write("a", 1, 0.04, 0.05 if timed else None, left=0.9)
    h.hold("b", 2, 0.03, 1.1)  # waited for a's lease to run out
    h.write("b", 2, 1.2, 1.21 if timed else None, left=0.9)
    # a, paused past its ttl, tries late: refused
    h.write("a", 1, 1.3, 1.31 if timed else None, accepted=False, left=0.0)
    h.write("b", 2, 1.4, 1.41 if timed else None, left=0.7)
    return h


@pytest.mark.parametrize("timed", [False, True])
def test_checker_accepts_a_clean_history(timed: bool) -> None:
    found = clean_history(timed).check(exact=not timed)
    assert found["violations"] == {}, found["examples"]
    assert found["writes_accepted"] == 4
    assert found["stale_writes_refused"] == 1
    assert found["writes_after_deadline"] == 1


def test_checker_finds_a_stale_and_interleaved_write_in_acceptance_order() -> None:
    h = clean_history(timed=False)
    h.write("a", 1, 1.5, None, accepted=True, left=0.0)  # the fence let it through
    found = h.check(exact=True)
    assert found["violations"] == {"stale_write_accepted": 1, "writes_interleaved": 1}
    assert "a token 1 accepted" in found["examples"][0]


def test_checker_finds_interleaving_with_one_token_shared_by_two_holders() -> None:
    # Equal tokens pass a fence: only the holders tell the writes apart.
    h = History()
    h.hold("a", 7, 0.0, 0.01)
    h.hold("b", 7, 0.02, 0.03)
    h.write("a", 7, 0.04)
    h.write("b", 7, 0.05)
    h.write("a", 7, 0.06)
    found = h.check(exact=True)
    assert found["violations"]["writes_interleaved"] == 1
    assert found["violations"]["token_reused"] == 1
    assert found["violations"]["token_not_increasing"] == 1


def test_checker_judges_timed_writes_only_when_their_order_is_certain() -> None:
    h = History()
    h.hold("a", 1, 0.0, 0.01)
    h.hold("b", 2, 0.0, 0.5)
    h.write("a", 1, 0.10, 0.20, left=0.0)
    h.write("b", 2, 0.15, 0.60, left=0.0)  # overlaps both of a's: order unknown
    h.write("a", 1, 0.55, 0.70, left=0.0)
    assert h.check(exact=False)["violations"] == {}
    h.write("b", 2, 0.80, 0.90, left=0.0)
    h.write("a", 1, 1.00, 1.10, left=0.0)  # surely after b's write done at 0.90
    found = h.check(exact=False)
    assert found["violations"] == {"stale_write_accepted": 1, "writes_interleaved": 1}, found


def test_checker_finds_a_write_made_on_a_lease_another_holder_was_granted() -> None:
    h = History()
    h.hold("a", 1, 0.0, 0.01)
    h.hold("b", 2, 0.02, 1.0)
    # a still believed 0.3 s were left when b's block had already started
    h.write("a", 1, 1.1, None, accepted=False, left=0.3)
    found = h.check(exact=True)
    assert found["violations"] == {"lease_overlap": 1}, found
    assert "remaining()=0.300s" in found["examples"][0]
    # The same write with no time left is the fence's job, not a broken lease.
    h.log[-1] = (*h.log[-1][:8], True, 0.0)
    assert h.check(exact=True)["violations"] == {}


def test_checker_keeps_resources_apart() -> None:
    h = History()
    h.hold("a", 5, 0.0, 0.01, res="r1")
    h.hold("b", 1, 0.02, 0.03, res="r2")  # lower token, other resource: fine
    h.write("a", 5, 0.04, res="r1")
    h.write("b", 1, 0.05, res="r2")
    h.write("a", 5, 0.06, res="r1")
    assert h.check(exact=True)["violations"] == {}


def test_permit_checker_accepts_up_to_the_limit_interleaved() -> None:
    h = History()
    h.hold("a", 1, 0.0, 0.01)
    h.hold("b", 2, 0.0, 0.02)
    h.write("a", 1, 0.03)
    h.write("b", 2, 0.04)
    h.write("a", 1, 0.05)
    h.hold("c", 3, 0.0, 0.5)  # waited for a's permit
    h.write("b", 2, 0.6)
    h.write("c", 3, 0.7)
    h.write("b", 2, 0.8)
    found = chaos.check_permit_history(h.holds, h.log, limit=2)
    assert found["violations"] == {}, found["examples"]
    assert found["most_holders_interleaved"] == 2
    assert found["writes_accepted"] == 6


def test_permit_checker_finds_more_holders_interleaved_than_the_limit() -> None:
    h = History()
    h.hold("a", 1, 0.0, 0.01)
    h.hold("b", 2, 0.0, 0.02)
    h.hold("c", 3, 0.03, 0.5)
    h.write("a", 1, 0.6)
    h.write("b", 2, 0.61)
    h.write("c", 3, 0.62)
    h.write("b", 2, 0.63)
    h.write("a", 1, 0.64, left=0.0)  # a paused past its ttl, its late write let through
    found = chaos.check_permit_history(h.holds, h.log, limit=2)
    assert found["violations"] == {"too_many_holders": 1}, found
    assert "3 holders' writes interleaved (limit 2): a, b, c" in found["examples"][0]
    assert found["most_holders_interleaved"] == 3
    assert chaos.check_permit_history(h.holds, h.log, limit=3)["violations"] == {}
    # b's writes all before c's first: two at a time, whatever the tokens
    del h.log[-2]
    assert chaos.check_permit_history(h.holds, h.log, limit=2)["violations"] == {}


def test_permit_checker_finds_reused_and_decreasing_tokens() -> None:
    h = History()
    h.hold("a", 1, 0.0, 0.01)
    h.hold("b", 2, 0.02, 0.03)
    h.hold("c", 2, 0.04, 0.05)  # b's token again, granted after it
    h.write("b", 2, 0.1)
    h.write("c", 2, 0.2)
    h.write("a", 1, 0.3)
    found = chaos.check_permit_history(h.holds, h.log, limit=3)
    assert found["violations"] == {"token_reused": 1, "token_not_increasing": 1}, found


class StepHistory:
    """A crafted steps history: the step_log rows and effect rows the workers write."""

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.rows: dict[str, tuple[int, str]] = {}
        self.jobs: set[int] = set()

    def add(self, job: int, step: str, kind: str, fence: int, ok: bool = True) -> None:
        self.jobs.add(job)
        row_id = len(self.log) + 1
        self.log.append((row_id, job, step, kind, fence, "w1", ok, float(row_id)))

    def run(self, job: int, step: str, fence: int, done: bool = True) -> None:
        """Step ``step`` ran with ``fence`` (its fenced row written); ``done``: the
        attempt saw it return (its result recorded)."""
        self.add(job, step, "run", fence)
        self.rows[f"{job}/{step}"] = (fence, f"{job}/{step}/{fence}")
        if done:
            self.add(job, step, "done", fence)

    def check(self, lost: bool = False) -> tuple[dict[str, int], dict[str, Any]]:
        snap = {
            "jobs": [(job, "done", 1) for job in sorted(self.jobs)],
            "effects": [(k, f, v) for k, (f, v) in self.rows.items()],
            "log": self.log,
        }
        found, figures, _ = chaos.check_steps_history(snap, lambda t0, t1: lost)
        return dict(found.violations), figures


def test_steps_checker_accepts_repeats_of_steps_in_flight() -> None:
    h = StepHistory()
    # job 1: killed inside s3 (not recorded); the retry replays s1, s2 and runs s3
    h.run(1, "s1", 1)
    h.run(1, "s2", 1)
    h.run(1, "s3", 1, done=False)
    h.run(1, "s3", 2)
    # job 2: killed inside the once=True s2 after its effect: found interrupted, settled
    h.run(2, "s1", 1)
    h.run(2, "s2", 1, done=False)
    h.add(2, "s2", "interrupted", 2)
    h.run(2, "s3", 2)
    # job 3: a paused attempt's late s1 write, refused by the fence
    h.run(3, "s1", 2)
    h.add(3, "s1", "run", 1, ok=False)
    h.run(3, "s2", 2)
    h.run(3, "s3", 2)
    found, figures = h.check()
    assert found == {}, found
    assert figures["steps_repeated"] == 1 and figures["steps_interrupted"] == 1
    assert figures["steps_run"] == 10 and figures["stale_writes_refused"] == 1


def test_steps_checker_finds_a_finished_step_run_again() -> None:
    h = StepHistory()
    h.run(1, "s1", 1)  # recorded: the attempt saw it return
    h.run(1, "s1", 2)
    h.run(1, "s2", 2)
    h.run(1, "s3", 2)
    h.run(2, "s1", 1, done=False)
    h.run(2, "s2", 1, done=False)  # reached s2: s1 was recorded
    h.run(2, "s1", 2)
    h.add(2, "s2", "interrupted", 2)
    h.run(2, "s3", 2)
    found, _ = h.check()
    assert found == {"finished_step_ran_again": 2}, found


def test_steps_checker_finds_a_once_step_run_twice_unless_its_record_was_lost() -> None:
    h = StepHistory()
    h.run(1, "s1", 1)
    h.run(1, "s2", 1, done=False)
    h.run(1, "s2", 2)  # once=True: must have been found interrupted instead
    h.run(1, "s3", 2)
    found, figures = h.check()
    assert found == {"once_step_repeated": 1}, found
    # A store restart that forgot the records in between: counted apart, not judged.
    found, figures = h.check(lost=True)
    assert found == {} and figures["steps_rerun_after_data_loss"] == 1, (found, figures)


# ---- the workers' start-up ---------------------------------------------------------------


def test_a_worker_that_cannot_connect_at_start_up_retries(
    fault_redis_cluster: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker (re)started while its store is cut off, as the chaos runner's are (a
    Redis Cluster client reads the slot map as it connects): it tries again until the
    store answers, as a real worker does, instead of crashing at start-up."""
    from .servers.faults import cluster_faults

    worker = sys.modules["faults.worker"]  # loaded with the runner
    url, faults = cluster_faults(fault_redis_cluster)
    failed = threading.Event()
    real_connect = idemlock.connect

    def observed(*args: Any, **kwargs: Any) -> Any:
        try:
            return real_connect(*args, **kwargs)
        except idemlock.StoreUnavailable:
            failed.set()
            raise

    monkeypatch.setattr(idemlock, "connect", observed)
    got: dict[str, Any] = {}

    def start() -> None:
        try:
            got["coord"] = worker.connect(url)
        except BaseException as exc:
            got["error"] = exc

    thread = threading.Thread(target=start, daemon=True)
    try:
        with faults.outage():
            thread.start()
            assert failed.wait(60), "connect() was not tried while the cluster was down"
            assert "error" not in got, got  # it did not give up: it tries again
        thread.join(90)
        assert not thread.is_alive(), "connect() did not return once the cluster was back"
        assert "error" not in got, got
        coord = got["coord"]
        try:
            locks = coord.lock(idemlock.LockSpec("start-up", ttl=timedelta(seconds=30)))
            lease = locks.acquire("k")
            assert lease is not None
            locks.release(lease)
        finally:
            coord.close()
    finally:
        faults.close()
