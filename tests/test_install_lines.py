"""The README's install lines, run for real: a fresh virtualenv, ``pip install`` of this
checkout with the extra the README names (PyPI or the local index), then idemlock's
waiting paths against a throwaway server. The test extra pulls in hiredis, which hid
that ``idemlock[redis]`` alone (redis-py without hiredis) failed every wait."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .servers._proc import mkdtemp
from .servers.redis import RedisServer, start_unix_redis

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "redis_wait_script.py"


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHON"))}
    env.pop("VIRTUAL_ENV", None)
    return env


@pytest.fixture(scope="module")
def unix_redis() -> Iterator[tuple[RedisServer, str]]:
    root = mkdtemp("ili-")
    server, url = start_unix_redis(root)
    try:
        yield server, url
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _fresh_install(tmp: Path, extra: str) -> Path:
    """A venv with ``pip install '<copy of this checkout>[extra]'``; its python."""
    repo = tmp / "repo"
    repo.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, repo / name)
    # A copy, so the build leaves nothing in the working tree.
    shutil.copytree(
        ROOT / "src", repo / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", f"{repo}[{extra}]"],
        capture_output=True, text=True, timeout=240, env=_clean_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return python


def test_readme_redis_install_line_waits_over_tcp_and_unix_socket(
    tmp_path: Path, unix_redis: tuple[RedisServer, str]
) -> None:
    readme = (ROOT / "README.md").read_text()
    assert "pip install 'idemlock[redis]'" in readme  # the line this test stands for
    python = _fresh_install(tmp_path, "redis")
    probe = subprocess.run(
        [str(python), "-c", "import importlib.util, redis.utils; "
         "print(importlib.util.find_spec('hiredis') is None, redis.utils.HIREDIS_AVAILABLE)"],
        capture_output=True, text=True, timeout=60, env=_clean_env(),
    )  # fmt: skip
    assert probe.stdout.split() == ["True", "False"], probe.stdout + probe.stderr
    server, unix_url = unix_redis
    for url in (server.url, unix_url):
        run = subprocess.run(
            [str(python), str(SCRIPT), url],
            capture_output=True, text=True, timeout=120, cwd=tmp_path, env=_clean_env(),
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        assert "waits ok" in run.stdout and "hiredis=False" in run.stdout, run.stdout
        assert str(tmp_path / "venv") in run.stdout  # idemlock came from the fresh venv
