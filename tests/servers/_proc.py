"""The one place where tests (and benchmarks) start long-lived processes and make
directories for them, so that nothing outlives the run that made it.

``popen(cmd, ...)`` is ``subprocess.Popen`` plus three guarantees:

* **the child dies with this process**, also when it is SIGKILLed or crashes: the
  child runs under ``setpriv --pdeathsig KILL`` (util-linux; a small Python launcher
  where ``setpriv`` is missing), which sets ``PR_SET_PDEATHSIG`` in the child itself
  just before it ``exec``s the command. No ``preexec_fn`` (not safe with threads, and
  these processes have proxy, gRPC and timer threads). The kernel fires the death
  signal when the *thread* that forked the child ends, so a call from any thread but
  the main one is handed to one long-lived spawner thread (it lives as long as the
  process);
* **it runs in a session of its own** (``start_new_session=True`` unless told
  otherwise): a Ctrl-C in the terminal reaches pytest, whose fixtures stop the
  servers in order, and ``os.killpg`` reaches the children the command forks itself
  (gunicorn, Celery prefork, PostgreSQL backends);
* **it is reaped at exit**: every child still running when this process exits
  (normally, on SIGTERM/SIGINT turned into an exception by ``tests/_progress.py``)
  has its process group killed, after the fixtures had their turn.

``tempdir(prefix)`` / ``mkdtemp(prefix)`` make the directories of servers under one
per-process root, ``<tmp>/idemlock-tests-<pid>/``, removed at exit; a root left by
a process that was SIGKILLed is removed by the next run (``sweep_stale_roots``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "kill_all",
    "mkdtemp",
    "popen",
    "run_root",
    "sweep_stale_roots",
    "tempdir",
    "waitpid",
]

#: setpriv (util-linux >= 2.33) sets PR_SET_PDEATHSIG and execs, in ~1 ms
SETPRIV = shutil.which("setpriv")
#: where setpriv is missing: the same in Python (~30 ms more per start)
LAUNCHER = Path(__file__).with_name("_pdeathsig.py")

ROOT_PREFIX = "idemlock-tests-"
#: in each root: the identity of the process that made it (see ``_identity``)
OWNER_FILE = "owner"

_children: list[subprocess.Popen[Any]] = []
_children_lock = threading.Lock()
#: the process that owns ``_children`` and the root (not a forked child of it)
_owner = os.getpid()


# ---- processes ---------------------------------------------------------------------


def _wrap(args: Sequence[str | os.PathLike[str]], sig: int) -> list[str]:
    argv = [os.fspath(a) for a in args]
    if SETPRIV is not None:
        return [SETPRIV, "--pdeathsig", signal.Signals(sig).name[3:], "--", *argv]
    return [sys.executable, "-I", "-S", str(LAUNCHER), str(int(sig)), str(os.getpid()), *argv]


def _spawn(argv: list[str], kwargs: dict[str, Any]) -> subprocess.Popen[Any]:
    proc: subprocess.Popen[Any] = subprocess.Popen(argv, **kwargs)
    with _children_lock:
        _children[:] = [p for p in _children if p.returncode is None]
        _children.append(proc)
    return proc


class _Spawner:
    """One thread that lives as long as the process and starts the children asked for
    from other threads (the death signal follows the thread that forked)."""

    def __init__(self) -> None:
        self.requests: queue.Queue[tuple[list[str], dict[str, Any], list[Any], threading.Event]]
        self.requests = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="idemlock-test-spawner", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            argv, kwargs, box, done = self.requests.get()
            try:
                box.append(_spawn(argv, kwargs))
            except BaseException as exc:  # handed to the caller
                box.append(exc)
            done.set()

    def spawn(self, argv: list[str], kwargs: dict[str, Any]) -> subprocess.Popen[Any]:
        box: list[Any] = []
        done = threading.Event()
        self.requests.put((argv, kwargs, box, done))
        if not done.wait(60):
            raise RuntimeError(f"the spawner thread did not start {argv[:3]} in 60 s")
        if isinstance(box[0], BaseException):
            raise box[0]
        proc: subprocess.Popen[Any] = box[0]
        return proc


_spawner: _Spawner | None = None
_spawner_lock = threading.Lock()


def popen(
    args: Sequence[str | os.PathLike[str]],
    *,
    pdeathsig: int = signal.SIGKILL,
    **kwargs: Any,
) -> subprocess.Popen[Any]:
    """``subprocess.Popen(args, **kwargs)`` for a child that must not outlive this
    process (see the module docstring). ``proc.pid`` is the command's own pid (the
    wrapper ``exec``s it). ``args`` must be a list, not a shell string."""
    global _spawner
    if isinstance(args, (str, bytes)):
        raise TypeError("popen() takes an argument list, not a shell string")
    env = kwargs.get("env")
    first = os.fspath(args[0])
    path = env.get("PATH") if env is not None else None
    if shutil.which(first, path=path) is None:
        # Popen would have said so; the wrapper would only exit 127 later.
        raise FileNotFoundError(2, "No such file or directory", first)
    kwargs.setdefault("start_new_session", True)
    argv = _wrap(args, pdeathsig)
    if threading.current_thread() is threading.main_thread():
        return _spawn(argv, kwargs)
    with _spawner_lock:
        if _spawner is None:
            _spawner = _Spawner()
    return _spawner.spawn(argv, kwargs)


def _kill(proc: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        try:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, signal.SIGKILL)
                return
        except ProcessLookupError:
            return
        os.kill(proc.pid, signal.SIGKILL)


def kill_all(timeout: float = 10.0) -> list[int]:
    """SIGKILL every child started by :func:`popen` that still runs (its whole process
    group when it leads one) and wait for them; returns their pids."""
    if os.getpid() != _owner:
        return []
    with _children_lock:
        alive = [p for p in _children if p.poll() is None]
        _children.clear()
    for proc in alive:
        _kill(proc)
    deadline = time.monotonic() + timeout
    for proc in alive:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    return [p.pid for p in alive]


def waitpid(pid: int, timeout: float = 60.0) -> tuple[int, int]:
    """``os.waitpid(pid, 0)`` for a child forked by a test, with a bound: past
    ``timeout`` the child is SIGKILLed, reaped, and the test fails saying so."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return done, status
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the child process {pid} did not exit within {timeout:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


# ---- directories ---------------------------------------------------------------------

_root: Path | None = None
_root_lock = threading.Lock()


def run_root() -> Path:
    """This process's directory for server data: ``<tmp>/idemlock-tests-<pid>``."""
    global _root
    with _root_lock:
        if _root is None or not _root.is_dir():
            root = Path(tempfile.gettempdir()) / f"{ROOT_PREFIX}{os.getpid()}"
            root.mkdir(mode=0o755, exist_ok=True)  # PostgreSQL runs as another user
            (root / OWNER_FILE).write_text(f"{_identity(os.getpid())}\n")
            _root = root
        return _root


def mkdtemp(prefix: str) -> Path:
    """A new directory under :func:`run_root`; the caller removes it (or exit does)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=run_root()))


@contextlib.contextmanager
def tempdir(prefix: str) -> Iterator[Path]:
    """:func:`mkdtemp` as a context manager that removes it on exit."""
    path = mkdtemp(prefix)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _identity(pid: int) -> str | None:
    """``<pid namespace> <pid> <start time>``: a process, even after its pid is reused;
    None once it is gone."""
    try:
        ns = os.readlink(f"/proc/{pid}/ns/pid")
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    start = stat[stat.rindex(")") + 2 :].split()[19]
    return f"{ns} {pid} {start}"


def sweep_stale_roots(tmp: str | os.PathLike[str] | None = None) -> list[Path]:
    """Remove the roots of processes that are gone (SIGKILLed before their exit
    handlers ran); returns what was removed. A root made in another pid namespace
    (another container sharing the directory) is never touched."""
    base = Path(tmp) if tmp is not None else Path(tempfile.gettempdir())
    my_ns = os.readlink("/proc/self/ns/pid")
    removed = []
    for path in base.glob(f"{ROOT_PREFIX}*"):
        try:
            owner = (path / OWNER_FILE).read_text().split()
        except OSError:
            continue
        if len(owner) != 3 or owner[0] != my_ns or not owner[1].isdigit():
            continue
        if _identity(int(owner[1])) == " ".join(owner):
            continue  # still running
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def cleanup() -> None:
    """Kill what is left and remove this process's root (at exit)."""
    if os.getpid() != _owner:
        return  # a forked child exiting: the children and the root are its parent's
    kill_all()
    global _root
    with _root_lock:
        root, _root = _root, None
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


def _forget_in_child() -> None:
    """A forked child owns none of its parent's children, root or spawner thread."""
    global _owner, _root, _spawner, _children_lock, _root_lock, _spawner_lock
    _owner = os.getpid()
    _children_lock, _root_lock, _spawner_lock = threading.Lock(), threading.Lock(), threading.Lock()
    _children.clear()
    _root = None
    _spawner = None


atexit.register(cleanup)
os.register_at_fork(after_in_child=_forget_in_child)
