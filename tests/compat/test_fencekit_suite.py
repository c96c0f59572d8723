"""fencekit's own test suites (its 0.1.0 and newest 0.6.x sdists from PyPI) run against
idemlock.compat.fencekit on a throwaway Redis.

The sdists are fetched by pip into a cache directory (never into the repository) and
run in a pytest subprocess with the ``fencekit_shim`` plugin, which maps ``fencekit``
onto the façade, leaves out the tests of fencekit's internals and marks documented
differences as strict xfails. Any failure, error, skip or unexpected pass fails here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.servers.redis import RedisServer

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("IDEMLOCK_TEST_CACHE", Path.home() / ".cache" / "idemlock-tests"))
VERSIONS = {"0.1.0": "fencekit==0.1.0", "0.6.x": "fencekit>=0.6,<0.7"}


def _sdist(requirement: str) -> Path:
    """Download (once) and unpack the sdist matching ``requirement``; its root dir."""
    where = CACHE / "fencekit" / re.sub(r"[^A-Za-z0-9.]+", "_", requirement)
    where.mkdir(parents=True, exist_ok=True)
    archives = sorted(where.glob("fencekit-*.tar.gz"))
    if not archives:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "--dest",
                str(where),
                requirement,
            ],
            check=True,
            timeout=300,
        )
        archives = sorted(where.glob("fencekit-*.tar.gz"))
    assert len(archives) == 1, f"expected one sdist in {where}, found {archives}"
    root = where / archives[0].name.removesuffix(".tar.gz")
    if not (root / "tests").is_dir():
        with tarfile.open(archives[0]) as tar:
            tar.extractall(where, filter="data")
    assert (root / "tests").is_dir(), f"{archives[0]} has no tests/ directory"
    return root


def _counts(output: str) -> dict[str, int]:
    last = output.strip().splitlines()[-1]
    return {word: int(n) for n, word in re.findall(r"(\d+) (\w+)", last)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("version", list(VERSIONS))
def test_fencekit_suite(version: str, redis_server: RedisServer) -> None:
    root = _sdist(VERSIONS[version])
    env = dict(os.environ)
    env["FENCEKIT_REDIS_URL"] = redis_server.url
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    # Only the plugins fencekit's suite uses (hypothesis, and pytest-timeout for its
    # ``timeout`` setting): importing every installed one (asyncio, anyio, trio,
    # benchmark, idemlock's own) cost each run seconds of CPU on a shared machine.
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "hypothesispytest",
            "-p",
            "timeout",
            "-p",
            "fencekit_shim",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rfEsxX",
            "-o",
            "addopts=",
            "tests",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    output = proc.stdout + proc.stderr
    counts = _counts(proc.stdout)
    print(f"fencekit {root.name}: {counts}")
    bad = {
        k: v for k, v in counts.items() if k in ("failed", "error", "errors", "skipped", "xpassed")
    }
    assert proc.returncode == 0 and not bad, output
    assert counts.get("passed", 0) > 0, output
