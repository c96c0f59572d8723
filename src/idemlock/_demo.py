"""``idemlock demo``: duplicate side effects under at-least-once delivery, measured.

Worker processes consume the same jobs from a small SQLite queue that behaves like a
broker with at-least-once delivery: a job is leased to one worker and deleted only
when that worker acknowledges it; when a worker dies, its unacknowledged jobs are
delivered again. A killer SIGKILLs busy workers at random and starts replacements.

Each job's side effect is one row inserted into an effects table. The demo runs
twice, with plain retries and with idemlock claim/complete, and counts duplicate
rows in the effects table afterwards: every number printed is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
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

from ._errors import ConfigurationError, IdemlockError, StaleClaim

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


def _open(path: str) -> sqlite3.Connection:
    # Autocommit mode: every transaction below is an explicit BEGIN IMMEDIATE.
    conn = sqlite3.connect(path, timeout=60, isolation_level=None)
    conn.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL survives a killed process
    return conn


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
    q = _open(queue)
    q.execute("PRAGMA journal_mode=WAL")
    q.executescript(
        """
        CREATE TABLE jobs (
            id INTEGER PRIMARY KEY,
            state TEXT NOT NULL DEFAULT 'ready',     -- ready | leased | done
            worker TEXT,
            available_at REAL NOT NULL DEFAULT 0,
            deliveries INTEGER NOT NULL DEFAULT 0
        );
        CREATE INDEX jobs_ready ON jobs (state, available_at);
        CREATE TABLE events (job_id INTEGER, worker TEXT, kind TEXT, at REAL);
        """
    )
    with _tx(q):
        q.executemany("INSERT INTO jobs (id) VALUES (?)", [(i,) for i in range(1, jobs + 1)])
    q.close()
    fx = _open(effects)
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


def _take(q: sqlite3.Connection, worker: str) -> int | None:
    with _tx(q):
        row = q.execute(
            "SELECT id FROM jobs WHERE state = 'ready' AND available_at <= ? "
            "ORDER BY available_at, id LIMIT 1",
            (time.time(),),
        ).fetchone()
        if row is None:
            return None
        q.execute(
            "UPDATE jobs SET state = 'leased', worker = ?, deliveries = deliveries + 1 "
            "WHERE id = ?",
            (worker, row[0]),
        )
        return int(row[0])


def _ack(q: sqlite3.Connection, job: int, worker: str, kind: str) -> None:
    with _tx(q):
        q.execute(
            "UPDATE jobs SET state = 'done' WHERE id = ? AND state = 'leased' AND worker = ?",
            (job, worker),
        )
        q.execute("INSERT INTO events VALUES (?, ?, ?, ?)", (job, worker, kind, time.time()))


def _nack(q: sqlite3.Connection, job: int, worker: str, until: float) -> None:
    with _tx(q):
        q.execute(
            "UPDATE jobs SET state = 'ready', worker = NULL, available_at = ? "
            "WHERE id = ? AND worker = ?",
            (until, job, worker),
        )
        q.execute("INSERT INTO events VALUES (?, ?, 'in_flight', ?)", (job, worker, time.time()))


def _unfinished(q: sqlite3.Connection) -> int:
    return int(q.execute("SELECT COUNT(*) FROM jobs WHERE state != 'done'").fetchone()[0])


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
    q = _open(cfg.queue)
    fx = _open(cfg.effects)

    def step() -> None:
        time.sleep(rng.uniform(*cfg.step_ms) / 1000)

    port = None
    if cfg.mode == "idemlock":
        coord = idemlock.connect(cfg.url, key_prefix=cfg.prefix)
        spec = idemlock.IdempotencySpec(
            cfg.spec, ttl=timedelta(hours=1), lease=timedelta(milliseconds=cfg.lease_ms)
        )
        port = coord.idempotency(spec)
    while True:
        job = _take(q, cfg.worker)
        if job is None:
            if _unfinished(q) == 0:
                return 0
            time.sleep(0.005)
            continue
        if port is None:
            step()  # prepare
            _effect(fx, job, cfg.worker, None, keyed=False)
            step()  # the rest of the handler, then the ack
            _ack(q, job, cfg.worker, "ran")
            continue
        claim = port.claim(f"job-{job}", payload={"job": job})
        if isinstance(claim, idemlock.Completed):
            step()  # the rest of the handler runs on the replayed result
            _ack(q, job, cfg.worker, "replayed")
            continue
        if isinstance(claim, idemlock.InFlight):
            # Held by a killed worker: deliver again once its lease is over.
            _nack(q, job, cfg.worker, claim.expires_at.timestamp() + 0.005)
            continue
        try:
            step()
            _effect(fx, job, cfg.worker, claim.fence, keyed=cfg.keyed)
        except BaseException:
            port._abandon_quietly(claim.token)
            raise
        outcome = "ran"
        try:
            port.complete(claim.token, {"worker": cfg.worker, "fence": claim.fence})
        except StaleClaim:
            outcome = "stale"  # slower than the lease: another attempt may run it too
        step()
        _ack(q, job, cfg.worker, outcome)


# ---- the supervisor ------------------------------------------------------------


@dataclass
class _Slot:
    index: int
    incarnation: int = 0
    worker: str = ""
    proc: Any = None  # a multiprocessing Process
    log: Path | None = None


@dataclass
class _Phase:
    mode: str
    seconds: float = 0.0
    kills: int = 0
    measured: dict[str, Any] = field(default_factory=dict)


def _context() -> Any:
    """Worker processes come from a fork server that has idemlock imported already, so
    a replacement for a killed worker starts in milliseconds; spawn where there is none."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["idemlock", "idemlock._demo", "sqlite3"])
    return ctx


def _worker_entry(raw: dict[str, Any], log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    raw["step_ms"] = tuple(raw["step_ms"])
    sys.exit(worker_main(WorkerConfig(**raw)))


def _spawn(slot: _Slot, base: WorkerConfig, logs: Path, ctx: Any) -> None:
    slot.incarnation += 1
    slot.worker = f"w{slot.index}.{slot.incarnation}"
    slot.log = logs / f"{base.mode}-{slot.worker}.log"
    cfg = asdict(base) | {"worker": slot.worker}
    slot.proc = ctx.Process(target=_worker_entry, args=(cfg, str(slot.log)), daemon=True)
    slot.proc.start()


def _failed(slot: _Slot) -> DemoFailed:
    text = slot.log.read_text(errors="replace").strip() if slot.log else ""
    tail = "\n".join(text.splitlines()[-15:])
    code = slot.proc.exitcode if slot.proc else None
    return DemoFailed(f"demo worker {slot.worker} exited with status {code}:\n{tail}")


def _run_phase(base: WorkerConfig, args: argparse.Namespace, dirpath: Path, seed: int) -> _Phase:
    logs = dirpath / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    _create(base.queue, base.effects, args.jobs)
    q = _open(base.queue)
    ctx = _context()
    rng = random.Random(f"{seed}:killer")
    phase = _Phase(base.mode)
    slots = [_Slot(i + 1) for i in range(args.workers)]
    deadline = time.monotonic() + 60 + args.jobs * 0.5
    started = time.monotonic()
    try:
        for slot in slots:
            _spawn(slot, base, logs, ctx)
        next_kill = started + rng.expovariate(1 / args.kill_every)
        while _unfinished(q):
            for slot in slots:
                if slot.proc is not None and slot.proc.exitcode not in (None, 0):
                    raise _failed(slot)
            now = time.monotonic()
            if now > deadline:
                raise DemoFailed(f"the {base.mode} run did not finish in {deadline - started:.0f}s")
            if now >= next_kill:
                next_kill = now + rng.expovariate(1 / args.kill_every)
                _kill_one(q, slots, rng, phase, base, logs, ctx)
            time.sleep(min(0.005, max(0.0, next_kill - time.monotonic())))
        phase.seconds = time.monotonic() - started
        for slot in slots:  # each exits by itself once every job is done
            slot.proc.join(timeout=30)
            if slot.proc.exitcode is None:
                raise DemoFailed(f"demo worker {slot.worker} did not exit")
            if slot.proc.exitcode != 0:
                raise _failed(slot)
    finally:
        for slot in slots:
            if slot.proc is not None and slot.proc.is_alive():
                slot.proc.kill()
                slot.proc.join()
        q.close()
    phase.measured = _measure(base, args.jobs)
    return phase


def _kill_one(
    q: sqlite3.Connection,
    slots: list[_Slot],
    rng: random.Random,
    phase: _Phase,
    base: WorkerConfig,
    logs: Path,
    ctx: Any,
) -> None:
    """Pick a random worker and, if it holds a job, SIGKILL it; redeliver its jobs as a
    broker does when a consumer's connection drops; start a replacement. (Idle workers
    are spared, so every job runs the same risk, also the last ones.)"""
    slot = rng.choice(slots)
    busy = q.execute("SELECT 1 FROM jobs WHERE state = 'leased' AND worker = ?", (slot.worker,))
    if busy.fetchone() is None or not slot.proc.is_alive():
        return
    slot.proc.kill()  # SIGKILL: no cleanup, no goodbye, like a crash or an OOM kill
    slot.proc.join()
    if slot.proc.exitcode == -signal.SIGKILL:
        phase.kills += 1
    elif slot.proc.exitcode != 0:
        raise _failed(slot)
    with _tx(q):
        q.execute(
            "UPDATE jobs SET state = 'ready', worker = NULL WHERE state = 'leased' AND worker = ?",
            (slot.worker,),
        )
    _spawn(slot, base, logs, ctx)


def _measure(base: WorkerConfig, jobs: int) -> dict[str, Any]:
    q = _open(base.queue)
    fx = _open(base.effects)
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

    from ._urls import redact

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
