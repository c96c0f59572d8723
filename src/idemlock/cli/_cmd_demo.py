"""``idemlock demo``: duplicate side effects under at-least-once delivery, without and
with idemlock."""

from __future__ import annotations

import argparse

from ._common import (
    AddCommand,
    _count,
    _positive_duration,
)


def add_commands(add: AddCommand) -> None:
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


def cmd_demo(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from ._demo import run_demo

    return run_demo(args)
