"""A worker process: jobs through ``@coord.idempotent`` or locks through ``hold()``."""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from faults import ELECTION_SPEC, LEASE_WORKLOADS, LOCK_SPEC, PERMIT_SPEC, SPEC, retried
from faults.effects import Fx, FxError
from idemlock.cli._faults.queue import Outcome, consume
from idemlock.cli._faults.workers import redirect

#: the steps workload's steps, in order, and the one run with ``once=True``
STEPS, ONCE = ("s1", "s2", "s3"), "s2"
#: how long each step of a job, or the preparation of a write under a lock, takes (ms)
STEP_MS = (5.0, 25.0)


def connect(url: str, seconds: float = 60) -> Any:
    """A Coordinator on ``url``; PostgreSQL: small pools (a few worker processes, one job
    at a time each).

    A store that cannot be reached (a Redis Cluster client reads the slot map right away,
    and a node may be cut, blackholed or restarting at that moment) is tried again every
    0.2 s for ``seconds``, as a real worker retries its start-up: a fault at start-up is
    part of the run, not a crash of the worker."""
    import idemlock

    options = {"max_size": 3, "timeout": 5.0} if url.startswith("postgresql") else {}

    def attempt() -> Any:
        try:
            return idemlock.connect(url, **options)
        except idemlock.StoreUnavailable as exc:
            print(f"{time.time():.3f} connect: store error: {exc}", file=sys.stderr, flush=True)
            raise

    return retried(attempt, idemlock.StoreUnavailable, seconds)


def job_key(job: int) -> str:
    return f"job-{job}"


def idempotent_jobs(
    coord: Any, lease: float, body: Callable[[int], str]
) -> tuple[Any, Callable[[int], str]]:
    """The jobs' port, and the job as the workers and the checker wrap it (so the same
    payload fingerprint)."""
    import idemlock

    spec = idemlock.IdempotencySpec(SPEC, ttl=timedelta(hours=2), lease=timedelta(seconds=lease))
    return coord.idempotency(spec), coord.idempotent(spec, key=job_key)(body)


def appender(path: str) -> Callable[[str], None]:
    """Lines appended to ``path`` as they happen (a killed worker's survive it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def add(line: str) -> None:
        os.write(fd, line.encode() + b"\n")

    return add


def event(exc: Exception, what: str, known: dict[type[Exception], str]) -> str:
    """The event ``exc`` is noted as: a store error (logged too), an effects database
    error, a ``known`` one, or one the worker does not expect (reported: the run fails;
    the worker goes on)."""
    from idemlock import StoreUnavailable

    if isinstance(exc, StoreUnavailable):
        print(f"{time.time():.3f} {what}: store error: {exc}", file=sys.stderr, flush=True)
        return "store_error"
    for cls, kind in (known | {FxError: "fx_error"}).items():
        if isinstance(exc, cls):
            return kind
    traceback.print_exc()
    sys.stderr.flush()
    return f"unexpected:{type(exc).__module__}.{type(exc).__name__}"


def worker_main(cfg: SimpleNamespace) -> None:
    import idemlock
    from idemlock import Completed, FencedOut, InFlight, InFlightError, StaleClaim
    from idemlock.stores.postgres import complete_in_transaction

    known: dict[type[Exception], str] = {FencedOut: "fenced_out"}
    if cfg.workload == "steps":  # a step refused because the claim moved on (a StaleClaim)
        known[idemlock.ClaimLost] = "claim_lost"
    known[StaleClaim] = "stale_complete"
    rng = random.Random(f"{cfg.seed}:{cfg.worker}")
    fx = Fx(*cfg.fx)
    note = appender(cfg.stats + ".txt")
    ran: list[int] = []

    def step() -> None:
        time.sleep(rng.uniform(*STEP_MS) / 1000)

    def effect(job: int, fence: int, finish: Callable[[Any], None] | None = None) -> str:
        ran.append(job)
        step()
        value = f"job-{job}/fence-{fence}/{cfg.worker}"
        row = {"job_id": job, "fence": fence, "value": value, "worker": cfg.worker}
        logged = {"job_id": job, "fence": fence, "worker": cfg.worker}
        if not fx.write("effects", row, logged, cfg.mode == "idemlock", finish):
            raise FencedOut(f"effects/{job}", fence, None)
        return value

    def body(job: int) -> str:
        claim = idemlock.current_claim()
        assert claim is not None
        value = effect(job, claim.fence)
        step()  # the rest of the handler: the window between the effect and complete
        return value

    def logged(job: int, name: str, kind: str, fence: int) -> dict[str, Any]:
        return {"job_id": job, "step": name, "kind": kind, "fence": fence} | {
            "worker": cfg.worker,
            "t": time.time(),
        }

    def step_effect(job: int, name: str, fence: int) -> str:
        # One step's effect: a fenced write of its own row, logged with the outcome.
        ran.append(job)
        step()
        value = f"job-{job}/{name}/fence-{fence}/{cfg.worker}"
        row = {"job_step": f"{job}/{name}", "fence": fence, "value": value, "worker": cfg.worker}
        fenced = cfg.mode == "idemlock"
        if not fx.write("step_effects", row, logged(job, name, "run", fence), fenced):
            raise FencedOut(f"step_effects/{job}/{name}", fence, None)
        return value

    def steps_body(job: int) -> str:
        """Three steps, each an effect; the ONCE one with ``once=True``: found interrupted,
        it is reported, and its result settled from what its effect row shows (the
        outside world), never run again."""
        claim = idemlock.current_claim()
        assert claim is not None
        values = []
        for name in STEPS:
            before = len(ran)
            try:
                value = claim.step(name, step_effect, job, name, claim.fence, once=name == ONCE)
            except idemlock.StepInterrupted:
                note("step_interrupted")
                fx.insert(
                    "step_log", logged(job, name, "interrupted", claim.fence) | {"accepted": True}
                )
                value = fx.value(f"{job}/{name}") or f"interrupted/{job}/{name}"
                claim.settle(name, value)
            else:
                if len(ran) > before:  # ran here, and its result recorded
                    fx.insert(
                        "step_log", logged(job, name, "done", claim.fence) | {"accepted": True}
                    )
            values.append(value)
        step()  # the rest of the handler: the window between the last step and complete
        return "|".join(values)

    def same_tx(job: int, delivery: int) -> None:
        claim = port.claim(job_key(job), payload={"job": job})
        if isinstance(claim, Completed):
            return
        if isinstance(claim, InFlight):
            raise InFlightError(job_key(job), claim.expires_at)

        def finish(conn: Any) -> None:
            step()  # the window: inside the transaction here
            complete_in_transaction(conn, port, claim.token, value)

        value = f"job-{job}/fence-{claim.fence}/{cfg.worker}"
        try:
            effect(job, claim.fence, finish)
        except BaseException:
            with contextlib.suppress(Exception):
                port.abandon(claim.token)
            raise

    def plain(job: int, delivery: int) -> None:
        effect(job, delivery)  # the delivery number in place of a fence: never fenced
        step()

    def plain_steps(job: int, delivery: int) -> None:
        # The steps called directly (no records): what a retry does without them.
        for name in STEPS:
            step_effect(job, name, delivery)
            fx.insert("step_log", logged(job, name, "done", delivery) | {"accepted": True})
        step()

    run: Callable[[int, int], Any] = plain_steps if cfg.workload == "steps" else plain
    if cfg.mode == "idemlock":
        handler = steps_body if cfg.workload == "steps" else body
        port, run_job = idempotent_jobs(connect(cfg.store_url), cfg.lease, handler)
        run = same_tx if cfg.same_tx else lambda job, _: run_job(job)

    def handle(job: int, delivery: int) -> Outcome:
        ran.clear()
        try:
            run(job, delivery)
            return ("ran" if ran else "replayed"), None
        except InFlightError as exc:
            until = exc.expires_at.timestamp() if exc.expires_at else time.time() + cfg.lease
            return "in_flight", until + 0.01
        except Exception as exc:
            kind = event(exc, f"job {job}", known)
            return kind, time.time() + (0 if kind == "stale_complete" else 0.05)

    consume(fx, cfg.worker, cfg.visibility, handle, note=note, errors=(FxError,))


def leases(coord: Any, cfg: SimpleNamespace) -> Callable[..., Any]:
    """The workload's way into a fenced lease: ``enter(res, holder, on_lost)``, a
    context manager giving (lease, token). A lock's ``hold()``; a semaphore's ``hold()``
    (one of ``cfg.limit`` permits); an election's ``campaign()``, the token being the
    term's number (and the holder its published value)."""
    import idemlock

    ttl = timedelta(seconds=cfg.lease)
    every, wait = cfg.lease / 3, 3 * cfg.lease

    if cfg.workload == "election":
        election = coord.election(idemlock.ElectionSpec(ELECTION_SPEC, ttl=ttl))

        @contextlib.contextmanager
        def campaign(res: str, holder: str, on_lost: Any) -> Iterator[tuple[Any, int]]:
            with election.campaign(
                res, value=holder, wait=wait, owner=holder, renew_every=every, on_lost=on_lost
            ) as term:
                yield term.lease, int(term.number)

        return campaign
    if cfg.workload == "permits":
        spec: Any = idemlock.SemaphoreSpec(PERMIT_SPEC, limit=cfg.limit, ttl=ttl)
        port = coord.semaphore(spec)
    else:
        port = coord.lock(idemlock.LockSpec(LOCK_SPEC, ttl=ttl))

    @contextlib.contextmanager
    def hold(res: str, holder: str, on_lost: Any) -> Iterator[tuple[Any, int]]:
        with port.hold(res, wait=wait, owner=holder, renew_every=every, on_lost=on_lost) as lease:
            yield lease, int(lease.token)

    return hold


def lock_worker_main(cfg: SimpleNamespace) -> None:
    """Hold a random resource's lock (a permit of it, its leadership) with renewals for
    0.2-2.5 ttls, writing fenced records under it, again and again until killed. Each
    write is logged with the holder, its token, a sequence number and the times around
    it."""
    from idemlock import FencedOut, LockLost, LockNotAcquired, StoreUnavailable

    known = {LockLost: "lock_lost", LockNotAcquired: "not_acquired"}
    rng = random.Random(f"{cfg.seed}:{cfg.worker}")
    note, told = appender(cfg.stats + ".txt"), appender(cfg.stats + ".lost")
    state_fd = os.open(cfg.stats + ".state", os.O_WRONLY | os.O_CREAT, 0o644)
    fx = Fx(*cfg.fx)
    coord = connect(cfg.store_url)
    ttl = cfg.lease
    enter = leases(coord, cfg)
    # The hash tag keeps the gate and the key set_if_fresh writes (the resource's own
    # name) in one slot on a Redis Cluster.
    resources = [f"{{res-{i}}}" for i in range(cfg.resources)]
    # Redis: the write is the store's own gate (set_if_fresh: check the token and SET
    # in one script); etcd: the gate's check_and_advance (one Txn); both logged after
    # their reply. SQL stores: a fenced upsert in the effects database, plain mode an
    # unfenced one (the negative control). Permits: N holders at once, so no gate of
    # one highest token: a counted fence in the effects database on every store.
    counted = cfg.workload == "permits"
    gated = cfg.mode == "idemlock" and cfg.store_url.startswith(("redis", "etcd")) and not counted
    gates = {r: coord.fence(r) for r in resources} if gated else {}

    def write(res: str, holder: str, lease: Any, token: int, seq: int) -> None:
        # What the holder knows when it decides to write; then it prepares the write
        # (a pause there, SIGSTOP or blackhole, is the window only the fence closes).
        sent = time.monotonic()  # before remaining(): a pause in between only shortens it
        left = lease.remaining_seconds()
        logged = {"t_sent": sent, "remaining": left, "lost": bool(lease.lost), "token": token}
        logged |= {"resource": res, "holder": holder, "seq": seq}
        time.sleep(rng.uniform(*STEP_MS) / 1000)
        accepted: bool | None
        fenced = cfg.mode == "idemlock"
        row = {k: logged[k] for k in ("resource", "token", "holder", "seq")}
        if counted:
            accepted = fx.write_counted(row, logged, cfg.limit, fenced)
        elif not gates:
            accepted = fx.write("lock_fence", row, logged, fenced)
        else:
            try:
                if cfg.store_url.startswith("etcd"):
                    gates[res].check_and_advance(token)
                else:
                    gates[res].set_if_fresh(token, res, f"{holder}/{token}/{seq}")
                accepted = True
            except FencedOut:
                accepted = False
            except StoreUnavailable:
                accepted = None  # maybe applied: never counted either way
            fx.insert("lock_log", logged | {"t_done": time.monotonic(), "accepted": accepted})
        note({True: "write_accepted", False: "write_refused", None: "write_unknown"}[accepted])

    n = 0
    while True:
        n += 1
        res = rng.choice(resources)
        holder = f"{cfg.worker}#{n}"
        entered: list[float] = []

        def on_lost(lease: Any, entered: list[float] = entered) -> None:
            # The lease's own deadline (from the last renewal's send), when we were told,
            # and since when we held it: an acquire answered after its own deadline (sent
            # into a silent network) gives a lease lost on arrival, and telling then is
            # on time.
            now = time.monotonic()
            told(f"{max(lease.deadline(), entered[0] if entered else now):.4f} {now:.4f}")

        before = time.monotonic()
        try:
            with enter(res, holder, on_lost) as (lease, token):
                after = time.monotonic()
                entered.append(after)
                os.pwrite(state_fd, b"1", 0)
                hold = {"resource": res, "holder": holder, "token": token}
                fx.insert("lock_holds", hold | {"t_before": before, "t_after": after})
                until = after + ttl * rng.uniform(0.2, 2.5)
                seq = 0
                while not lease.lost and time.monotonic() < until:
                    seq += 1
                    write(res, holder, lease, token, seq)
                if counted and cfg.mode == "idemlock":
                    with contextlib.suppress(FxError):  # else pushed out by a newer one
                        fx.retire(res, token)  # done writing: its place is free
                os.pwrite(state_fd, b"0", 0)
            note("held")
        except Exception as exc:
            note(event(exc, holder, known))
        os.pwrite(state_fd, b"0", 0)
        time.sleep(rng.uniform(0, 0.02))


def worker_entry(raw: dict[str, Any], log: str) -> None:
    redirect(log, append=True)
    cfg = SimpleNamespace(**raw)  # Run.config's
    (lock_worker_main if cfg.workload in LEASE_WORKLOADS else worker_main)(cfg)


#: what the workers' fork server imports once, so a replacement starts in milliseconds
PRELOAD = ["idemlock", "idemlock.stores.postgres", "redis", "psycopg", "faults.worker"]
