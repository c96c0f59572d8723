"""``benchmarks/goals.py --smoke``: issue 13's goal table, each row with its verdict.

The command starts its own throwaway servers and measures every goal next to the
baseline it names. Timings are never asserted here (a shared 2-core machine decides
them): only that every goal is measured and judged, and that the reference baselines
(the bare-socket limit, the asyncio alternatives) are printed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: the start of each goal's figure, in the issue's order
GOALS = [
    "Redis acquire+release, sync",
    "Redis claim+complete, sync",
    "asyncio, 100 tasks: acquire+release",
    "crash-safe job: claim, fenced write, complete",
    "contention, Redis, 4 processes, 1 ms holds",
    "single waiter (Redis)",
    "PostgreSQL claim+complete, sync",
    "PostgreSQL acquire+release, sync",
    "SQLite claim+complete, sync",
    "SQLite acquire+release, sync",
    "`import idemlock`, fresh interpreter",
    "contention, Redis Cluster",
    "contention, PostgreSQL",
    "fairness, memory",
    "fairness, SQLite",
]


@pytest.mark.timeout(300)
def test_goals_quick_prints_every_goal_with_a_verdict(tmp_path: Path) -> None:
    out, doc = tmp_path / "goals.json", tmp_path / "benchmarks.md"
    doc.write_text("# the report\n\n<!-- goals.py -->\nan older table\n<!-- /goals.py -->\n")
    args = ["--smoke", "--json", str(out), "--doc", str(doc)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "goals.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    rows = json.loads(out.read_text())
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    for goal in GOALS:
        (row,) = [r for r in rows if r["figure"].startswith(goal) and not r["reference"]]
        assert row["verdict"] == "MEETS" or row["verdict"].startswith("SHORT of goal by "), row
        assert row["goal"].startswith(("≥", "≤")) and row["measured"], row
        (line,) = [t for t in table if t.startswith(f"| {row['figure']} |")]
        assert line.rstrip().endswith(f"| {row['verdict']} |"), line
    reference = [r["figure"] for r in rows if r["reference"]]
    assert sum("physical limit" in f for f in reference) == 2, reference
    assert any("coredis" in f for f in reference) and any("valkey-glide" in f for f in reference)
    assert f"of {len([r for r in rows if not r['reference']])} goals met" in proc.stdout
    # --doc replaced the goals section of the report, and only it.
    text = doc.read_text()
    assert text.startswith("# the report\n") and "an older table" not in text
    assert text.count("<!-- goals.py -->") == 1 and "## Issue 13's goals" in text
    assert all(line in text for line in table)
