"""A stopped test run leaves no server and no server directory behind.

Each test runs a slice of the contract suite (one that starts Redis, PostgreSQL and
etcd servers) in a pytest of its own, with a marker in its environment and its own
``TMPDIR``; once a server of each kind is up it stops that run the way CI and
people do: SIGTERM (a cancelled job, ``timeout``), SIGINT (Ctrl-C), SIGKILL (the
OOM killer, a crashed worker). Then no process carrying the marker may be left, and
no directory but pytest's own ``pytest-of-*`` (kept by design, the last three runs).
After a SIGKILL nothing could clean up: the servers die by their death signal
(``tests/servers/_proc.py``) and the next run removes the directories.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from .servers import _proc

ROOT = Path(__file__).resolve().parent.parent
MARK = "IDEMLOCK_LEFTOVER_MARK"
#: a slice whose tests need every kind of server (and run long enough to be stopped):
#: one server of each kind, not their clusters, which take longer to start
SLICE = [
    "tests/contract/test_fences.py",
    "-k",
    "(postgres or redis or etcd) and not cluster and not pgbouncer",
]
SERVERS = {"redis-server", "postgres", "etcd"}


def _processes() -> dict[int, tuple[int, str, str, bytes]]:
    """pid -> (parent pid, start time, command name, environment) of every live process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] == "Z":
            continue  # dead; its parent has yet to reap it
        table[int(entry)] = (int(fields[1]), fields[19], comm, environ)
    return table


class Family:
    """The processes of one run: every descendant of its pytest ever seen (by pid and
    start time: after a SIGKILL the orphans are re-parented, and servers rewrite
    their environment for their process titles), and any process whose environment
    carries the run's marker."""

    def __init__(self, root: int, mark: str) -> None:
        self.root = root
        self.needle = f"{MARK}={mark}".encode()
        self.seen: dict[tuple[int, str], str] = {}

    def look(self) -> dict[int, str]:
        """Record the run's processes now; pid -> command name of those alive."""
        table = _processes()
        children: dict[int, list[int]] = {}
        for pid, (ppid, *_) in table.items():
            children.setdefault(ppid, []).append(pid)
        todo = [self.root]
        while todo:
            pid = todo.pop()
            if pid in table:
                self.seen[(pid, table[pid][1])] = table[pid][2]
            todo += children.get(pid, [])
        alive = {}
        for pid, (_, start, comm, environ) in table.items():
            if (pid, start) in self.seen or (
                pid != os.getpid() and self.needle in environ.split(b"\0")
            ):
                alive[pid] = comm
        return alive


def _wait_for(what: str, pred: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not pred():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} (waited {timeout} s)")
        time.sleep(0.1)


@pytest.fixture
def tmpdir_short() -> Iterator[Path]:
    """A TMPDIR for the run under test: short (unix socket paths have 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="il-"))
    path.chmod(0o755)  # PostgreSQL's data directory is in there, and it runs as "postgres"
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _run(tmp: Path, mark: str, *options: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "IDEMLOCK_"))}
    env.update({MARK: mark, "TMPDIR": str(tmp), "PYTHONPATH": os.pathsep.join(sys.path)})
    return _proc.popen(  # in a session of its own: our Ctrl-C is not its Ctrl-C
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options, *SLICE],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _leftover_dirs(tmp: Path) -> list[str]:
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("pytest-of-"))


def _stop_and_check(tmp: Path, sig: signal.Signals, *options: str) -> tuple[int, str]:
    mark = uuid.uuid4().hex
    proc = _run(tmp, mark, *options)
    family = Family(proc.pid, mark)
    try:
        _wait_for(
            f"the slice never had a server of each kind up: {family.seen}",
            lambda: set(family.look().values()) >= SERVERS or proc.poll() is not None,
            180,
        )
        if proc.poll() is not None:
            out = proc.communicate()[0].decode(errors="replace")
            raise AssertionError(f"the slice ended before it could be stopped:\n{out[-3000:]}")
        family.look()
        os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    text = out.decode(errors="replace")
    _wait_for(
        f"processes of the stopped run are still running: {family.look()}\n{text[-3000:]}",
        lambda: not family.look(),
        30,
    )
    return proc.returncode, text


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("workers", ["-n2", "-n0"])
def test_a_stopped_run_leaves_no_process_and_no_directory(
    tmpdir_short: Path, sig: signal.Signals, workers: str
) -> None:
    code, out = _stop_and_check(tmpdir_short, sig, workers)
    assert code != 0, out[-3000:]
    assert not _leftover_dirs(tmpdir_short), (_leftover_dirs(tmpdir_short), out[-3000:])


@pytest.mark.timeout(400)
def test_a_killed_run_leaves_no_process_and_the_next_run_removes_its_directories(
    tmpdir_short: Path,
) -> None:
    code, out = _stop_and_check(tmpdir_short, signal.SIGKILL, "-p", "no:xdist")
    assert code == -signal.SIGKILL, out[-3000:]
    left = _leftover_dirs(tmpdir_short)
    assert any(name.startswith(_proc.ROOT_PREFIX) for name in left), left
    _proc.sweep_stale_roots(tmpdir_short)  # what the next run does at its start
    assert not _leftover_dirs(tmpdir_short)


_LOST_SIGNAL = """
import os, signal

class Bomb:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGTERM)  # its KeyboardInterrupt is "ignored"

def test_signalled_in_a_finalizer():
    Bomb()

def test_never_runs():
    raise AssertionError("the run went on after SIGTERM")
"""


def test_a_signal_whose_interrupt_a_finalizer_swallowed_still_stops_the_run(
    tmp_path: Path,
) -> None:
    (tmp_path / "test_lost_signal.py").write_text(_LOST_SIGNAL)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "IDEMLOCK_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *sys.path])
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.conftest",
            "-p",
            "no:xdist",
            "--rootdir",
            str(tmp_path),
            str(tmp_path / "test_lost_signal.py"),
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        timeout=120,
    )
    out = (done.stdout + done.stderr).decode(errors="replace")
    assert "Exception ignored" in out, out  # the interrupt was swallowed once...
    assert done.returncode == pytest.ExitCode.INTERRUPTED, out  # ...and raised again
    assert "the run went on" not in out, out


def test_a_process_a_test_forked_dies_of_sigterm_even_while_stuck_in_c() -> None:
    """Pool.terminate() and the hard stop end a test's forked children by SIGTERM; a
    Python handler inherited from the run's own could never run while the child waits
    in C. (Here the wait is faulthandler's: a child that cancels a watchdog armed
    before the fork waits for a thread it does not have.)"""
    faulthandler.dump_traceback_later(600)
    read, write = os.pipe()
    try:
        pid = os.fork()
        if pid == 0:
            os.write(write, b"x")
            faulthandler.cancel_dump_traceback_later()  # never returns
            os._exit(0)
    finally:
        faulthandler.cancel_dump_traceback_later()
        os.close(write)
    try:
        assert os.read(read, 1) == b"x"
        _wait_for(
            "the child never blocked in C",
            lambda: Path(f"/proc/{pid}/wchan").read_text().startswith("futex"),
            30,
        )
        os.kill(pid, signal.SIGTERM)
        _, status = _proc.waitpid(pid, 30)
    finally:
        os.close(read)
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
