"""The one-command benchmark report runs end to end in its smallest form.

Runs ``benchmarks/report.py --smoke`` (the fewest operations that still run every
scenario; its own throwaway Redis, Redis Cluster and PostgreSQL servers) into a
temporary directory and checks what it wrote: every scenario for every store, positive
ratios, the Markdown tables and a PNG chart. Numbers are reported, never asserted.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STORES = ["memory", "sqlite", "redis", "redis-cluster", "postgres"]
SCENARIOS = [
    ("uncontended", "acquire+release"),
    ("uncontended", "claim+complete"),
    ("asyncio, 1 task", "acquire+release"),
    ("asyncio, 1 task", "claim+complete"),
    ("asyncio, 100 tasks", "acquire+release"),
    ("asyncio, 100 tasks", "claim+complete"),
    ("contended hand-off", "4 contenders, hold ~1 ms"),
    ("idempotent job", "claim + fenced write + complete"),
]
PEERS = ["redis-py Lock", "python-redis-lock", "fencekit", "idemkit", "Powertools"]
#: the report's run: --quick took 52 s at load 4-8 and 626 s at load 30; --smoke ran past
#: the former 240 s at load 27
REPORT_TIMEOUT = 600


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("report")
    paths = {"md": out / "bench.md", "json": out / "bench.json", "png": out / "bench.png"}
    args = ["--out", str(paths["md"]), "--json", str(paths["json"]), "--png", str(paths["png"])]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report.py"), "--smoke", *args],
        cwd=out,
        capture_output=True,
        text=True,
        timeout=REPORT_TIMEOUT,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-4000:]}\nstderr:\n{proc.stderr[-4000:]}"
    return paths


@pytest.mark.timeout(REPORT_TIMEOUT + 60)
def test_json_has_every_scenario_for_every_store(report: dict[str, Path]) -> None:
    data = json.loads(report["json"].read_text())
    assert data["stores"] == STORES
    assert [(s["scenario"], s["operation"]) for s in data["scenarios"]] == SCENARIOS
    rows = data["results"]
    for store in STORES:
        for scenario, op in SCENARIOS:
            subjects = {
                r["subject"]
                for r in rows
                if (r["store"], r["scenario"], r["operation"]) == (store, scenario, op)
            }
            assert {"baseline", "idemlock"} <= subjects, (store, scenario, op, subjects)
    for r in rows:
        assert isinstance(r["ratio"], (int, float)), r
        assert math.isfinite(r["ratio"]) and r["ratio"] > 0, r
        assert isinstance(r["value"], (int, float)) and r["value"] > 0, r
        if r["subject"] == "baseline":
            assert r["ratio"] == pytest.approx(1.0), r
    # The job's round trips are counted wherever there are any, and the baseline does
    # the same number as idemlock's job.
    for store in ("sqlite", "redis", "redis-cluster", "postgres"):
        job = {
            r["subject"]: r
            for r in rows
            if r["store"] == store and r["scenario"] == "idempotent job"
        }
        assert job["baseline"]["round_trips"] == pytest.approx(3.0), job["baseline"]
        assert job["idemlock"]["round_trips"] > 0, job["idemlock"]
    # Every peer has a status: it ran, or it says why not.
    assert set(data["peers"]) == set(PEERS)
    for name, peer in data["peers"].items():
        assert peer["status"] in ("ran", "not installed", "could not run"), (name, peer)
    for miss in data["not_run"]:
        assert miss["why"], miss
    meta = data["meta"]
    assert meta["cpu_count"] >= 1 and len(meta["load_average_start"]) == 3
    # The store port alone, next to the API, on every store; the single waiter on every
    # store with processes; Redis memory per key.
    for store in STORES:
        subjects = {
            r["subject"] for r in rows if (r["store"], r["scenario"]) == (store, "uncontended")
        }
        assert "idemlock (store port)" in subjects, (store, subjects)
    assert set(data["single_waiter"]) == set(STORES) - {"memory"}
    for m in data["single_waiter"].values():
        assert m["count"] > 0, m
    memory = dict(data["redis_memory"])
    assert memory["idemlock held lock"].endswith("B)"), memory
    assert "idemlock after abandon" in memory, memory
    if data["peers"]["python-redis-lock"]["status"] == "ran":
        assert "python-redis-lock held" in memory, memory
    if data["peers"]["fencekit"]["status"] == "ran":
        assert "fencekit guard done, 100-byte result" in memory, memory


@pytest.mark.timeout(REPORT_TIMEOUT + 60)
def test_json_has_the_figures_of_the_per_store_scripts(report: dict[str, Path]) -> None:
    # What bench_embedded, bench_postgres and bench_redis printed that the report first
    # lost: the store port on asyncio, the SQL stores' own statements through the raw driver,
    # CPU time per operation, the other locks' single waiter.
    data = json.loads(report["json"].read_text())
    rows = data["results"]
    for store in STORES:
        for scenario in ("asyncio, 1 task", "asyncio, 100 tasks"):
            subjects = {
                r["subject"] for r in rows if (r["store"], r["scenario"]) == (store, scenario)
            }
            assert "idemlock (store port)" in subjects, (store, scenario, subjects)
    own_sql = [r for r in rows if r["subject"] == "idemlock (its SQL, raw driver)"]
    assert {(r["store"], r["scenario"], r["operation"]) for r in own_sql} == {
        (store, "uncontended", op)
        for store in ("sqlite", "postgres")
        for op in ("acquire+release", "claim+complete")
    }
    assert all(r["round_trips"] == pytest.approx(2.0) for r in own_sql), own_sql
    for r in rows:
        if r["scenario"] != "contended hand-off":
            assert isinstance(r["cpu_us"], (int, float)) and r["cpu_us"] >= 0, r
    peers = data["single_waiter_peers"]
    assert set(peers) == set(data["single_waiter"])
    for store, kinds in peers.items():
        ran = {
            r["subject"]
            for r in rows
            if (r["store"], r["scenario"]) == (store, "contended hand-off")
        }
        assert set(kinds) == ran - {"idemlock"}, (store, kinds, ran)
        assert all(m["count"] > 0 for m in kinds.values()), kinds
    # The contention figures bench_postgres printed: gap p90 and p99, overlapping holds (a
    # count: idemlock's locks never overlap), the asyncio API contending from processes.
    hand = [r for r in rows if r["scenario"] == "contended hand-off"]
    for r in hand:
        assert {"gap_p90_ms", "gap_p99_ms", "handoff_gap_median_ms"} <= set(r), r
        if r["role"] == "idemlock":
            assert r["overlapping_holds"] == 0, r
    aio = {r["store"] for r in hand if r["subject"] == "idemlock (asyncio)"}
    assert aio == set(STORES) - {"memory"}, aio


@pytest.mark.timeout(REPORT_TIMEOUT + 60)
def test_markdown_has_the_tables_and_the_chart(report: dict[str, Path]) -> None:
    md = report["md"].read_text()
    for heading in (
        "## Machine",
        "## Peers",
        "## Baselines",
        "## Uncontended: sync, one thread",
        "## asyncio: 1 task and 100 concurrent tasks",
        "## Contended hand-off",
        "## Idempotent job, end to end",
        "## Single waiter",
        "## Redis memory per key",
        "## Reproduce",
    ):
        assert heading in md, heading
    stores = "| memory | SQLite | Redis | Redis Cluster | PostgreSQL |"
    assert f"| scenario | operation | subject {stores}" in md
    hand = "| gap median / p90 / p99 | hand-off gap median | worst wait | overlapping holds |"
    assert "| store | subject | critical sections/s |" in md and hand in md
    assert "| PostgreSQL | idemlock (asyncio) |" in md.split("## Contended hand-off")[1]
    assert "| store | subject | the job | fenced | round trips | jobs/s |" in md
    assert "| store | subject | gap median | acquisitions |" in md
    assert "| Redis | baseline |" in md.split("## Single waiter")[1]
    assert "µs CPU)" in md and "idemlock (its SQL, raw driver)" in md
    assert "load average at start" in md and "load average at end" in md
    assert "![ratios to the baseline per scenario and store](bench.png)" in md
    png = report["png"].read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(png) > 10_000


@pytest.mark.timeout(120)
def test_a_subset_of_the_stores_runs_alone(tmp_path: Path) -> None:
    # --stores replaces the per-store scripts: only that store's servers and rows.
    paths = [tmp_path / "b.md", tmp_path / "b.json", tmp_path / "b.png"]
    args = ["--quick", "--stores", "memory"]  # --quick's configuration, on one store
    args += ["--out", str(paths[0]), "--json", str(paths[1]), "--png", str(paths[2])]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "report.py"), *args],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(paths[1].read_text())
    assert data["stores"] == ["memory"] and data["meta"]["command"].endswith("--stores memory")
    assert {r["store"] for r in data["results"]} == {"memory"}
    assert "| memory |" in paths[0].read_text() and "| Redis Cluster |" not in paths[0].read_text()
