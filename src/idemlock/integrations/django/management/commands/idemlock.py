"""``manage.py idemlock COMMAND ...``: the ``idemlock`` command line on the store of
``settings.IDEMLOCK`` (its ``url``, or its ``coordinator``'s URL and key prefix)::

    python manage.py idemlock keys --spec http
    python manage.py idemlock status KEY --spec http
    python manage.py idemlock locks
    python manage.py idemlock purge

Every command of ``idemlock --help`` works the same way, with the same exit statuses
(a non-zero one is a ``CommandError`` carrying it); ``--url`` is not taken.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any, ClassVar

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError


def _store() -> tuple[str, str]:
    """The configured store's URL and key prefix."""
    conf = getattr(settings, "IDEMLOCK", None)
    if not isinstance(conf, dict):
        raise CommandError(
            "settings.IDEMLOCK is not set: it names the store (IDEMLOCK = {'url': ...})"
        )
    coordinator = conf.get("coordinator")
    if coordinator is not None:
        url = getattr(coordinator, "url", None)
        if not isinstance(url, str):
            raise CommandError(
                "settings.IDEMLOCK['coordinator'] has no URL to open the store with: "
                "set IDEMLOCK['url'] instead"
            )
        return url, str(getattr(coordinator, "key_prefix", "idemlock"))
    url = conf.get("url")
    if not isinstance(url, str):
        raise CommandError("settings.IDEMLOCK needs 'url' (a store URL) or 'coordinator'")
    return url, "idemlock"


class Command(BaseCommand):  # type: ignore[misc]  # Django has no type information here
    help = (
        "The idemlock command line (keys, locks, status, forget, unlock, purge, run, ...) "
        "on the store of settings.IDEMLOCK. 'manage.py idemlock --help' lists the "
        "commands; 'manage.py idemlock keys --help' one command's options."
    )
    # Listing and purging a store that the checks warn about is what one wants then.
    requires_system_checks: ClassVar[list[str]] = []

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument(
            "args", nargs=argparse.REMAINDER, metavar="COMMAND ...", help="an idemlock command"
        )

    def run_from_argv(self, argv: list[str]) -> None:
        # `manage.py idemlock --help` is the CLI's help (its commands), not Django's.
        if argv[2:3] in (["--help"], ["-h"]):
            argv = [*argv[:2], "help"]
        super().run_from_argv(argv)

    def handle(self, *args: str, **options: Any) -> None:
        from idemlock.cli import main

        if any(a == "--url" or a.startswith("--url=") for a in args):
            raise CommandError("the store is settings.IDEMLOCK's: --url is not taken here")
        argv = list(args) if args and args != ("help",) else ["--help"]
        url, prefix = _store()
        stdout = getattr(self.stdout, "_out", self.stdout)
        stderr = getattr(self.stderr, "_out", self.stderr)
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                status = main(["--url", url, "--prefix", prefix, *argv], prog="manage.py idemlock")
            except SystemExit as exc:  # --help, or a usage error argparse printed
                status = exc.code if isinstance(exc.code, int) else 2
        if status:
            raise CommandError(
                f"idemlock {argv[0]} exited with status {status} (see above)", returncode=status
            )
