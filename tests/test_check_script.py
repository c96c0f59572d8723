"""scripts/check: every static check in one command, failing on any problem.

The checks themselves (ruff, mypy --strict, the generated files) run in
scripts/check, first in .ci/run and as a pre-commit hook, not inside pytest; here
is what makes that trustworthy: it runs every step, and a problem fails it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "scripts" / "check"


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(CHECK), *args], capture_output=True, text=True, timeout=120
    )


def test_every_static_check_is_a_step() -> None:
    steps = _check("--list").stdout
    for command in (
        "ruff check", "ruff format --check", "mypy --strict", "tools/async_to_sync.py --check",
        "tools/gen_states.py --check", "tools/gen_etcd_stubs.py --check",
    ):  # fmt: skip
        assert command in steps, steps
    for path in ("src", "tests", "benchmarks"):
        assert f" {path} " in steps.splitlines()[0], steps


def test_a_problem_fails_the_check_and_is_shown(tmp_path: Path) -> None:
    for rel in ("pyproject.toml", "scripts/check", "scripts/watchdog"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    for rel in ("src", "tests", "benchmarks", "tools"):
        (tmp_path / rel).mkdir()
    (tmp_path / "src" / "fine.py").write_text("X = 1\n")
    lint = ("--only", "ruff", "--only", "format", "--root", str(tmp_path))
    done = _check(*lint)
    assert done.returncode == 0, done.stdout  # the failure below is the file's
    (tmp_path / "src" / "bad.py").write_text("import os\nx=1\n")
    done = _check(*lint)
    assert done.returncode == 1, done.stdout
    assert "ruff: FAILED" in done.stdout and "F401" in done.stdout, done.stdout
    assert "format: FAILED" in done.stdout and "bad.py" in done.stdout, done.stdout


def test_the_etcd_stub_check_sees_a_proto_that_drifted(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import gen_etcd_stubs
    finally:
        sys.path.remove(str(ROOT / "tools"))
    pb = ROOT / "src" / "idemlock" / "stores" / "etcd" / "_pb"
    out = tmp_path / "src" / "idemlock" / "stores" / "etcd" / "_pb"
    shutil.copytree(pb, out, ignore=shutil.ignore_patterns("__pycache__"))
    assert gen_etcd_stubs.check(out) == []
    kv = out / "proto" / "mvccpb" / "kv.proto"
    kv.write_text(kv.read_text().replace("int64 lease = 6;", "int64 lease = 7;"))
    (out / "mvccpb" / "extra.py").write_text("HAND_WRITTEN = True\n")
    problems = gen_etcd_stubs.check(out)
    assert any("mvccpb.KeyValue" in p and "('lease', 7)" in p for p in problems), problems
    assert any("extra.py: no generated-file header" in p for p in problems), problems


def test_the_check_is_a_pre_commit_hook() -> None:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    hooks = [h for repo in config["repos"] if repo["repo"] == "local" for h in repo["hooks"]]
    assert [h["entry"] for h in hooks] == ["scripts/check"]
    assert hooks[0]["pass_filenames"] is False and hooks[0]["always_run"] is True
