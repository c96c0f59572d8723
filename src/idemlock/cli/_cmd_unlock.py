"""``idemlock unlock KEY --force``: break a lock another process holds."""

from __future__ import annotations

import argparse

from ._common import (
    EX_NO_RECORD,
    EX_OK,
    EX_USAGE,
    LOCK_SPEC,
    AddCommand,
    _connect,
    _say,
    tenant_option,
    whole_number,
)

UNLOCK_HELP = """\
Free the lock KEY whoever holds it: a worker that hangs, or died with a long
lease. This is a break, not a release (the CLI is not the holder), so it needs
--force.

What it does to fences: the lock's token counter is kept, so the next holder
gets a higher token than the broken one. Wherever the new holder writes through
a fence gate (check_and_advance, set_if_fresh), the old holder's late writes are
refused. Until someone takes the lock and writes, the gate cannot know: a broken
holder that is still running is only fenced out once a newer token has reached
the gate. The old holder's next renewal fails, so it learns it lost the lock
(`idemlock run --lock` ends its CMD and exits 77; hold() raises LockLost).

--token N (the TOKEN column of `idemlock locks`) breaks only a holder that still
has that token, never one that took the lock over since you looked."""


def add_commands(add: AddCommand) -> None:
    unlock = add(
        "unlock", "break a lock another process holds (with --force; see --help)", UNLOCK_HELP
    )
    unlock.add_argument("key", metavar="KEY")
    unlock.add_argument(
        "--spec", default=LOCK_SPEC, help=f"lock spec name ({LOCK_SPEC}, as run --lock)"
    )
    tenant_option(unlock, "the tenant whose lock it is (as listed by `locks`)")
    unlock.add_argument(
        "--force", action="store_true", help="free the lock although another owner holds it"
    )
    unlock.add_argument(
        "--token",
        type=_token,
        default=None,
        metavar="N",
        help="only if the holder still has token N (from `idemlock locks`)",
    )
    unlock.set_defaults(handler=cmd_unlock)


def _token(text: str) -> int:
    return whole_number(text, 0, "not a token (a whole number): {}", "tokens are not negative: {}")


def cmd_unlock(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    where = f"lock {args.key!r} of spec {args.spec!r}" + (
        "" if args.tenant is None else f" of tenant {args.tenant!r}"
    )
    if not args.force:
        _say(
            f"not unlocking {where}: it is held by another process, and freeing it is a "
            "break: pass --force (see `idemlock unlock --help` for what that does to fences)"
        )
        return EX_USAGE
    with _connect(args) as coord:
        scoped = coord if args.tenant is None else coord.for_tenant(args.tenant)
        # Who held it, for the message (the break itself is one atomic store call).
        row = next(
            (
                h
                for h in scoped.locks()
                if (h.tenant, h.spec, h.key) == (args.tenant, args.spec, args.key)
            ),
            None,
        )
        broken = scoped.lock(args.spec).break_lock(args.key, token=args.token)
    if broken:
        token = args.token if args.token is not None or row is None else row.token
        holder = "" if row is None else f", held by {row.owner!r}"
        _say(
            f"broke {where}{holder} (token {token}); the next holder gets a higher token, "
            "and the old holder's renewal and release now fail"
        )
        return EX_OK
    if args.token is not None and row is not None:
        _say(
            f"{where} is held with token {row.token}, not {args.token}: nothing was changed "
            "(someone took it over since; check `idemlock locks` again)"
        )
    else:
        _say(f"nothing to unlock: {where} is not held")
    return EX_NO_RECORD
