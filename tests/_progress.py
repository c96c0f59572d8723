"""What each test process is doing, and the last word on a test that will not end.

Registered by ``tests/conftest.py`` in every pytest process (the controller and each
xdist worker):

* **Progress events.** With ``IDEMLOCK_TEST_PROGRESS=<dir>`` set, the process that
  runs tests appends one JSON line per test start and finish to
  ``<dir>/<worker>-<pid>.jsonl`` (``{"event": "start"|"finish", "nodeid", "worker",
  "pid", "time", "duration", "outcome"}``). ``scripts/watchdog`` reads them to say
  which tests were still running, and for how long, when a run passes its budget.
* **Stacks on demand.** ``SIGUSR1`` makes the process write the stack of every
  thread (``faulthandler.register``; works while the main thread is stuck in C) to
  ``<dir>/<worker>-<pid>.stacks`` (to stderr without the variable).
  ``scripts/watchdog`` sends it before it kills a run.
* **A hard stop after the timeout.** pytest-timeout (``timeout`` in pyproject,
  ``signal`` method: the test fails with its name and the stacks of every thread,
  and the run goes on) cannot interrupt a test whose main thread never returns to
  Python (a C call that retries on EINTR, a lock held by C code), nor a teardown
  that hangs after its timer fired. So each test also arms, for its timeout plus
  ``HARD_GRACE`` seconds, a thread that writes the test's name and the stacks of
  every thread, kills the children of the process (``tests/servers/_proc.py``) and
  exits; and behind it ``faulthandler.dump_traceback_later`` (no GIL needed) for
  ``HARD_GRACE`` more. Under xdist the controller then reports "worker crashed
  while running <test>" and starts a new worker.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import threading
import time
from collections.abc import Generator
from pathlib import Path
from typing import IO, Any

import pytest

#: seconds past a test's timeout before the hard stop (the thread), and again before
#: faulthandler's own exit
HARD_GRACE = float(os.environ.get("IDEMLOCK_TEST_HARD_GRACE", "30"))
PROGRESS_ENV = "IDEMLOCK_TEST_PROGRESS"


def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


class Progress:
    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.dir = Path(os.environ[PROGRESS_ENV]) if os.environ.get(PROGRESS_ENV) else None
        self.name = f"{_worker()}-{os.getpid()}"
        self.events: IO[str] | None = None
        self.stacks: IO[str] | None = None
        self.started: dict[str, float] = {}
        self.lock = threading.Lock()
        self.hard: threading.Timer | None = None
        # the terminal, not the capture of the test running now (fd 2 is captured)
        self.err = self._stderr_fd()
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.stacks = open(self.dir / f"{self.name}.stacks", "a")  # noqa: SIM115
        if hasattr(signal, "SIGUSR1"):
            faulthandler.register(
                signal.SIGUSR1,
                file=self.stacks if self.stacks is not None else self.err,
                all_threads=True,
            )

    def _stderr_fd(self) -> int:
        from _pytest.faulthandler import fault_handler_stderr_fd_key

        fd = self.config.stash.get(fault_handler_stderr_fd_key, None)
        return os.dup(fd if fd is not None else 2)

    # ---- events -------------------------------------------------------------------

    def runs_tests(self) -> bool:
        """Not the xdist controller (its workers run the tests and write the events)."""
        return not self.config.pluginmanager.hasplugin("dsession")

    def write(self, **event: Any) -> None:
        if self.dir is None or not self.runs_tests():
            return
        with self.lock:
            if self.events is None:
                self.events = open(self.dir / f"{self.name}.jsonl", "a", buffering=1)  # noqa: SIM115
            event.update(worker=_worker(), pid=os.getpid(), time=time.time())
            self.events.write(json.dumps(event) + "\n")

    # ---- the hard stop --------------------------------------------------------------

    def arm(self, item: pytest.Item) -> None:
        timeout = _timeout_of(item)
        if not timeout:
            return
        started = time.monotonic()
        self.hard = threading.Timer(
            timeout + HARD_GRACE, self._hard_stop, (item.nodeid, timeout, started)
        )
        self.hard.name = f"idemlock-hard-timeout {item.nodeid}"
        self.hard.daemon = True
        self.hard.start()
        faulthandler.dump_traceback_later(timeout + 2 * HARD_GRACE, exit=True, file=self.err)

    def disarm(self) -> None:
        faulthandler.cancel_dump_traceback_later()
        if self.hard is not None:
            self.hard.cancel()
            self.hard = None

    def _hard_stop(self, nodeid: str, timeout: float, started: float) -> None:
        spent = time.monotonic() - started
        text = (
            f"\n{'+' * 30} HARD TIMEOUT {'+' * 30}\n"
            f"{nodeid} still runs {spent:.0f} s after it started (its timeout: {timeout:.0f} s)"
            f" in {self.name}: pytest-timeout could not end it (stuck in C code, in a wait that"
            " does not see signals, or in a teardown). Stacks of every thread, then exit:\n"
        )
        for fd in {self.err, *([self.stacks.fileno()] if self.stacks else [])}:
            with contextlib.suppress(OSError):
                os.write(fd, text.encode())
                faulthandler.dump_traceback(file=fd, all_threads=True)
        with contextlib.suppress(Exception):
            self.write(event="hung", nodeid=nodeid, duration=spent)
        with contextlib.suppress(Exception):
            from .servers import _proc

            _proc.cleanup()
        os._exit(70)


def _timeout_of(item: pytest.Item) -> float:
    try:
        import pytest_timeout
    except ImportError:
        return 0.0
    try:
        settings = pytest_timeout._get_item_settings(item)
    except Exception:
        return 0.0
    return float(settings.timeout or 0.0)


_KEY = pytest.StashKey[Progress]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_KEY] = Progress(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    progress = config.stash.get(_KEY, None)
    if progress is None:
        return
    progress.disarm()
    if hasattr(signal, "SIGUSR1"):
        faulthandler.unregister(signal.SIGUSR1)
    for f in (progress.events, progress.stacks):
        if f is not None:
            f.close()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    progress = item.config.stash[_KEY]
    progress.started[item.nodeid] = time.monotonic()
    progress.write(event="start", nodeid=item.nodeid)
    progress.arm(item)
    try:
        yield
    finally:
        progress.disarm()
        t0 = progress.started.pop(item.nodeid, time.monotonic())
        outcome = getattr(item, "_idemlock_outcome", "unknown")
        progress.write(
            event="finish", nodeid=item.nodeid, duration=time.monotonic() - t0, outcome=outcome
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator:
    outcome = yield
    report = outcome.get_result()
    if report.failed or (report.when == "call" and report.outcome != "passed"):
        item._idemlock_outcome = report.outcome  # type: ignore[attr-defined]
    elif not hasattr(item, "_idemlock_outcome") and report.when == "call":
        item._idemlock_outcome = "passed"  # type: ignore[attr-defined]
