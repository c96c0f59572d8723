"""``benchmarks/costs.py steps``: the cost of a recorded step against a hand-written
fenced upsert of the same bytes, on every store (issue 25).

The command starts its own throwaway servers. Timings are never asserted here (a
shared 2-core machine decides them): only that every store and value has its row, with
the steps asked for, the same bytes on both sides, and finite, positive figures.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
STORES = ["memory", "sqlite", "redis", "postgres", "etcd"]
TITLES = ["memory", "SQLite", "Redis", "PostgreSQL", "etcd"]
SCALE = {"memory": 5, "sqlite": 2, "redis": 1, "postgres": 1, "etcd": 0.2}


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.timeout(300)
def test_steps_reports_ours_and_hand_written_on_every_store(tmp_path: Path) -> None:
    out = tmp_path / "steps.json"
    args = ["steps", "--n", "20", "--rounds", "1", "--per_claim", "4", "--json", str(out)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "costs.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    assert report["meta"]["per_claim"] == 4 and report["meta"]["rounds"] == 1
    assert set(report["meta"]["hand_written"]) == set(STORES)
    rows = report["rows"]
    assert [(r["store"], r["value"]) for r in rows] == [
        (s, v) for s in STORES for v in ("small", "4 KiB")
    ]
    for r in rows:
        # whole claims of 4 steps, at least the steps asked for
        claims = math.ceil(20 * SCALE[r["store"]] / 4)
        assert r["steps"] == claims * 4 and r["rounds"] == 1, r
        for k in ("ours_us", "hand_us", "ours_cpu_us", "hand_cpu_us", "ratio"):
            assert positive(r[k]), (k, r)
    small, large = rows[0]["bytes"], rows[1]["bytes"]
    assert small < 200 and 4000 <= large <= 4200
    assert all(r["bytes"] == (small if r["value"] == "small" else large) for r in rows)
    # the table: one row per store and value, with both sides and the ratio
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    for title in TITLES:
        got = [line for line in lines if line.startswith(f"| {title} |")]
        assert len(got) == 2 and all("\u00d7" in line for line in got), got
