"""What every command shares: exit statuses, spec names, argument types, output
(scrubbed of the store URL's secrets) and the connection."""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

from .._core.clock import MAX_TTL
from .._errors import (
    InvalidKey,
)

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

#: Every command; ``ALL`` in a row of EXIT_STATUSES stands for each of them.
COMMANDS = (
    "run",
    "status",
    "forget",
    "keys",
    "permits",
    "leader",
    "locks",
    "unlock",
    "purge",
    "migrate",
    "demo",
)
ALL = "*"

#: The one table of exit statuses: (status, {command: meaning}). A row applies to the
#: commands it names (``ALL``: every command; a command's own entry wins over it, and
#: an entry of None says the row does not apply to that command). Each sub-command's
#: ``--help`` lists the rows that apply to it; ``idemlock --help`` and docs/cli.md
#: (checked by tests/test_cli.py) show the whole table.
EXIT_STATUSES: list[tuple[str, dict[str, str | None]]] = [
    (
        "0",
        {
            ALL: "success",
            "run": "CMD exited 0, or --once KEY already ran (skipped)",
            "unlock": "the lock was broken",
        },
    ),
    (
        "1",
        {
            "status": "KEY has no live record",
            "unlock": "the lock was not held (or not with --token N)",
        },
    ),
    ("2", {ALL: "usage error: bad arguments, a bad duration, an invalid key"}),
    ("65", {"run": "--once: KEY was already used with a different command"}),
    ("69", {ALL: "the store is unavailable (unreachable, locked, corrupt)"}),
    ("70", {ALL: "any other idemlock error"}),
    (
        "75",
        {
            "run": "--lock, --semaphore, --leader: the lock, every permit or the leadership "
            "stayed held elsewhere for all of --wait"
        },
    ),
    ("76", {"run": "--once: KEY is being run elsewhere right now"}),
    ("77", {"run": "the lease was lost while CMD ran (stderr says if CMD was terminated)"}),
    ("78", {ALL: "configuration error: bad store URL, missing driver"}),
    ("126", {"run": "CMD could not be executed"}),
    ("127", {"run": "CMD was not found"}),
    ("128+N", {"run": "CMD was killed by signal N"}),
    ("130", {ALL: "interrupted (SIGINT, Ctrl-C)", "run": None}),
    ("other", {"run": "CMD's own exit status"}),
]


def exit_statuses(command: str) -> list[tuple[str, str]]:
    """(status, meaning) of every exit status ``command`` can return."""
    if command not in COMMANDS:
        raise ValueError(f"unknown command {command!r}")
    out = []
    for code, meanings in EXIT_STATUSES:
        meaning = meanings.get(command, meanings.get(ALL))
        if meaning is not None:
            out.append((code, meaning))
    return out


def _whole_table() -> list[tuple[str, str]]:
    """The whole table as rows of (status, meaning): a meaning for some commands only
    names them (``run: CMD was not found``)."""
    rows = []
    for code, meanings in EXIT_STATUSES:
        parts = []
        if meanings.get(ALL) is not None:
            but = [c for c in COMMANDS if c in meanings and meanings[c] is None]
            parts.append(str(meanings[ALL]) + (f" (all but {', '.join(but)})" if but else ""))
        for command in COMMANDS:
            meaning = meanings.get(command)
            if meaning is not None:
                parts.append(f"{command}: {meaning}")
        rows.append((code, "; ".join(parts)))
    return rows


def exit_status_markdown() -> str:
    """The whole table in Markdown, as docs/cli.md shows it."""
    lines = ["| Status | Meaning |", "| --- | --- |"]
    lines += [f"| {code} | {meaning} |" for code, meaning in _whole_table()]
    return "\n".join(lines) + "\n"


ONCE_SPEC = "cli-once"
LOCK_SPEC = "cli-lock"
#: the key of ``run --semaphore`` and ``run --leader`` without ``--key``
DEFAULT_KEY = "default"
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


def whole_number(text: str, least: int, bad: str, small: str) -> int:
    """``text`` as a whole number of at least ``least``; else the error ``bad`` (not a
    number) or ``small`` says, with ``{}`` standing for the text as given."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(bad.format(repr(text))) from None
    if value < least:
        raise argparse.ArgumentTypeError(small.format(repr(text)))
    return value


def _count(text: str) -> int:
    return whole_number(text, 1, "invalid number {}", "invalid number {}: it must be at least 1")


def _tenant(text: str) -> str:
    from .._core.keys import validate_key

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
    from .._urls import secrets_in

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
    from .._urls import redact

    if url is None:
        return "<none>"
    secrets_ = _secrets_of(url)
    text = redact(url)
    for secret in secrets_:
        text = text.replace(secret, "***")
    return _scrub(text)


def _on_terminal() -> bool:
    """Whether a person watches stderr (a line saying that we wait, or how long a purge
    has run, is for them only)."""
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


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


def _epilog(command: str | None = None) -> str:
    """The exit statuses ``command`` can return (all of them for None), for ``--help``."""
    rows = _whole_table() if command is None else exit_statuses(command)
    width = max(len(code) for code, _ in rows)
    lines = ["exit statuses:"]
    for code, meaning in rows:
        head = f"  {code.ljust(width)}  "
        wrapped = textwrap.wrap(meaning, 79 - len(head)) or [""]
        lines.append(head + wrapped[0])
        lines += [" " * len(head) + more for more in wrapped[1:]]
    return "\n".join(lines)


def _url_help() -> str:
    from .._urls import default_url

    return f"store URL (default: $IDEMLOCK_URL, else {_shown_url(default_url())})"


def _package_version() -> str:
    from .. import __version__

    return __version__


#: ``add(name, help, description="")``: a subcommand's parser, with the global options
AddCommand = Callable[..., argparse.ArgumentParser]


def tenant_option(p: argparse.ArgumentParser, help: str) -> None:
    p.add_argument("--tenant", default=None, type=_tenant, metavar="TENANT", help=help)


def _connect(args: argparse.Namespace) -> Any:
    import idemlock

    return idemlock.connect(args.url, key_prefix=args.prefix)
