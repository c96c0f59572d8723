"""``idemlock run``: CMD under a fenced lock (``--lock``) or at most once per key
(``--once``)."""

from __future__ import annotations

import argparse
import socket
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from .. import _attempts as attempts
from .._errors import (
    IdemlockError,
    LockLost,
    LockNotAcquired,
    PayloadMismatch,
    StaleClaim,
    StoreUnavailable,
)
from ._common import (
    DEFAULT_GRACE,
    DEFAULT_KEY,
    EX_IN_FLIGHT,
    EX_LEASE_LOST,
    EX_LOCK_NOT_ACQUIRED,
    EX_OK,
    EX_PAYLOAD_MISMATCH,
    EX_UNAVAILABLE,
    LOCK_SPEC,
    ONCE_SPEC,
    AddCommand,
    _connect,
    _human,
    _iso,
    _on_terminal,
    _positive_duration,
    _say,
    parse_duration,
)
from ._process import _Child, _child_env, _owner


def add_commands(add: AddCommand) -> None:
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
    mode.add_argument(
        "--semaphore",
        metavar="NAME:N",
        type=_semaphore_arg,
        help="run CMD while holding one of N permits of semaphore NAME (key: --key)",
    )
    mode.add_argument(
        "--leader",
        metavar="NAME",
        help="run CMD while leading election NAME (key: --key); waits until elected",
    )
    mode.add_argument("--once", metavar="KEY", help="run CMD at most once for KEY")
    run.add_argument(
        "--key",
        default=None,
        help=f"--semaphore, --leader: the key within NAME ({DEFAULT_KEY})",
    )
    run.add_argument(
        "--value",
        default=None,
        help="--leader: the value the leader publishes (default: host:pid:random)",
    )
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
        help="--lock, --semaphore: how long to wait for the lock or a permit (10s; 0 fails "
        "at once); --leader: how long to wait to be elected (until elected); "
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


# ---- run -----------------------------------------------------------------------


def _command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        parser.error("run: give the command after '--', e.g. idemlock run --lock x -- make")
    return cmd


def _semaphore_arg(text: str) -> tuple[str, int]:
    name, _, limit = text.rpartition(":")
    if not name or not limit.isdigit() or int(limit) < 1:
        raise argparse.ArgumentTypeError(
            f"expected NAME:N with N a positive number of permits (exports:3), got {text!r}"
        )
    return name, int(limit)


def cmd_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    cmd = _command(args, parser)
    if args.once is None and args.lease is not None:
        parser.error("run: --lease applies to --once; a lease's length is --ttl")
    if args.lock is None and args.once is None and args.spec is not None:
        parser.error("run: NAME is the spec of --semaphore and --leader; --spec is not used")
    if args.key is not None and (args.lock is not None or args.once is not None):
        parser.error("run: --key applies to --semaphore and --leader (--lock and --once name it)")
    if args.value is not None and args.leader is None:
        parser.error("run: --value applies to --leader")
    if args.once is not None:
        return _run_once(args, cmd)
    from .._core.types import ElectionSpec, LockSpec, SemaphoreSpec

    ttl = timedelta(seconds=30.0 if args.ttl is None else args.ttl)
    key: str = args.lock or args.key or DEFAULT_KEY
    with _connect(args) as coord:
        if args.lock is not None:
            port: Any = coord.lock(LockSpec(args.spec or LOCK_SPEC, ttl=ttl))
            held = f"lock {key!r}"
        elif args.semaphore is not None:
            name, limit = args.semaphore
            port = coord.semaphore(SemaphoreSpec(name, limit=limit, ttl=ttl))
            held = f"a permit of semaphore {name}:{key} (limit {limit})"
        else:
            port = coord.election(ElectionSpec(args.leader, ttl=ttl))
            held = f"the leadership of election {args.leader}:{key}"
        return _run_held(args, cmd, port, key, held)


def _run_held(args: argparse.Namespace, cmd: list[str], port: Any, key: str, held: str) -> int:
    """CMD while holding the lock, the permit or the term ``held`` names."""
    leader = args.leader is not None
    wait = (None if leader else 10.0) if args.wait is None else args.wait
    child = _Child(cmd, {}, grace=args.grace)
    lost = threading.Event()
    owner = _owner()

    def on_lost(lease: Any) -> None:
        lost.set()
        what = _what_now(child, args.grace)
        lease_of = f"the lease on {held}" if args.lock is not None else held
        _say(f"lost {lease_of} (token {lease.token}); {what}")
        child.terminate()

    if args.lock is not None and wait and _on_terminal():
        _say_waiting_for_lock(port, key, wait)
    if leader:
        value = args.value or owner
        block = port.campaign(key, value=value, wait=wait, owner=owner, on_lost=on_lost)
    else:
        block = port.hold(key, wait=wait, owner=owner, on_lost=on_lost)
    try:
        with block as got:
            lease = got.lease if leader else got
            child.env = _child_env(lease.token, IDEMLOCK_LOCK_KEY=key)
            if lost.is_set():  # lost before CMD even started: do not start it
                raise LockLost(f"lost {held} before CMD started")
            status: int = child.run()
    except LockNotAcquired:
        why = _refusal(port, key, held, wait)
        _say(f"{why}; CMD was not run (exit {EX_LOCK_NOT_ACQUIRED})")
        return EX_LOCK_NOT_ACQUIRED
    except LockLost as exc:
        if child.proc is not None and child.status is None:
            child.wait()  # left by an exception: still make sure the group ends
        _say(f"error: {exc}; {child.outcome()} (exit {EX_LEASE_LOST})")
        return EX_LEASE_LOST
    return status


def _refusal(port: Any, key: str, held: str, wait: float | None) -> str:
    """Why ``held`` was not obtained within --wait, naming who holds it."""
    from .._sync import ElectionPort, SemaphorePort

    within = f"within --wait {_human(wait or 0)}"
    try:
        if isinstance(port, ElectionPort):
            leader = port.leader(key)
            by = f" ({leader.value})" if leader is not None and leader.value else ""
            return f"{held} stayed with another leader{by} {within}"
        if isinstance(port, SemaphorePort):
            who = ", ".join(h.owner for h in port.holders(key)) or "others"
            return f"{held}: every permit stayed held ({who}) {within}"
        owner, left = port.owner(key), port.ttl(key)
    except IdemlockError:
        return f"{held} was not obtained {within}"
    who = f" by {owner}" if owner else ""
    until = f" ({_human(left.total_seconds())} left on its lease)" if left else ""
    return f"{held} is held{who}{until} and was not released {within}"


def _say_waiting_for_lock(lock: Any, name: str, wait: float) -> None:
    """Say once that ``run --lock --wait`` is waiting, and for whom (if it is held)."""
    try:
        holder = lock.owner(name)
        left = lock.ttl(name) if holder is not None or lock.is_locked(name) else None
    except IdemlockError:
        return  # the wait itself reports a store that fails
    if holder is None and left is None:
        return  # free: taken at once
    who = f" held by {holder}" if holder else ""
    until = f" ({_human(left.total_seconds())} left on its lease)" if left else ""
    _say(f"waiting for lock {name!r}{who}{until}, up to --wait {_human(wait)}\u2026")


def _say_waiting_for_claim(port: Any, key: str, wait: float, now: float) -> None:
    """Say once that ``run --once --wait`` is waiting for a run in flight elsewhere."""
    try:
        rec = port.status(key)
    except IdemlockError:
        return
    if rec is None or rec.state != "in_flight":
        return
    left = max(0.0, rec.expires_at.timestamp() - now)
    _say(
        f"waiting for {key!r}, being run elsewhere ({_human(left)} left on its claim's "
        f"lease, renewed while it runs), up to --wait {_human(wait)}\u2026"
    )


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
    from .._core.types import Claimed, Completed, IdempotencySpec, InFlight

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
        if wait > 0 and _on_terminal():
            _say_waiting_for_claim(port, key, wait, coord.clock.time())
        try:
            claim, sent = attempts.begin(port, key, payload, wait or None)
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
            _say(f"lost the claim on {key!r} (fence {token.fence}); {_what_now(child, args.grace)}")
            child.terminate()

        # Heartbeats: the claim is renewed while CMD runs, on the coordinator's renewer.
        beat = attempts.keep_alive(
            port, token, sent, attempts.heartbeat_every(port, None), None, on_lost
        )
        started_wall = datetime.now(timezone.utc)
        started = time.monotonic()
        try:
            if not lost.is_set():  # lost before CMD even started: do not start it
                status = child.run()
        except BaseException:
            beat.stop()
            attempts.abandon_quietly(port, token)
            raise
        if beat.stop() and (child.terminated or child.proc is None):
            # CMD did not finish on its own: nothing to record. Free KEY if this claim
            # still holds it (a retry runs CMD again; another run may hold it already).
            attempts.abandon_quietly(port, token)
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


def _what_now(child: _Child, grace: float) -> str:
    """What a lost lease or claim does to CMD, for the message that reports it."""
    if child.proc is not None and child.status is None:
        return f"terminating CMD and its processes (SIGTERM, then SIGKILL after {_human(grace)})"
    return "CMD is not running"
