"""``idemlock demo``: duplicate side effects under at-least-once delivery, measured.

Worker processes consume the same jobs from a small SQLite queue that behaves like a
broker with at-least-once delivery: a job is leased to one worker and done only when
that worker acknowledges it; when a worker dies, its unacknowledged jobs are delivered
again. A killer SIGKILLs busy workers at random and starts replacements. The queue,
the workers and the killer are the fault harness's (``idemlock.cli._faults``), shared with
``benchmarks/chaos.py``.

Each job's side effect is one row inserted into an effects table. The demo runs
twice, with plain retries and with idemlock claim/complete, and counts duplicate
rows in the effects table afterwards: every number printed is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import secrets
import shutil
import signal
import sqlite3
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from .. import _attempts
from .._errors import ConfigurationError, IdemlockError, StaleClaim
from ._faults.queue import Outcome, Queue, consume, sqlite_connect
from ._faults.workers import Slot, Workers, context, redirect

#: A killed worker's claim stays reserved this long; jobs take ~20-100 ms.
DEMO_LEASE_MS = 1000
#: Each job has two steps around its side effect, each this long (ms, uniform).
STEP_MS = (10, 50)
MODES = ("plain", "idemlock")
TITLES = {"plain": "plain retries", "idemlock": "idemlock"}
HOW = {
    "plain": "take job, effect, ack",
    "idemlock": "take job, claim job-<id>, effect, complete, ack",
}
WIDTH = 92


class DemoFailed(IdemlockError):
    """The demo itself could not run (a worker crashed, it took far too long)."""


@dataclass
class WorkerConfig:
    mode: str
    worker: str
    queue: str
    effects: str
    url: str
    prefix: str
    spec: str
    seed: int
    keyed: bool
    lease_ms: int = DEMO_LEASE_MS
    step_ms: tuple[int, int] = STEP_MS


# ---- the two databases ---------------------------------------------------------

#: a taken job stays invisible this long unless its worker acks, hands it back or is
#: killed (then it is visible again at once): in the demo, only kills redeliver
VISIBILITY_S = 3600.0


def _queue(path: str) -> Queue:
    """The demo's queue; it records what became of each job (``events``)."""
    return Queue(lambda: sqlite_connect(path), events=True)


@contextlib.contextmanager
def _tx(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


def _create(queue: str, effects: str, jobs: int) -> None:
    q = _queue(queue)
    q.create([0.0] * jobs, "CREATE TABLE events (job_id int, worker text, kind text, at real);")
    q.close()
    fx = sqlite_connect(effects)
    fx.execute("PRAGMA journal_mode=WAL")
    fx.executescript(
        """
        -- the side effect: one row per execution, deliberately without a unique key
        CREATE TABLE effects (seq INTEGER PRIMARY KEY, job_id INTEGER NOT NULL,
                              worker TEXT, fence INTEGER, at REAL);
        -- protected re-runs that the keyed effect refused
        CREATE TABLE absorbed (job_id INTEGER, worker TEXT, fence INTEGER, prior INTEGER);
        """
    )
    fx.close()


def _effect(fx: sqlite3.Connection, job: int, worker: str, fence: int | None, keyed: bool) -> None:
    """The side effect. Keyed (protected run only): at most one row per job id, so a
    re-run after a kill between the effect and ``complete`` writes nothing; the row
    keeps the fence of the attempt that wrote it."""
    with _tx(fx):
        if keyed:
            prior = fx.execute("SELECT MAX(fence) FROM effects WHERE job_id = ?", (job,))
            prior_fence = prior.fetchone()[0]
            if prior_fence is not None:
                fx.execute(
                    "INSERT INTO absorbed VALUES (?, ?, ?, ?)", (job, worker, fence, prior_fence)
                )
                return
        fx.execute(
            "INSERT INTO effects (job_id, worker, fence, at) VALUES (?, ?, ?, ?)",
            (job, worker, fence, time.time()),
        )


# ---- a worker process ----------------------------------------------------------


def worker_main(cfg: WorkerConfig) -> int:
    import idemlock

    rng = random.Random(f"{cfg.seed}:{cfg.worker}")
    fx = sqlite_connect(cfg.effects)

    def step() -> None:
        time.sleep(rng.uniform(*cfg.step_ms) / 1000)

    port = None
    if cfg.mode == "idemlock":
        coord = idemlock.connect(cfg.url, key_prefix=cfg.prefix)
        spec = idemlock.IdempotencySpec(
            cfg.spec, ttl=timedelta(hours=1), lease=timedelta(milliseconds=cfg.lease_ms)
        )
        port = coord.idempotency(spec)

    def handle(job: int, delivery: int) -> Outcome:
        # what became of the job is recorded with its ack, in one transaction
        if port is None:
            step()  # prepare
            _effect(fx, job, cfg.worker, None, keyed=False)
            step()  # the rest of the handler, then the ack
            return "ran", None
        claim = port.claim(f"job-{job}", payload={"job": job})
        if isinstance(claim, idemlock.Completed):
            step()  # the rest of the handler runs on the replayed result
            return "replayed", None
        if isinstance(claim, idemlock.InFlight):
            # Held by a killed worker: deliver again once its lease is over.
            return "in_flight", claim.expires_at.timestamp() + 0.005
        try:
            step()
            _effect(fx, job, cfg.worker, claim.fence, keyed=cfg.keyed)
        except BaseException:
            _attempts.abandon_quietly(port, claim.token)
            raise
        outcome = "ran"
        try:
            port.complete(claim.token, {"worker": cfg.worker, "fence": claim.fence})
        except StaleClaim:
            outcome = "stale"  # slower than the lease: another attempt may run it too
        step()
        return outcome, None

    consume(_queue(cfg.queue), cfg.worker, VISIBILITY_S, handle, until_empty=True)
    return 0


# ---- the supervisor ------------------------------------------------------------


@dataclass
class _Phase:
    mode: str
    seconds: float = 0.0
    kills: int = 0
    measured: dict[str, Any] = field(default_factory=dict)


def _worker_entry(raw: dict[str, Any], log: str) -> None:
    redirect(log)
    raw["step_ms"] = tuple(raw["step_ms"])
    sys.exit(worker_main(WorkerConfig(**raw)))


def _failed(slot: Slot) -> DemoFailed:
    return DemoFailed(f"demo {slot.tail()}")


def _run_phase(base: WorkerConfig, args: argparse.Namespace, dirpath: Path, seed: int) -> _Phase:
    _create(base.queue, base.effects, args.jobs)
    q = _queue(base.queue)
    ctx = context(["idemlock", "idemlock.cli._demo", "sqlite3"])
    rng = random.Random(f"{seed}:killer")
    phase = _Phase(base.mode)
    workers = Workers(
        ctx,
        _worker_entry,
        lambda slot: asdict(base) | {"worker": slot.worker},
        dirpath / "logs",
        args.workers,
        prefix=f"{base.mode}-",
    )
    deadline = time.monotonic() + 60 + args.jobs * 0.5
    started = time.monotonic()
    try:
        workers.start()
        next_kill = started + rng.expovariate(1 / args.kill_every)
        while q.undone():
            for slot in workers.slots:
                if slot.proc is not None and slot.proc.exitcode not in (None, 0):
                    raise _failed(slot)
            now = time.monotonic()
            if now > deadline:
                raise DemoFailed(f"the {base.mode} run did not finish in {deadline - started:.0f}s")
            if now >= next_kill:
                next_kill = now + rng.expovariate(1 / args.kill_every)
                _kill_one(q, workers, rng, phase)
            time.sleep(min(0.005, max(0.0, next_kill - time.monotonic())))
        phase.seconds = time.monotonic() - started
        for slot in workers.slots:  # each exits by itself once every job is done
            slot.proc.join(timeout=30)
            if slot.proc.exitcode is None:
                raise DemoFailed(f"demo worker {slot.worker} did not exit")
            if slot.proc.exitcode != 0:
                raise _failed(slot)
    finally:
        workers.close()
        q.close()
    phase.measured = _measure(base, args.jobs)
    return phase


def _kill_one(q: Queue, workers: Workers, rng: random.Random, phase: _Phase) -> None:
    """Pick a random worker and, if it holds a job, SIGKILL it, redeliver its jobs and
    start a replacement. (Idle workers are spared, so every job runs the same risk,
    also the last ones.)"""
    slot = rng.choice(workers.slots)
    if slot.worker not in q.busy() or not slot.proc.is_alive():
        return
    code = workers.kill_and_replace(slot, q.release)
    if code == -signal.SIGKILL:
        phase.kills += 1
    elif code != 0:
        raise DemoFailed(f"demo worker {slot.worker} exited with status {code}")


def _measure(base: WorkerConfig, jobs: int) -> dict[str, Any]:
    q = sqlite_connect(base.queue)
    fx = sqlite_connect(base.effects)
    try:
        counts = [c for (c,) in fx.execute("SELECT COUNT(*) FROM effects GROUP BY job_id")]
        absorbed = int(fx.execute("SELECT COUNT(*) FROM absorbed").fetchone()[0])
        deliveries = int(q.execute("SELECT SUM(deliveries) FROM jobs").fetchone()[0] or 0)
        done = int(q.execute("SELECT COUNT(*) FROM jobs WHERE state = 'done'").fetchone()[0])
        events = dict(q.execute("SELECT kind, COUNT(*) FROM events GROUP BY kind").fetchall())
    finally:
        q.close()
        fx.close()
    return {
        "jobs": jobs,
        "jobs_done": done,
        "deliveries": deliveries,
        "effects": sum(counts),
        "jobs_with_effect": len(counts),
        "jobs_missing_effect": jobs - len(counts),
        "jobs_run_twice_or_more": sum(1 for c in counts if c > 1),
        "duplicate_effects": sum(counts) - len(counts),
        "replayed": int(events.get("replayed", 0)),
        "requeued_in_flight": int(events.get("in_flight", 0)),
        "stale_completions": int(events.get("stale", 0)),
        "window_reruns_absorbed": absorbed,
    }


# ---- the command ---------------------------------------------------------------


def run_demo(args: argparse.Namespace) -> int:
    import idemlock

    from .._urls import redact

    seed: int = args.seed if args.seed is not None else secrets.randbelow(1_000_000)
    url: str | None = args.url
    if url is not None and url.split("://", 1)[0].lower() == "memory":
        raise ConfigurationError(
            "the demo's workers are separate processes and memory:// lives in one "
            "process; use sqlite:///path/to/file.db, a server URL, or leave out --url"
        )
    dirpath = Path(tempfile.mkdtemp(prefix="idemlock-demo-"))
    own_store = url is None
    store_url = url or f"sqlite:///{dirpath / 'idemlock.db'}"
    # A fresh spec name per demo: a shared store never replays an earlier demo's jobs.
    spec = f"demo-{secrets.token_hex(4)}"

    def say(message: str) -> None:
        if not args.json:  # --json prints only the report, to stdout
            print(message, flush=True)

    say(
        f"idemlock demo: {args.jobs} jobs, {args.workers} worker processes; every "
        f"~{args.kill_every * 1000:.0f}ms a killer picks a worker and SIGKILLs it if it is "
        f"busy (seed {seed})"
    )
    kept = "kept (--keep)" if args.keep else "removed at the end; --keep keeps it"
    say(f"writing queue, effects and logs to {dirpath} ({kept})")
    if own_store:
        say(f"idemlock store: {store_url} (a throwaway store; yours is not touched)")
    else:
        say(f"idemlock store: {redact(store_url)} (spec {spec!r}, forgotten at the end)")
    phases: dict[str, _Phase] = {}
    try:
        # Create the store's schema once, before the workers race to.
        with idemlock.connect(store_url, key_prefix=args.prefix) as coord:
            coord.keys()
            for number, mode in enumerate(MODES, 1):
                sub = dirpath / mode
                sub.mkdir()
                base = WorkerConfig(
                    mode=mode,
                    worker="",
                    queue=str(sub / "queue.db"),
                    effects=str(sub / "effects.db"),
                    url=store_url,
                    prefix=args.prefix,
                    spec=spec,
                    seed=seed,
                    keyed=not args.plain_effects,
                )
                say(f"run {number}: {TITLES[mode]} ({HOW[mode]}) ...")
                phases[mode] = _run_phase(base, args, sub, seed)
                m = phases[mode].measured
                say(
                    f"  done in {phases[mode].seconds:.1f}s: {m['jobs_run_twice_or_more']} "
                    f"job(s) ran their side effect twice or more"
                )
            if not own_store:
                port = coord.idempotency(spec)
                for job in range(1, args.jobs + 1):
                    port.forget(f"job-{job}")
    finally:
        if not args.keep:
            shutil.rmtree(dirpath, ignore_errors=True)
    report = {
        "jobs": args.jobs,
        "workers": args.workers,
        "seed": seed,
        "kill_every_s": args.kill_every,
        "keyed_effects": not args.plain_effects,
        "dir": str(dirpath),
        "kept": bool(args.keep),
        "idemlock_url": redact(store_url),
        "lease_s": DEMO_LEASE_MS / 1000,
        "runs": {
            mode: {"seconds": round(p.seconds, 3), "kills": p.kills, **p.measured}
            for mode, p in phases.items()
        },
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(_render(report))
    missing = [m for m, r in report["runs"].items() if r["jobs_missing_effect"]]
    if missing:
        raise DemoFailed(f"jobs lost their side effect in the {', '.join(missing)} run")
    return 0


def _render(report: dict[str, Any]) -> str:
    runs = report["runs"]
    rows = [
        ("jobs", "jobs"),
        ("deliveries (with redeliveries)", "deliveries"),
        ("workers SIGKILLed", "kills"),
        ("side effects written", "effects"),
        ("duplicate side effects", "duplicate_effects"),
        ("jobs whose effect ran twice+", "jobs_run_twice_or_more"),
    ]
    width = max(len(label) for label, _ in rows)
    cols = [TITLES[m] for m in MODES]
    lines = ["", " " * width + "  " + "  ".join(c.rjust(14) for c in cols)]
    for label, name in rows:
        values = [str(runs[m][name]).rjust(14) for m in MODES]
        lines.append(label.ljust(width) + "  " + "  ".join(values))
    times = [f"{runs[m]['seconds']:.1f}s".rjust(14) for m in MODES]
    lines.append("time".ljust(width) + "  " + "  ".join(times))
    p = runs["idemlock"]
    lease = f"{report['lease_s']:g}s"
    lines.append("")
    lines += textwrap.wrap(
        f"With idemlock, {p['replayed']} redelivered job(s) found their result recorded and "
        f"did not run again, and {p['requeued_in_flight']} redelivery(ies) found a claim "
        f"still held by a killed worker and were requeued until its lease ({lease}) ended.",
        WIDTH,
    )
    if report["keyed_effects"]:
        window = (
            f"{p['window_reruns_absorbed']} time(s) here; the effects table is keyed by job id "
            "and records the claim's fence, so those re-runs wrote nothing"
        )
    else:
        window = (
            "counted above as duplicates; key the effect by job id and fence it with "
            "the claim's token to close it"
        )
    lines += textwrap.wrap(
        "Remaining window: a worker killed after its side effect but before `complete` "
        f"leaves its claim to expire, and the retry runs the job again ({window}).",
        WIDTH,
    )
    return "\n".join(lines)
