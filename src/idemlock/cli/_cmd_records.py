"""The commands on records and locks: ``status``, ``forget``, ``keys``, ``locks``,
``purge`` and ``migrate``."""

from __future__ import annotations

import argparse
import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ._common import (
    DEFAULT_KEY,
    EX_NO_RECORD,
    EX_OK,
    ONCE_SPEC,
    AddCommand,
    _connect,
    _human,
    _iso,
    _on_terminal,
    _out,
    _print_json,
    _say,
    _scrub,
    _shown_url,
    _table,
    tenant_option,
)


def add_commands(add: AddCommand) -> None:
    status = add("status", "show the record of an idempotency key")
    _key_arguments(status)
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument(
        "--steps", action="store_true", help="also list the operation's recorded steps"
    )
    status.set_defaults(handler=cmd_status)

    forget = add(
        "forget",
        "delete the record of an idempotency key (a retry runs again)",
        "Delete the record of an idempotency key whatever its state: a completed one (its\n"
        "next run runs again) or a stuck in-flight claim (a worker that hangs).\n\n"
        "What it does to fences: the key's fence counter is kept, so the next claim of\n"
        "the key gets a higher fence than the forgotten one. The old attempt's complete\n"
        "and abandon are refused (its claim is gone), its heartbeat fails so it learns\n"
        "it lost the claim, and wherever the new attempt writes through a fence gate its\n"
        "late writes are refused. Nothing stops a forgotten attempt that is still\n"
        "running from doing work that is not fenced: forget a claim only when its\n"
        "worker is gone or stuck.",
    )
    _key_arguments(forget)
    forget.set_defaults(handler=cmd_forget)

    keys = add(
        "keys",
        "list live idempotency records",
        "List live idempotency records: the root's own and every tenant's (TENANT '-'\n"
        "is the root); act on one with status/forget KEY --spec SPEC [--tenant TENANT].\n"
        "A value under the prefix that idemlock cannot read is listed as CORRUPT, with a\n"
        "warning on stderr, and the rest is listed as usual.",
    )
    _listing_arguments(keys, "records")
    keys.set_defaults(handler=cmd_keys)

    locks = add(
        "locks",
        "list held locks",
        "List held locks: the root's own and every tenant's (TENANT '-' is the root).\n"
        "A value idemlock cannot read is listed as CORRUPT, with a warning on stderr.",
    )
    _listing_arguments(locks, "locks")
    locks.set_defaults(handler=cmd_locks)

    permits = add(
        "permits",
        "show who holds the permits of a semaphore key",
        "Show the live permits of KEY in semaphore NAME (as run --semaphore NAME:N --key\n"
        "KEY takes them): owner, fencing token, time left and the published value.",
    )
    permits.add_argument("name", metavar="NAME")
    permits.add_argument("key", metavar="KEY", nargs="?", default=DEFAULT_KEY)
    tenant_option(permits, "the tenant whose semaphore it is")
    permits.add_argument("--json", action="store_true", help="print JSON")
    permits.set_defaults(handler=cmd_permits)

    leader = add(
        "leader",
        "show the leader of an election key",
        "Show the leader of KEY in election NAME (as run --leader NAME --key KEY elects\n"
        "it): its published value, term (a fencing token), owner and time left.",
    )
    leader.add_argument("name", metavar="NAME")
    leader.add_argument("key", metavar="KEY", nargs="?", default=DEFAULT_KEY)
    tenant_option(leader, "the tenant whose election it is")
    leader.add_argument("--json", action="store_true", help="print JSON")
    leader.set_defaults(handler=cmd_leader)

    purge = add(
        "purge",
        "delete expired records and locks from the store",
        "Delete expired records and locks from the store (every prefix's: the store's\n"
        "whole table on SQLite and PostgreSQL). Redis expires its keys by itself, so\n"
        "there is never anything to purge there; on etcd, locks and completed records\n"
        "go with their etcd leases, and purge removes in-flight claims whose lease\n"
        "ended. --dry-run counts what a purge now would remove and removes nothing.",
    )
    purge.add_argument(
        "--dry-run",
        action="store_true",
        help="only count the expired records and locks a purge would remove (read-only)",
    )
    purge.add_argument("--json", action="store_true", help="print JSON")
    purge.set_defaults(handler=cmd_purge)

    migrate = add("migrate", "create or upgrade the store's schema (PostgreSQL)")
    migrate.add_argument(
        "--schema",
        default=None,
        help="the PostgreSQL schema the store is opened with (its schema=; default idemlock)",
    )
    migrate.set_defaults(handler=cmd_migrate)


def _key_arguments(command: argparse.ArgumentParser) -> None:
    """KEY, --spec and --tenant: the record one command acts on."""
    command.add_argument("key", metavar="KEY")
    command.add_argument("--spec", default=ONCE_SPEC, help=f"spec name ({ONCE_SPEC})")
    tenant_option(command, "the tenant whose record it is (as listed by `keys`)")


def _listing_arguments(command: argparse.ArgumentParser, what: str) -> None:
    command.add_argument("--spec", default=None, help="only this spec")
    tenant_option(command, f"only this tenant's {what}")
    command.add_argument("--json", action="store_true", help="print JSON")


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
        shown = _record_json(rec, now)
        if args.steps:
            shown["steps"] = [
                {"name": s.name, "state": s.state, "size": s.size, "fence": s.fence}
                for s in rec.steps
            ]
        _print_json(shown)
    else:
        _out(_table(_RECORD_HEADERS, [_record_row(rec, now)]))
        if args.steps:
            rows = [[s.name, s.state, s.size, s.fence] for s in rec.steps]
            _out(_table(["STEP", "STATE", "BYTES", "FENCE"], rows) if rows else "no steps")
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


def _listed(
    args: argparse.Namespace, listing: Callable[[Any], list[Any]]
) -> tuple[Any, float, str]:
    """The rows ``listing`` gives of the scope ``args`` name (of ``--spec`` only, if
    given), sorted, with the store's time and URL."""
    with _connect(args) as coord:
        rows = listing(_scoped(coord, args))
        now = coord.clock.time()
        where = coord.url
    rows = [r for r in rows if args.spec is None or r.spec == args.spec]
    rows.sort(key=lambda r: (r.tenant or "", r.spec, r.key))
    return rows, now, where


def _say_none(args: argparse.Namespace, what: str, where: str) -> None:
    _say(f"no {what} under prefix {args.prefix!r}{_where(args.tenant)} in {_shown_url(where)}")


def cmd_keys(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    records, now, where = _listed(args, lambda scope: scope.keys())
    if args.json:
        _print_json([_record_json(r, now) for r in records])
    elif not records:
        _say_none(args, "live records", where)
    else:
        _out(_table(_RECORD_HEADERS, [_record_row(r, now) for r in records]))
    _warn_corrupt("record(s)", sum(r.state == "corrupt" for r in records))
    return EX_OK


def cmd_locks(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    held, now, where = _listed(args, lambda scope: scope.locks())

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
        _say_none(args, "held locks", where)
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


def cmd_permits(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .._core.types import MAX_LIMIT, SemaphoreSpec

    with _connect(args) as coord:
        port = _scoped(coord, args).semaphore(SemaphoreSpec(args.name, limit=MAX_LIMIT))
        held = port.holders(args.key)
        now = coord.clock.time()
    rows = [
        {
            "owner": h.owner,
            "token": h.token,
            "expires_at": _iso(h.expires_at),
            "time_left_s": round(max(0.0, h.expires_at.timestamp() - now), 3),
            "value": h.value,
        }
        for h in held
    ]
    if args.json:
        _print_json(rows)
    elif not rows:
        _say(f"no permit of semaphore {args.name}:{args.key} is held")
    else:
        table = [
            [r["owner"], r["token"], _human(float(r["time_left_s"])), r["value"] or "-"]
            for r in rows
        ]
        _out(_table(["OWNER", "TOKEN", "TIME LEFT", "VALUE"], table))
    return EX_OK


def cmd_leader(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .._core.types import ElectionSpec

    with _connect(args) as coord:
        leader = _scoped(coord, args).election(ElectionSpec(args.name)).leader(args.key)
        now = coord.clock.time()
    if leader is None:
        if args.json:
            _print_json(None)
        else:
            _say(f"election {args.name}:{args.key} has no leader")
        return EX_OK
    left = round(max(0.0, leader.expires_at.timestamp() - now), 3)
    if args.json:
        _print_json(
            {
                "value": leader.value,
                "term": leader.term,
                "owner": leader.owner,
                "expires_at": _iso(leader.expires_at),
                "time_left_s": left,
            }
        )
    else:
        _out(
            f"{leader.value if leader.value is not None else '-'}  (term {leader.term}, "
            f"owner {leader.owner}, {_human(left)} left)"
        )
    return EX_OK


def cmd_purge(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    with _connect(args) as coord:
        where = coord.url
        doing = "counting" if args.dry_run else "purging"
        with _progress(f"{doing} expired records and locks in {_shown_url(where)}"):
            count = coord.purge(dry_run=args.dry_run)
    if args.dry_run:
        if args.json:
            _print_json({"would_purge": count, "dry_run": True})
        else:
            _out(
                f"would purge {count} expired record(s) and lock(s) from {_shown_url(where)} "
                "(dry run: nothing was removed)"
            )
    elif args.json:
        _print_json({"purged": count})
    else:
        _out(f"purged {count} expired record(s) and lock(s) from {_shown_url(where)}")
    return EX_OK


def cmd_migrate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import importlib

    from .._urls import default_url, driver_error, refuse_unencoded_password

    url: str = args.url or default_url()
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme not in ("postgresql", "postgres"):
        _out(f"nothing to migrate: the {scheme or 'given'} store creates its schema on first use")
        return EX_OK
    try:
        # Lazily: the PostgreSQL driver is an optional extra.
        postgres = importlib.import_module("idemlock.stores.postgres")
    except ImportError as exc:
        raise driver_error("postgres", exc) from exc
    # libpq would read the password's pieces as the host, port and database name.
    refuse_unencoded_password(url, "PostgreSQL URL", libpq=True)
    schema = args.schema or postgres.DEFAULT_SCHEMA
    outcome = postgres.migrate(url, schema=schema)
    detail = f": {outcome}" if outcome not in (None, True) else ""
    _out(f"migrated schema {schema} of {_shown_url(url)}{detail}")
    return EX_OK


@contextlib.contextmanager
def _progress(what: str, every: float = 0.5) -> Iterator[None]:
    """On a terminal, a line on stderr saying what runs and for how long, redrawn in
    place until the block ends, then erased (a long purge shows it is alive); nothing
    when stderr is not a terminal."""
    if not _on_terminal():
        yield
        return
    done = threading.Event()
    started = time.monotonic()

    def draw() -> None:
        while True:
            line = f"idemlock: {what}\u2026 {_human(time.monotonic() - started)}"
            sys.stderr.write(f"\r{_scrub(line)}\x1b[K")
            sys.stderr.flush()
            if done.wait(every):
                return

    ticker = threading.Thread(target=draw, name="idemlock-progress", daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join(timeout=5)
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()
