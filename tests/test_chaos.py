"""The fault-injection runner, ``benchmarks/chaos.py``, in its CI configuration.

Each test runs ``chaos.py --short --json`` in a subprocess (it starts its own
throwaway servers on loopback ports, its worker processes and its faults) and reads
the report: the runner has already checked the data (one effect row per job, no
stale token accepted, completed keys replay the effect's value, nothing left
claimed; exactly-once effects in the same-transaction mode). Here we assert that it
found no violation and that every kind of fault that applies to the store was really
injected, so a green run cannot be a run where nothing happened.

About 15-20 s per store; the whole file stays around 1.5 minutes on a 2-core machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAOS = ROOT / "benchmarks" / "chaos.py"
#: the faults that apply to each store (SQLite has no server to restart or connection
#: to cut)
KINDS = {
    "sqlite": ("kill", "stop"),
    "redis": ("kill", "stop", "restart", "cut"),
    "redis-cluster": ("kill", "stop", "restart", "cut"),
    "postgres": ("kill", "stop", "restart", "cut"),
}
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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("store", ["sqlite", "redis", "redis-cluster", "postgres"])
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
