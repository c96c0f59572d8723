"""The ``idemlock`` command line (also ``python -m idemlock``).

Commands::

    idemlock run --lock NAME [--ttl 30s] [--wait 10s] -- CMD ARGS...
    idemlock run --once KEY  [--ttl 24h] [--lease 30s] [--wait 0] -- CMD ARGS...
    idemlock status KEY [--spec NAME] [--tenant T]
    idemlock forget KEY [--spec NAME] [--tenant T]
    idemlock keys [--spec NAME] [--tenant T] [--json]
    idemlock locks [--spec NAME] [--tenant T] [--json]
    idemlock purge                         idemlock migrate
    idemlock demo [--jobs 200] [--workers 4] [--seed N]

Global options (before or after the command): ``--url`` (default ``$IDEMLOCK_URL``,
else SQLite in the user's state directory) and ``--prefix`` (default ``idemlock``).

Exit statuses
-------------
======  ==========================================================================
0       success; ``run``: CMD exited 0, or ``--once`` KEY already ran (skipped)
1       ``status``: KEY has no live record
2       usage error: bad arguments, a bad duration, an invalid key
65      ``run --once``: KEY was already used with a different command (EX_DATAERR)
69      the store is unavailable: unreachable, locked, corrupt (EX_UNAVAILABLE)
70      any other idemlock error (EX_SOFTWARE)
75      ``run --lock``: the lock was held elsewhere for all of ``--wait`` (EX_TEMPFAIL)
76      ``run --once``: KEY is being run elsewhere right now (its claim is live)
77      ``run``: the lock's lease (or the ``--once`` claim's lease) was lost while CMD
        ran, so another run may have started; stderr says whether CMD was still
        running and terminated (with its whole process group) or had exited
78      configuration error: bad store URL, missing driver (EX_CONFIG)
126     ``run``: CMD could not be executed (permission denied)
127     ``run``: CMD was not found
128+N   ``run``: CMD was killed by signal N
other   ``run``: CMD's own exit status
======  ==========================================================================

As with flock(1), a CMD that itself exits with one of idemlock's statuses cannot be
told apart by the status alone; idemlock always says what happened on stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from types import FrameType
from typing import Any

from ._core.clock import MAX_TTL
from ._errors import (
    CanonicalizeError,
    ConfigurationError,
    IdemlockError,
    InFlightError,
    InvalidKey,
    LockLost,
    LockNotAcquired,
    PayloadMismatch,
    StaleClaim,
    StoreUnavailable,
)

__all__ = ["EXIT_STATUSES", "main", "parse_duration"]

EX_OK = 0
EX_NO_RECORD = 1
EX_USAGE = 2
EX_PAYLOAD_MISMATCH = 65
EX_UNAVAILABLE = 69
EX_SOFTWARE = 70
EX_LOCK_NOT_ACQUIRED = 75
EX_IN_FLIGHT = 76
EX_LEASE_LOST = 77
EX_CONFIG = 78
EX_CANNOT_EXECUTE = 126
EX_NOT_FOUND = 127

#: (status, meaning): the table printed in ``--help`` and copied to the README.
EXIT_STATUSES: list[tuple[str, str]] = [
    ("0", "success; run: CMD exited 0, or --once KEY already ran (skipped)"),
    ("1", "status: KEY has no live record"),
    ("2", "usage error: bad arguments, a bad duration, an invalid key"),
    ("65", "run --once: KEY was already used with a different command"),
    ("69", "the store is unavailable (unreachable, locked, corrupt)"),
    ("70", "any other idemlock error"),
    ("75", "run --lock: the lock stayed held elsewhere for all of --wait"),
    ("76", "run --once: KEY is being run elsewhere right now"),
    ("77", "run: the lease was lost while CMD ran (stderr says if CMD was terminated)"),
    ("78", "configuration error: bad store URL, missing driver"),
    ("126", "run: CMD could not be executed"),
    ("127", "run: CMD was not found"),
    ("128+N", "run: CMD was killed by signal N"),
    ("other", "run: CMD's own exit status"),
]

ONCE_SPEC = "cli-once"
LOCK_SPEC = "cli-lock"
DEFAULT_GRACE = 10.0

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(-?)(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h|d)?\s*$", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """Seconds in ``text``: ``500ms``, ``30s``, ``5m``, ``24h``, ``1d`` or plain seconds."""
    match = _DURATION.match(text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: use a number with an optional unit "
            "(500ms, 30s, 5m, 24h, 1d; plain numbers are seconds)"
        )
    if match.group(1):
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: it must not be negative")
    value = float(match.group(2)) * _UNITS[(match.group(3) or "s").lower()]
    if value > MAX_TTL.total_seconds():  # also keeps timedelta(seconds=...) in range
        raise argparse.ArgumentTypeError(
            f"invalid duration {text!r}: the longest is 100 years (idemlock.MAX_TTL)"
        )
    return value


def _positive_duration(text: str) -> float:
    value = parse_duration(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: it must be positive")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid number {text!r}: it must be at least 1")
    return value


def _tenant(text: str) -> str:
    from ._core.keys import validate_key

    try:
        return validate_key(text, "tenant")
    except InvalidKey as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ---- output helpers ------------------------------------------------------------


#: passwords of the store URL in use: never printed, whatever message carries them
_SECRETS: list[str] = []


def _secrets_of(url: str | None) -> list[str]:
    """The secrets in ``url`` (userinfo password, ``?password=`` and the like), each as
    written and decoded, so a message that quotes either form can be scrubbed."""
    from ._urls import secrets_in

    return secrets_in(url) if url else []


#: shorter secrets are masked in URLs only: masking every "a" would garble all output
_MIN_SCRUBBED = 4


def _scrub(text: str) -> str:
    for secret in _SECRETS:
        if len(secret) >= _MIN_SCRUBBED:
            text = text.replace(secret, "***")
    return text


def _shown_url(url: str | None) -> str:
    """A store URL as printed: redacted, and scrubbed of every secret it holds."""
    from ._urls import redact

    if url is None:
        return "<none>"
    secrets_ = _secrets_of(url)
    text = redact(url)
    for secret in secrets_:
        text = text.replace(secret, "***")
    return _scrub(text)


def _say(message: str) -> None:
    print(f"idemlock: {_scrub(message)}", file=sys.stderr, flush=True)


def _out(message: str) -> None:
    print(_scrub(message), flush=True)


def _human(seconds: float) -> str:
    """A short duration for tables and messages: 850ms, 12.3s, 4m05s, 3h04m, 2d03h."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(seconds)
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _iso(when: datetime) -> str:
    return when.astimezone(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    headers_idx = range(len(headers))
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    # Numbers line up on the right, text on the left.
    right = [bool(rows) and all(isinstance(row[i], int) for row in rows) for i in headers_idx]
    lines = []
    for r in cells:
        parts = [
            c.rjust(w) if right[i] else c.ljust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _print_json(value: object) -> None:
    _out(json.dumps(value, indent=2, sort_keys=False))


# ---- the parser ----------------------------------------------------------------


def _epilog() -> str:
    width = max(len(code) for code, _ in EXIT_STATUSES)
    lines = ["exit statuses:"]
    lines += [f"  {code.ljust(width)}  {meaning}" for code, meaning in EXIT_STATUSES]
    return "\n".join(lines)


def _url_help() -> str:
    from ._urls import default_url

    return f"store URL (default: $IDEMLOCK_URL, else {_shown_url(default_url())})"


def _package_version() -> str:
    from . import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="idemlock",
        description="Idempotent operations and fenced locks for retried work.",
        epilog=_epilog(),
        formatter_class=formatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_package_version()}")
    parser.add_argument("--url", default=None, help=_url_help())
    parser.add_argument(
        "--prefix", default="idemlock", help="key prefix that namespaces everything (idemlock)"
    )
    # The same options after the command; SUPPRESS keeps a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    common.add_argument("--prefix", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def add(name: str, help: str, description: str = "") -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            help=help,
            description=description or help,
            parents=[common],
            epilog=_epilog(),
            formatter_class=formatter,
        )

    run = add(
        "run",
        "run a command under a lock or at most once per key",
        "Run CMD exclusively under a fenced lock (--lock) or at most once per KEY (--once).\n"
        "The child gets IDEMLOCK_FENCE_TOKEN (the lock's token or the claim's fence;\n"
        "it strictly increases, so pass it to writes that must refuse stale holders).\n\n"
        "--lock: the lease is renewed every ttl/3 while CMD runs; if it is lost\n"
        "  anyway (the store became unreachable, or this process was paused past the\n"
        "  ttl), CMD's process group gets SIGTERM, then SIGKILL after --grace, and\n"
        "  idemlock exits 77.\n"
        "--once: success (status 0) records KEY for --ttl; later runs skip CMD and exit\n"
        "  0. A failed CMD frees KEY so a retry runs it again. The claim is renewed\n"
        "  every lease/3 while CMD runs, however long it takes: --lease is how long\n"
        "  after a crash (idemlock killed) KEY frees itself. If the claim is lost\n"
        "  anyway (the store unreachable, this process paused past --lease), CMD's\n"
        "  process group gets SIGTERM, then SIGKILL after --grace, nothing is\n"
        "  recorded, and idemlock exits 77.\n\n"
        "CMD runs in a session (process group) of its own (on a terminal: a process\n"
        "group made the terminal's foreground, so CMD can prompt and gets Ctrl-C).\n"
        "SIGINT, SIGTERM and SIGHUP are forwarded to that whole group, and idemlock\n"
        "returns only when no process of the group runs anymore: processes CMD left\n"
        "behind get SIGTERM, then SIGKILL after --grace, so nothing of CMD runs on\n"
        "without the lock or the claim.",
    )
    mode = run.add_mutually_exclusive_group(required=True)
    mode.add_argument("--lock", metavar="NAME", help="run CMD while holding lock NAME")
    mode.add_argument("--once", metavar="KEY", help="run CMD at most once for KEY")
    run.add_argument(
        "--spec",
        default=None,
        help=f"spec name (default: {LOCK_SPEC} for --lock, {ONCE_SPEC} for --once)",
    )
    run.add_argument(
        "--ttl",
        type=_positive_duration,
        default=None,
        help="--lock: lease length (30s); --once: how long success is remembered (24h)",
    )
    run.add_argument(
        "--wait",
        type=parse_duration,
        default=None,
        help="--lock: how long to wait for the lock (10s; 0 fails at once); "
        "--once: how long to wait for a run in flight elsewhere to finish (0)",
    )
    run.add_argument(
        "--lease",
        type=_positive_duration,
        default=None,
        help="--once: how long after a crash KEY frees itself; renewed while CMD runs (30s)",
    )
    run.add_argument(
        "--grace",
        type=parse_duration,
        default=DEFAULT_GRACE,
        help="time between SIGTERM and SIGKILL of CMD's process group (10s)",
    )
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS...")
    run.set_defaults(handler=cmd_run)

    def tenant_option(p: argparse.ArgumentParser, help: str) -> None:
        p.add_argument("--tenant", default=None, type=_tenant, metavar="TENANT", help=help)

    status = add("status", "show the record of an idempotency key")
    status.add_argument("key", metavar="KEY")
    status.add_argument("--spec", default=ONCE_SPEC, help=f"spec name ({ONCE_SPEC})")
    tenant_option(status, "the tenant whose record it is (as listed by `keys`)")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(handler=cmd_status)

    forget = add("forget", "delete the record of an idempotency key (a retry runs again)")
    forget.add_argument("key", metavar="KEY")
    forget.add_argument("--spec", default=ONCE_SPEC, help=f"spec name ({ONCE_SPEC})")
    tenant_option(forget, "the tenant whose record it is (as listed by `keys`)")
    forget.set_defaults(handler=cmd_forget)

    keys = add(
        "keys",
        "list live idempotency records",
        "List live idempotency records: the root's own and every tenant's (TENANT '-'\n"
        "is the root); act on one with status/forget KEY --spec SPEC [--tenant TENANT].\n"
        "A value under the prefix that idemlock cannot read is listed as CORRUPT, with a\n"
        "warning on stderr, and the rest is listed as usual.",
    )
    keys.add_argument("--spec", default=None, help="only this spec")
    tenant_option(keys, "only this tenant's records")
    keys.add_argument("--json", action="store_true", help="print JSON")
    keys.set_defaults(handler=cmd_keys)

    locks = add(
        "locks",
        "list held locks",
        "List held locks: the root's own and every tenant's (TENANT '-' is the root).\n"
        "A value idemlock cannot read is listed as CORRUPT, with a warning on stderr.",
    )
    locks.add_argument("--spec", default=None, help="only this spec")
    tenant_option(locks, "only this tenant's locks")
    locks.add_argument("--json", action="store_true", help="print JSON")
    locks.set_defaults(handler=cmd_locks)

    purge = add("purge", "delete expired records and locks from the store")
    purge.add_argument("--json", action="store_true", help="print JSON")
    purge.set_defaults(handler=cmd_purge)

    migrate = add("migrate", "create or upgrade the store's schema (PostgreSQL)")
    migrate.set_defaults(handler=cmd_migrate)

    demo = add(
        "demo",
        "show duplicate side effects under at-least-once delivery, without and with idemlock",
        "Worker processes consume the same jobs from an at-least-once queue while a\n"
        "killer SIGKILLs busy workers at random (their jobs are redelivered). It runs\n"
        "twice, with plain retries and with idemlock claim/complete, and counts the\n"
        "side effects that ran twice, measured from the effects table. Everything goes\n"
        "to a new temporary directory (and idemlock to a SQLite file in it unless\n"
        "--url is given), so your own store is never touched.",
    )
    demo.add_argument("--jobs", type=_count, default=200, help="number of jobs (200)")
    demo.add_argument("--workers", type=_count, default=4, help="worker processes (4)")
    demo.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    demo.add_argument(
        "--kill-every",
        type=_positive_duration,
        default=0.06,
        help="mean time between kill attempts (60ms)",
    )
    demo.add_argument(
        "--plain-effects",
        action="store_true",
        help="do not key the protected run's effect by job id (shows the remaining window)",
    )
    demo.add_argument("--keep", action="store_true", help="keep the temporary directory")
    demo.add_argument("--json", action="store_true", help="print the measurements as JSON")
    demo.set_defaults(handler=cmd_demo)
    return parser


# ---- main ----------------------------------------------------------------------


def _status_for(exc: IdemlockError) -> int:
    # Most specific first: several errors also derive from ValueError/TypeError.
    table: list[tuple[type[IdemlockError], int]] = [
        (PayloadMismatch, EX_PAYLOAD_MISMATCH),
        (InFlightError, EX_IN_FLIGHT),
        (LockNotAcquired, EX_LOCK_NOT_ACQUIRED),
        (LockLost, EX_LEASE_LOST),
        (StaleClaim, EX_LEASE_LOST),
        (StoreUnavailable, EX_UNAVAILABLE),
        (InvalidKey, EX_USAGE),
        (CanonicalizeError, EX_USAGE),
        (ConfigurationError, EX_CONFIG),
    ]
    for cls, status in table:
        if isinstance(exc, cls):
            return status
    return EX_SOFTWARE


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (see the module docstring)."""
    _SECRETS[:] = _secrets_of(os.environ.get("IDEMLOCK_URL"))
    parser = build_parser()
    args = parser.parse_args(argv)
    _SECRETS[:] = sorted(
        {*_SECRETS, *_secrets_of(getattr(args, "url", None))}, key=len, reverse=True
    )
    handler: Callable[[argparse.Namespace, argparse.ArgumentParser], int] = args.handler
    try:
        return handler(args, parser)
    except IdemlockError as exc:
        _say(f"error: {exc}")
        return _status_for(exc)
    except KeyboardInterrupt:
        _say("interrupted")
        return 128 + signal.SIGINT
    except Exception:
        # A bug or a driver error idemlock did not wrap: still never print a password.
        import traceback

        _say(f"internal error (please report it):\n{traceback.format_exc()}")
        return EX_SOFTWARE


def _connect(args: argparse.Namespace) -> Any:
    import idemlock

    return idemlock.connect(args.url, key_prefix=args.prefix)


# ---- run -----------------------------------------------------------------------


def _command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        parser.error("run: give the command after '--', e.g. idemlock run --lock x -- make")
    return cmd


def _owner() -> str:
    """host:pid:random, so `idemlock locks` says who holds a lock; the random part keeps
    a recycled pid from ever passing for an earlier holder."""
    from ._core.keys import validate_key

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


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    cmd = _command(args, parser)
    if args.lock is not None:
        if args.lease is not None:
            parser.error("run: --lease applies to --once; a lock's lease length is --ttl")
        return _run_locked(args, cmd)
    return _run_once(args, cmd)


def _run_locked(args: argparse.Namespace, cmd: list[str]) -> int:
    from ._core.types import LockSpec

    name: str = args.lock
    ttl = 30.0 if args.ttl is None else args.ttl
    wait = 10.0 if args.wait is None else args.wait
    with _connect(args) as coord:
        lock = coord.lock(LockSpec(args.spec or LOCK_SPEC, ttl=timedelta(seconds=ttl)))
        child = _Child(cmd, {}, grace=args.grace)
        lost = threading.Event()

        def on_lost(lease: Any) -> None:
            lost.set()
            running = child.proc is not None and child.status is None
            what = (
                f"terminating CMD and its processes (SIGTERM, then SIGKILL after "
                f"{_human(args.grace)})"
                if running
                else "CMD is not running"
            )
            _say(f"lost the lease on lock {name!r} (token {lease.token}); {what}")
            child.terminate()

        try:
            with lock.hold(name, wait=wait, owner=_owner(), on_lost=on_lost) as lease:
                child.env = _child_env(lease.token, IDEMLOCK_LOCK_KEY=name)
                if lost.is_set():  # lost before CMD even started: do not start it
                    raise LockLost(f"lost the lease on lock {name!r} before CMD started")
                status = child.run()
        except LockNotAcquired:
            holder = lock.owner(name)
            left = lock.ttl(name)
            who = f" by {holder}" if holder else ""
            until = f" ({_human(left.total_seconds())} left on its lease)" if left else ""
            _say(
                f"lock {name!r} is held{who}{until} and was not released within "
                f"--wait {_human(wait)}; CMD was not run (exit {EX_LOCK_NOT_ACQUIRED})"
            )
            return EX_LOCK_NOT_ACQUIRED
        except LockLost as exc:
            if child.proc is not None and child.status is None:
                child.wait()  # left by an exception: still make sure the group ends
            _say(f"error: {exc}; {child.outcome()} (exit {EX_LEASE_LOST})")
            return EX_LEASE_LOST
        return status


def _describe_run(result: Any) -> str:
    if not isinstance(result, dict):
        return "already ran"
    parts = []
    if "ran_at" in result:
        parts.append(f"ran at {result['ran_at']}")
    if "host" in result:
        parts.append(f"on {result['host']}")
    if "duration_s" in result:
        parts.append(f"took {_human(float(result['duration_s']))}")
    if "exit_status" in result:
        parts.append(f"exit status {result['exit_status']}")
    return "already ran (" + ", ".join(parts) + ")" if parts else "already ran"


def _run_once(args: argparse.Namespace, cmd: list[str]) -> int:
    from ._core.types import Claimed, Completed, IdempotencySpec, InFlight

    key: str = args.once
    ttl = 86400.0 if args.ttl is None else args.ttl
    lease = 30.0 if args.lease is None else args.lease
    wait = 0.0 if args.wait is None else args.wait
    spec_name = args.spec or ONCE_SPEC
    spec = IdempotencySpec(spec_name, ttl=timedelta(seconds=ttl), lease=timedelta(seconds=lease))
    # The command is the payload: the same KEY with another command is refused.
    payload = {"argv": cmd}
    with _connect(args) as coord:
        port = coord.idempotency(spec)
        try:
            claim, sent = port._claim_at(key, payload, wait or None)
        except PayloadMismatch:
            _say(
                f"key {key!r} was already used to run a different command; use another "
                f"key for this command, or `idemlock forget {key} --spec {spec_name}` "
                f"to drop the old record (exit {EX_PAYLOAD_MISMATCH})"
            )
            return EX_PAYLOAD_MISMATCH
        if isinstance(claim, Completed):
            _say(f"{key!r} {_describe_run(claim.result)}; not running it again")
            return EX_OK
        if isinstance(claim, InFlight):
            left = claim.expires_at.timestamp() - coord.clock.time()
            _say(
                f"{key!r} is being run elsewhere right now (its claim ends at "
                f"{_iso(claim.expires_at)}, in {_human(max(0.0, left))}, unless it "
                f"finishes first); not running it (exit {EX_IN_FLIGHT})"
            )
            return EX_IN_FLIGHT
        assert isinstance(claim, Claimed)
        token = claim.token
        child = _Child(cmd, _child_env(token.fence, IDEMLOCK_ONCE_KEY=key), grace=args.grace)
        lost = threading.Event()

        def on_lost(_: Any) -> None:
            lost.set()
            running = child.proc is not None and child.status is None
            what = (
                f"terminating CMD and its processes (SIGTERM, then SIGKILL after "
                f"{_human(args.grace)})"
                if running
                else "CMD is not running"
            )
            _say(f"lost the claim on {key!r} (fence {token.fence}); {what}")
            child.terminate()

        # Heartbeats: the claim is renewed while CMD runs, on the coordinator's renewer.
        beat = port._heartbeat(token, sent, port._heartbeat_every(None), None, on_lost)
        started_wall = datetime.now(timezone.utc)
        started = time.monotonic()
        try:
            if not lost.is_set():  # lost before CMD even started: do not start it
                status = child.run()
        except BaseException:
            beat.stop()
            port._abandon_quietly(token)
            raise
        if beat.stop() and (child.terminated or child.proc is None):
            # CMD did not finish on its own: nothing to record. Free KEY if this claim
            # still holds it (a retry runs CMD again; another run may hold it already).
            port._abandon_quietly(token)
            _say(
                f"error: lost the claim on {key!r} while CMD ran ({beat.reason}); another "
                f"run may have started it, nothing was recorded; {child.outcome()} "
                f"(exit {EX_LEASE_LOST})"
            )
            return EX_LEASE_LOST
        took = time.monotonic() - started
        if status != 0:
            try:
                port.abandon(token)
            except StaleClaim:
                pass  # the lease ran out already, so the key is free for a retry anyway
            except StoreUnavailable as exc:
                # CMD's status matters more; the claim ends with its lease.
                _say(
                    f"CMD failed with status {status}, and the store failed to free {key!r} "
                    f"({exc}); a retry can run it once the claim ends at "
                    f"{_iso(token.expires_at)}"
                )
                return status
            _say(f"CMD failed with status {status}; {key!r} stays unclaimed so a retry runs it")
            return status
        result = {
            "exit_status": status,
            "ran_at": _iso(started_wall),
            "duration_s": round(took, 3),
            "host": socket.gethostname(),
            "argv": cmd,
        }
        try:
            port.complete(token, result)
        except StaleClaim:
            why = beat.reason or f"its --lease {_human(lease)} ran out"
            _say(
                f"error: CMD succeeded (in {_human(took)}) but the claim on {key!r} was lost "
                f"({why}) and another run took it over, so it may have run CMD too, and "
                f"this success was not recorded (exit {EX_LEASE_LOST})"
            )
            return EX_LEASE_LOST
        except StoreUnavailable as exc:
            # The claim is kept (never abandoned): a retry must not run CMD again at once.
            _say(
                f"error: CMD succeeded, but the store failed to record it ({exc}); {key!r} "
                f"stays reserved until its claim ends at {_iso(token.expires_at)}, after "
                f"which a retry runs CMD again (exit {EX_UNAVAILABLE})"
            )
            return EX_UNAVAILABLE
        return EX_OK


# ---- records and locks ---------------------------------------------------------


def _record_json(rec: Any, now: float) -> dict[str, Any]:
    corrupt = rec.state == "corrupt"
    return {
        "tenant": rec.tenant,
        "spec": rec.spec,
        "key": rec.key,
        "state": rec.state,
        "fence": None if corrupt else rec.fence,
        "expires_at": None if corrupt else _iso(rec.expires_at),
        "expires_in_s": None if corrupt else round(max(0.0, rec.expires_at.timestamp() - now), 3),
    }


def _record_row(rec: Any, now: float) -> list[object]:
    tenant = "-" if rec.tenant is None else rec.tenant
    if rec.state == "corrupt":
        # Nothing of it can be trusted but where it is.
        return [tenant, rec.spec, rec.key, "CORRUPT", "-", "-"]
    left = max(0.0, rec.expires_at.timestamp() - now)
    state = rec.state.replace("_", " ")
    expires = f"{_iso(rec.expires_at)} (in {_human(left)})"
    return [tenant, rec.spec, rec.key, state, rec.fence, expires]


_RECORD_HEADERS = ["TENANT", "SPEC", "KEY", "STATE", "FENCE", "EXPIRES"]


def _where(tenant: str | None) -> str:
    return "" if tenant is None else f" of tenant {tenant!r}"


def _scoped(coord: Any, args: argparse.Namespace) -> Any:
    """The coordinator, or its view of ``--tenant``: where a listed record is acted on."""
    tenant = getattr(args, "tenant", None)
    return coord if tenant is None else coord.for_tenant(tenant)


def _warn_corrupt(what: str, count: int) -> None:
    if count:
        _say(
            f"warning: {count} {what} under the prefix could not be read (data idemlock did "
            "not write, or damaged); listed as CORRUPT. Delete them in the store, or use "
            "another --prefix for idemlock"
        )


def cmd_status(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    with _connect(args) as coord:
        rec = _scoped(coord, args).idempotency(args.spec).status(args.key)
        now = coord.clock.time()
    where = f"spec {args.spec!r}{_where(args.tenant)}"
    if rec is None:
        if args.json:
            _print_json(None)
        else:
            _say(f"no live record for key {args.key!r} in {where}")
        return EX_NO_RECORD
    if args.json:
        _print_json(_record_json(rec, now))
    else:
        _out(_table(_RECORD_HEADERS, [_record_row(rec, now)]))
    if rec.state == "corrupt":
        _warn_corrupt("record", 1)
    return EX_OK


def cmd_forget(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    with _connect(args) as coord:
        gone = _scoped(coord, args).idempotency(args.spec).forget(args.key)
    where = f"spec {args.spec!r}{_where(args.tenant)}"
    if gone:
        _say(f"forgot key {args.key!r} in {where}; the next run will run it again")
    else:
        _say(f"nothing to forget: no live record for key {args.key!r} in {where}")
    return EX_OK


def cmd_keys(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    with _connect(args) as coord:
        records = _scoped(coord, args).keys()
        now = coord.clock.time()
        where = coord.url
    records = [r for r in records if args.spec is None or r.spec == args.spec]
    records.sort(key=lambda r: (r.tenant or "", r.spec, r.key))
    if args.json:
        _print_json([_record_json(r, now) for r in records])
    elif not records:
        _say(
            f"no live records under prefix {args.prefix!r}{_where(args.tenant)} in "
            f"{_shown_url(where)}"
        )
    else:
        _out(_table(_RECORD_HEADERS, [_record_row(r, now) for r in records]))
    _warn_corrupt("record(s)", sum(r.state == "corrupt" for r in records))
    return EX_OK


def cmd_locks(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    with _connect(args) as coord:
        held = _scoped(coord, args).locks()
        now = coord.clock.time()
        where = coord.url
    held = [h for h in held if args.spec is None or h.spec == args.spec]
    held.sort(key=lambda h: (h.tenant or "", h.spec, h.key))

    def left(h: Any) -> float:
        return max(0.0, float(h.expires_at.timestamp() - now))

    if args.json:
        _print_json(
            [
                {
                    "tenant": h.tenant,
                    "spec": h.spec,
                    "key": h.key,
                    "owner": None if h.corrupt else h.owner,
                    "token": None if h.corrupt else h.token,
                    "expires_at": None if h.corrupt else _iso(h.expires_at),
                    "time_left_s": None if h.corrupt else round(left(h), 3),
                    "corrupt": h.corrupt,
                }
                for h in held
            ]
        )
    elif not held:
        _say(
            f"no held locks under prefix {args.prefix!r}{_where(args.tenant)} in "
            f"{_shown_url(where)}"
        )
    else:
        rows = [
            [
                "-" if h.tenant is None else h.tenant,
                h.spec,
                h.key,
                "CORRUPT" if h.corrupt else h.owner,
                "-" if h.corrupt or h.token is None else h.token,
                "-" if h.corrupt else _human(left(h)),
            ]
            for h in held
        ]
        _out(_table(["TENANT", "SPEC", "KEY", "OWNER", "TOKEN", "TIME LEFT"], rows))
    _warn_corrupt("lock(s)", sum(bool(h.corrupt) for h in held))
    return EX_OK


def cmd_purge(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    with _connect(args) as coord:
        count = coord.purge()
        where = coord.url
    if args.json:
        _print_json({"purged": count})
    else:
        _out(f"purged {count} expired record(s) and lock(s) from {_shown_url(where)}")
    return EX_OK


def cmd_migrate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import importlib

    from ._urls import default_url

    url: str = args.url or default_url()
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("postgresql", "postgres"):
        _out(f"nothing to migrate: the {scheme or 'given'} store creates its schema on first use")
        return EX_OK
    try:
        # Lazily: the PostgreSQL driver is an optional extra.
        postgres = importlib.import_module("idemlock.stores.postgres")
    except ImportError as exc:
        raise ConfigurationError(
            f"the postgres store needs its driver: pip install 'idemlock[postgres]' ({exc})"
        ) from exc
    outcome = postgres.migrate(url)
    detail = f": {outcome}" if outcome not in (None, True) else ""
    _out(f"migrated {_shown_url(url)}{detail}")
    return EX_OK


def cmd_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ._demo import run_demo

    return run_demo(args)
