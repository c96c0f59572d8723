"""CMD in a process group of its own: started, signalled, waited for with every
process it left behind, and terminated (SIGTERM, then SIGKILL) when the lease is lost."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

from .._errors import (
    InvalidKey,
)
from ._common import DEFAULT_GRACE, EX_CANNOT_EXECUTE, EX_NOT_FOUND, _human, _say


def _owner() -> str:
    """host:pid:random, so `idemlock locks` says who holds a lock; the random part keeps
    a recycled pid from ever passing for an earlier holder."""
    from .._core.keys import validate_key

    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:200] or "host"
    owner = f"{host}:{os.getpid()}:{secrets.token_hex(3)}"
    try:
        return validate_key(owner, "owner")
    except InvalidKey:  # pragma: no cover - the substitution above makes it valid
        return secrets.token_hex(8)


#: Popen options that start CMD in a process group of its own (3.10 has no
#: process_group; setpgid is async-signal-safe, so the pre-exec hook is too)
_OWN_GROUP: dict[str, Any] = (
    {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
)


def _foreground_tty() -> int | None:
    """A terminal fd whose foreground process group is ours, or None."""
    for fd in (0, 1, 2):
        try:
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return fd
        except OSError:
            continue
    return None


def _give_terminal(fd: int, pgid: int) -> None:
    """Make ``pgid`` the foreground group of terminal ``fd`` (main thread only)."""
    # A background group changing the foreground gets SIGTTOU unless it ignores it.
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(fd, pgid)
    except OSError:
        pass  # the terminal went away: nothing to hand over
    finally:
        signal.signal(signal.SIGTTOU, previous)


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies do not count: an orphan
    whose reaper is slow has finished all the same)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    if not os.path.exists("/proc/self/stat"):
        return True  # no procfs: every member counts
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces and parentheses.
        fields = stat.rsplit(b")", 1)[-1].split()
        if len(fields) > 2 and fields[2] == str(pgid).encode() and fields[0] not in b"ZX":
            return True
    return False


@dataclass
class _Child:
    """CMD in a session (so a process group) of its own, with signal forwarding and a
    terminate-then-kill of the whole group: CMD's own children never outlive it."""

    cmd: list[str]
    env: dict[str, str]
    grace: float = DEFAULT_GRACE
    proc: subprocess.Popen[bytes] | None = None
    pending: int | None = None
    #: when idemlock itself SIGTERMed the group (a lost lease, stragglers): SIGKILL at
    kill_at: float | None = None
    #: what idemlock sent on its own, for the messages ("SIGTERM", "SIGKILL")
    sent: list[str] = dataclasses.field(default_factory=list)
    #: CMD's exit status, once reaped
    status: int | None = None
    #: whether CMD was still running when idemlock first terminated it
    terminated: bool = False
    #: the terminal handed to CMD's group while it runs
    tty: int | None = None

    def start(self) -> int | None:
        """Start CMD; returns an exit status if it could not be started."""
        tty = _foreground_tty()
        try:
            if tty is None:
                # Its own session: one signal to the group reaches everything CMD
                # started, and no terminal signal reaches it twice.
                self.proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True)
            else:
                # On a terminal: its own process group in our session, made the
                # terminal's foreground group as a shell would, so CMD can still prompt
                # and Ctrl-C reaches it (and its children) once, directly.
                self.proc = subprocess.Popen(self.cmd, env=self.env, **_OWN_GROUP)
                self.tty = tty
                _give_terminal(tty, self.proc.pid)
                # It may have read the terminal before it was its own: wake it up.
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.proc.pid, signal.SIGCONT)
        except FileNotFoundError:
            _say(f"error: command not found: {self.cmd[0]}")
            return EX_NOT_FOUND
        except PermissionError as exc:
            _say(f"error: cannot execute {self.cmd[0]}: {exc.strerror}")
            return EX_CANNOT_EXECUTE
        except OSError as exc:
            _say(f"error: cannot execute {self.cmd[0]}: {exc}")
            return EX_CANNOT_EXECUTE
        if self.pending is not None:  # a signal came while CMD was starting
            pending, self.pending = self.pending, None
            self.signal(pending)
        return None

    def signal(self, signum: int) -> None:
        """Send ``signum`` to CMD's whole process group."""
        if self.proc is None:
            self.pending = signum
            return
        # The group outlives a reaped CMD while its children run; the kernel does not
        # hand the id to a new process while the group exists.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)

    def terminate(self) -> None:
        """SIGTERM the group now, SIGKILL it ``grace`` seconds later if anything of it
        still runs (the waiting thread does that; this may run on any thread)."""
        if self.kill_at is not None:
            return
        self.terminated = self.status is None and self.proc is not None
        self.kill_at = time.monotonic() + self.grace
        self.sent.append("SIGTERM")
        self.signal(signal.SIGTERM)

    def wait(self) -> int:
        """Wait for CMD and then for every process left in its group; returns CMD's
        status. Stragglers are terminated: they would run on unprotected."""
        proc = self.proc
        assert proc is not None
        killed_at: float | None = None
        while True:
            if self.status is None:
                try:
                    # Short steps only near a SIGKILL deadline; signals are handled at once.
                    code = proc.wait(timeout=0.2 if self.kill_at is None else 0.05)
                except subprocess.TimeoutExpired:
                    code = None
                if code is not None:
                    # The shell's convention for a child killed by a signal.
                    self.status = 128 - code if code < 0 else code
            if self.status is not None:
                if not _group_alive(proc.pid):
                    return self.status
                if self.kill_at is None:
                    _say(
                        "CMD exited but processes it started still run; terminating them "
                        f"(SIGTERM, then SIGKILL after {_human(self.grace)})"
                    )
                    self.terminate()
            now = time.monotonic()
            if killed_at is None and self.kill_at is not None and now >= self.kill_at:
                _say(f"CMD still running {_human(self.grace)} after SIGTERM; sending SIGKILL")
                self.sent.append("SIGKILL")
                self.signal(signal.SIGKILL)
                killed_at = now
            if killed_at is not None and self.status is not None and now - killed_at > 5:
                _say("processes of CMD survived SIGKILL (stuck in the kernel?); leaving them")
                return self.status
            if self.status is not None:
                time.sleep(0.05)

    def outcome(self) -> str:
        """What became of CMD, for the final message."""
        code = "" if self.status is None else f" (status {self.status})"
        if self.terminated:
            return f"CMD was terminated ({', then '.join(self.sent)}){code}"
        if self.status is not None:
            return f"CMD had already exited on its own{code}; idemlock did not terminate it"
        return "CMD was not started"

    def run(self) -> int:
        """Start CMD and wait for it, forwarding SIGINT/SIGTERM/SIGHUP meanwhile."""
        forwarded = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

        def forward(signum: int, frame: FrameType | None) -> None:
            self.signal(signum)

        previous = {s: signal.signal(s, forward) for s in forwarded}
        try:
            failed = self.start()
            if failed is not None:
                return failed
            return self.wait()
        finally:
            if self.tty is not None:
                _give_terminal(self.tty, os.getpgrp())  # the terminal is ours again
            for s, handler in previous.items():
                signal.signal(s, handler)


def _child_env(fence: int, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["IDEMLOCK_FENCE_TOKEN"] = str(fence)
    env.update(extra)
    return env
