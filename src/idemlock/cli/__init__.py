"""The ``idemlock`` command line (also ``python -m idemlock``).

Commands::

    idemlock run --lock NAME [--ttl 30s] [--wait 10s] -- CMD ARGS...
    idemlock run --semaphore NAME:N [--key K] [--ttl 30s] [--wait 10s] -- CMD ARGS...
    idemlock run --leader NAME [--key K] [--value V] [--ttl 30s] [--wait W] -- CMD ARGS...
    idemlock run --once KEY  [--ttl 24h] [--lease 30s] [--wait 0] -- CMD ARGS...
    idemlock status KEY [--spec NAME] [--tenant T]
    idemlock forget KEY [--spec NAME] [--tenant T]
    idemlock keys [--spec NAME] [--tenant T] [--json]
    idemlock locks [--spec NAME] [--tenant T] [--json]
    idemlock unlock KEY --force [--token N] [--spec NAME] [--tenant T]
    idemlock permits NAME [KEY] [--json]    idemlock leader NAME [KEY] [--json]
    idemlock purge [--dry-run] [--json]    idemlock migrate
    idemlock demo [--jobs 200] [--workers 4] [--seed N]

Global options (before or after the command): ``--url`` (default ``$IDEMLOCK_URL``,
else SQLite in the user's state directory) and ``--prefix`` (default ``idemlock``).

Exit statuses
-------------
One table, ``EXIT_STATUSES`` in ``_common.py``: each sub-command's ``--help`` lists the
statuses it can return, ``idemlock --help`` and docs/cli.md the whole table.

As with flock(1), a CMD that itself exits with one of idemlock's statuses cannot be
told apart by the status alone; idemlock always says what happened on stderr.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Callable, Sequence

from .._errors import (
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
from . import _cmd_demo, _cmd_records, _cmd_run, _cmd_unlock
from ._common import (
    _SECRETS,
    EX_CONFIG,
    EX_IN_FLIGHT,
    EX_LEASE_LOST,
    EX_LOCK_NOT_ACQUIRED,
    EX_PAYLOAD_MISMATCH,
    EX_SOFTWARE,
    EX_UNAVAILABLE,
    EX_USAGE,
    EXIT_STATUSES,
    _epilog,
    _package_version,
    _say,
    _secrets_of,
    _url_help,
    parse_duration,
)

__all__ = ["EXIT_STATUSES", "main", "parse_duration"]


def build_parser(prog: str = "idemlock") -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog=prog,
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
            epilog=_epilog(name),
            formatter_class=formatter,
        )

    for module in (_cmd_run, _cmd_records, _cmd_unlock, _cmd_demo):
        module.add_commands(add)
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


def main(argv: Sequence[str] | None = None, *, prog: str = "idemlock") -> int:
    """Run the command line; returns the exit status (see the module docstring).
    ``prog`` is the name usage messages give (``manage.py idemlock`` under Django)."""
    _SECRETS[:] = _secrets_of(os.environ.get("IDEMLOCK_URL"))
    parser = build_parser(prog)
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
