"""The README's install lines, run for real: a fresh virtualenv, ``pip install`` of this
checkout with the extra the README names (PyPI or the local index), then idemlock's
waiting paths against a throwaway server. The test extra pulls in hiredis, which hid
that ``idemlock[redis]`` alone (redis-py without hiredis) failed every wait."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib

from .servers._proc import mkdtemp
from .servers.redis import RedisServer, start_unix_redis

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT_EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
    "optional-dependencies"
]
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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This checkout built once (what ``pip install <checkout>`` builds first, in an
    isolated build environment) for every install line of the module."""
    tmp = tmp_path_factory.mktemp("wheel")
    repo = tmp / "repo"
    repo.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, repo / name)
    # A copy, so the build leaves nothing in the working tree.
    shutil.copytree(
        ROOT / "src", repo / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    dist = tmp / "dist"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(repo)],
        capture_output=True, text=True, timeout=240, env=_clean_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (built,) = dist.glob("idemlock-*.whl")
    return built


def _fresh_install(tmp: Path, wheel: Path, extra: str) -> Path:
    """A venv with ``pip install '<this checkout, built>[extra]'``; its python."""
    venv = tmp / "venv"
    # No pip of its own (ensurepip takes seconds): this interpreter's pip installs into it.
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / "bin" / "python"
    target = f"{wheel}[{extra}]" if extra else str(wheel)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", target],
        capture_output=True, text=True, timeout=240, env=_clean_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return python


#: a build, a venv, an install and its runs: over the suite's 120 s at load 25 (before the
#: build was shared, and after); each step has a timeout of its own below
INSTALL_TIMEOUT = 600


@pytest.mark.timeout(INSTALL_TIMEOUT)
def test_readme_redis_install_line_waits_over_tcp_and_unix_socket(
    tmp_path: Path, wheel: Path, unix_redis: tuple[RedisServer, str]
) -> None:
    readme = (ROOT / "README.md").read_text()
    assert "pip install 'idemlock[redis]'" in readme  # the line this test stands for
    python = _fresh_install(tmp_path, wheel, "redis")
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


# ---- the site's index (docs/index.md) ---------------------------------------------------

EXTRA = re.compile(r"\[([a-z0-9-]+)\]")


def _index_install_section() -> tuple[list[str], str]:
    """docs/index.md's "Install" section: its ``pip install`` lines and its whole text."""
    index = (ROOT / "docs" / "index.md").read_text()
    assert "\n## Install\n" in index, "docs/index.md has no Install section"
    section = index.split("\n## Install\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln.split("#", 1)[0].strip() for ln in section.splitlines()]
    return [ln for ln in lines if ln.startswith("pip install")], section


def test_the_site_index_install_lines_are_the_readmes() -> None:
    # The index says what the README says: the package by its name, and the store extras
    # of the README's store table, each an extra pyproject.toml declares.
    lines, section = _index_install_section()
    assert lines[0] == "pip install idemlock", lines
    extras = set(PYPROJECT_EXTRAS)
    named = set(EXTRA.findall(section))
    assert named and named <= extras, f"not extras of pyproject.toml: {named - extras}"
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Stores", 1)[1].split("\n## ", 1)[0]
    readme_stores = set(re.findall(r"pip install 'idemlock\[([a-z]+)\]'", table))
    assert readme_stores == {"redis", "postgres", "etcd"}
    assert readme_stores <= named, f"the index omits {readme_stores - named}"
    for line in lines:
        assert re.fullmatch(r"pip install (idemlock|'idemlock\[[a-z0-9,-]+\]')", line), line


@pytest.mark.timeout(INSTALL_TIMEOUT)
def test_the_site_index_plain_install_line_gives_a_working_embedded_store(
    tmp_path: Path, wheel: Path
) -> None:
    # `pip install idemlock` with no extra: the SQLite default and asyncio work with only
    # the core requirements (a checkout's copy stands for the published package).
    lines, _ = _index_install_section()
    assert "pip install idemlock" in lines
    python = _fresh_install(tmp_path, wheel, "")
    code = (
        "import asyncio, sys, idemlock, idemlock.aio\n"
        "coord = idemlock.connect(f'sqlite:///{sys.argv[1]}')\n"
        "sent = []\n"
        "@coord.idempotent('probe', key=lambda k: k)\n"
        "def op(k: str) -> int:\n"
        "    sent.append(k)\n"
        "    return len(sent)\n"
        "assert op('a') == op('a') == 1 and sent == ['a']\n"
        "async def main() -> None:\n"
        "    async with idemlock.aio.connect('memory://') as a:\n"
        "        async with a.lock(idemlock.LockSpec('l')).hold('r') as lease:\n"
        "            assert lease.token >= 1\n"
        "asyncio.run(main())\n"
        "print('ok', idemlock.__file__)\n"
    )
    run = subprocess.run(
        [str(python), "-c", code, str(tmp_path / "probe.db")],
        capture_output=True, text=True, timeout=60, cwd=tmp_path, env=_clean_env(),
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("ok ") and str(tmp_path / "venv") in run.stdout, run.stdout
