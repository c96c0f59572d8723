"""A test that hangs fails the run with its name and the stacks of every thread.

Each test here runs a throwaway test file (written to ``tmp_path``) in a pytest of
its own with ``tests/_progress.py`` loaded (``-p tests._progress``, as
tests/conftest.py does for the suite): the hang is on purpose, so what it prints is
what a real hang would print.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .servers._proc import popen

ROOT = Path(__file__).resolve().parent.parent

#: The hung tests' timeout is short: they hang for good, whatever it is.
HANGS = """
import asyncio, signal, threading, time
import pytest


def _helper(stop):
    while not stop.wait(0.05):
        pass


@pytest.mark.timeout(1)
def test_sleeps_with_a_helper_thread():
    stop = threading.Event()
    threading.Thread(target=_helper, args=(stop,), name="helper-thread", daemon=True).start()
    time.sleep(1000)


@pytest.mark.timeout(1)
async def test_awaits_forever():
    await asyncio.Event().wait()


@pytest.mark.timeout(1)
def test_waits_for_a_child_forever():
    import subprocess
    child = subprocess.Popen(["sleep", "1000"])
    try:
        child.wait()
    finally:
        child.kill()
        child.wait(10)


@pytest.mark.timeout(1)
def test_stuck_where_no_signal_reaches():
    # What a C call that never returns to Python looks like to pytest-timeout.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(1000)


@pytest.mark.timeout(0)
def test_runs_past_the_budget():
    time.sleep(1000)


def test_passes():
    time.sleep(0.5)
"""


def _pytest(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> tuple[int, str]:
    (tmp_path / "test_hangs.py").write_text(HANGS)
    command = [
        sys.executable, "-m", "pytest", "-p", "tests._progress", "-p", "no:cacheprovider",
        "--rootdir", str(tmp_path), "-o", "asyncio_mode=auto", *args,
    ]  # fmt: skip
    return _run(command, tmp_path, env, timeout)


def _run(
    command: list[str], cwd: Path, env: dict[str, str] | None, timeout: float
) -> tuple[int, str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    full_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *sys.path])
    full_env.update(env or {})
    proc = popen(command, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.communicate(timeout=30)
    return proc.returncode, out.decode(errors="replace")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", ["-n2", "-n0"])
def test_a_test_past_its_timeout_fails_with_its_name_and_every_threads_stack(
    tmp_path: Path, workers: str
) -> None:
    code, out = _pytest(tmp_path, workers, "-k", "helper or forever or passes", "-rf")
    assert code == 1, out
    for name in ("sleeps_with_a_helper_thread", "awaits_forever", "waits_for_a_child_forever"):
        assert f"FAILED test_hangs.py::test_{name} - Failed: Timeout" in out, out
    # the stuck test's own frame, and the other threads'
    assert "in test_sleeps_with_a_helper_thread" in out or "time.sleep(1000)" in out, out
    assert "Stack of helper-thread" in out, out
    assert "1 passed" in out, out  # the run went on


@pytest.mark.timeout(300)
@pytest.mark.parametrize("workers", ["-n2", "-n0"])
def test_a_test_no_signal_reaches_is_stopped_with_its_name_and_stacks(
    tmp_path: Path, workers: str
) -> None:
    code, out = _pytest(tmp_path, workers, "-k", "no_signal", env={"IDEMLOCK_TEST_HARD_GRACE": "2"})
    assert code != 0, out
    assert "HARD TIMEOUT" in out, out
    assert "test_hangs.py::test_stuck_where_no_signal_reaches still runs" in out, out
    assert 'test_hangs.py", line' in out and "in test_stuck_where_no_signal_reaches" in out, out
    if workers == "-n2":
        assert "crashed while running 'test_hangs.py::test_stuck_where_no_signal_reaches'" in out


@pytest.mark.timeout(300)
def test_the_watchdog_names_the_running_tests_shows_their_stacks_and_stops_the_run(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_hangs.py").write_text(HANGS)
    command = [
        sys.executable, str(ROOT / "scripts" / "watchdog"), "--budget", "20", "--grace", "20",
        "--", sys.executable, "-m", "pytest", "-p", "tests._progress", "-p", "no:cacheprovider",
        "--rootdir", str(tmp_path), "-n2", "-k", "budget or passes",
    ]  # fmt: skip
    code, out = _run(command, tmp_path, None, 200)
    assert code == 124, out
    running = out.split("---- tests still running (1) ----", 1)[1].split("----", 1)[0]
    assert "test_hangs.py::test_runs_past_the_budget" in running, out
    slowest = out.split("---- slowest finished tests", 1)[1].split("---- stacks", 1)[0]
    assert "test_hangs.py::test_passes  (passed)" in slowest, out
    assert "in test_runs_past_the_budget" in out.split("---- stacks of", 1)[1], out
    assert "watchdog: SIGTERM to the run" in out, out
