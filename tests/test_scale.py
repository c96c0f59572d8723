"""``benchmarks/scale.py --smoke``: issue 28's scale figures, every store, each judged.

The command starts its own throwaway servers and measures how cost grows with the
records in a store, a purge, heartbeated claims, waiters on one lock and the
PostgreSQL connections of a fleet of processes. Timings are never asserted here (a
shared 2-core machine decides them): only that every figure is there for every store,
with the counts asked for, finite and positive, and a verdict.
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
STORES = ["sqlite", "postgres", "redis"]


def positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.timeout(600)
def test_scale_quick_reports_every_figure_for_every_store(tmp_path: Path) -> None:
    out, doc = tmp_path / "scale.json", tmp_path / "benchmarks.md"
    doc.write_text("# the report\n\n<!-- scale.py -->\nolder figures\n<!-- /scale.py -->\n")
    args = ["--smoke", "--json", str(out), "--doc", str(doc)]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "scale.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    report = json.loads(out.read_text())
    sizes = report["config"]["sizes"]
    assert len(sizes) >= 2 and sizes == sorted(sizes)

    assert [r["store"] for r in report["records"]] == STORES
    for r in report["records"]:
        assert r["sizes"] == sizes, r
        for key in ("pairs_per_s", "p99_ms", "bytes", "fill_s"):
            assert len(r[key]) == len(sizes) and all(positive(v) for v in r[key]), (key, r)
        # every store measured the pairs asked for, in every round
        assert r["pairs"] == [report["config"]["n"] * report["config"]["rounds"]] * len(sizes)
        assert all(positive(r[g]) for g in ("growth_time", "growth_p99", "growth_bytes")), r

    assert [r["store"] for r in report["purge"]] == ["sqlite", "postgres"]
    for r in report["purge"]:
        # every expired record went, none of the live ones the caller made meanwhile
        assert r["removed"] == r["records"] == report["config"]["purge"], r
        assert positive(r["seconds"]) and positive(r["worst_call_ms"]) and r["calls"] > 0, r
        assert r["peak_rss_mib"] >= 0 and r["error_count"] == 0, r

    assert [r["store"] for r in report["live"]] == STORES
    for r in report["live"]:
        assert r["claims"] == report["config"]["live"] and 0 <= r["lost"] <= r["claims"], r
        assert positive(r["round_trips_per_s"]) and positive(r["window_s"]), r
        assert r["cpu_cores"] >= 0 and positive(r["heap_bytes_per_claim"]), r

    fleet = report["fleet"]
    assert [r["store"] for r in report["waiters"]] == STORES
    for r in report["waiters"]:
        # every waiter held the lock once, none timed out, none while another held it
        assert r["waiters"] == fleet["procs"] * fleet["tasks"] == r["handoffs"], r
        assert r["failed"] == 0 and r["overlapping_holds"] == 0, r
        assert positive(r["work_per_handoff"]) and positive(r["gap_median_ms"]), r

    assert [r["how"] for r in report["connections"]] == ["straight", "through PgBouncer"]
    for r in report["connections"]:
        # every process connected (at most its pool's size and the listener each)
        assert r["procs"] == fleet["conn_procs"] and 1 <= r["peak"] <= 11 * r["procs"], r
        assert 0 <= r["idle"] <= r["peak"], r
    # straight, every process holds a connection of its own
    assert report["connections"][0]["peak"] >= fleet["conn_procs"], report["connections"]

    # the tables: one row per store and figure, each with its verdict
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    for title in ("SQLite", "PostgreSQL", "Redis", "straight", "through PgBouncer"):
        rows = [line for line in lines if line.startswith(f"| {title} |")]
        # records (3), purge (but Redis), live claims, waiters; a connections row
        assert len(rows) == (1 if title[0].islower() else 3 + (title != "Redis") + 2), rows
        assert all(line.rstrip().endswith(("| MEETS |", "| reference |")) or "SHORT by" in line
                   for line in rows), rows  # fmt: skip
    assert "growth" in proc.stdout and report["how"] in proc.stdout
    # --doc replaced the scale section of the page, and only it
    text = doc.read_text()
    assert text.startswith("# the report\n") and "older figures" not in text
    assert text.count("<!-- scale.py -->") == 1 and "## Scale: how cost grows" in text
    assert all(line in text for line in lines)
