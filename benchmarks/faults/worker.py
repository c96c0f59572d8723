"""A worker process: jobs through ``@coord.idempotent`` or locks through ``hold()``."""

from __future__ import annotations

import contextlib
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from faults import LOCK_SPEC, SPEC
from faults.effects import FxError, PgFx, make_fx
from idemlock._faults.workers import redirect

# ---- a worker process -------------------------------------------------------------------


@dataclass
class WorkerConfig:
    worker: str
    mode: str  # idemlock | plain
    same_tx: bool
    store_url: str
    fx_kind: str
    fx_dsn: str
    lease: float
    visibility: float
    seed: int
    stats: str
    step_ms: tuple[float, float] = (5.0, 25.0)
    workload: str = "jobs"  # jobs | lock
    resources: int = 3  # the lock workload's locks
    state: str = ""  # the lock workload: a byte, 1 while this worker holds a lock


class Stats:
    """Event counts of one worker, one line per event, appended as they happen (a
    killed worker's counts survive it)."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def add(self, event: str) -> None:
        os.write(self.fd, event.encode() + b"\n")


def store_options(url: str) -> dict[str, Any]:
    # Small pools: a few worker processes, each with one job at a time.
    return {"max_size": 3, "timeout": 5.0} if url.startswith("postgresql") else {}


def job_key(job: int) -> str:
    return f"job-{job}"


def idempotent_job(coord: Any, lease: float, body: Callable[[int], str]) -> Callable[[int], str]:
    """The job as the workers and the checker wrap it: same spec, key and signature
    (so the same payload fingerprint)."""
    import idemlock

    spec = idemlock.IdempotencySpec(SPEC, ttl=timedelta(hours=2), lease=timedelta(seconds=lease))

    @coord.idempotent(spec, key=job_key)
    def run_job(job: int) -> str:
        return body(job)

    return run_job  # type: ignore[no-any-return]


def worker_main(cfg: WorkerConfig) -> None:
    import idemlock
    from idemlock import Completed, FencedOut, InFlight, InFlightError, StaleClaim, StoreUnavailable

    rng = random.Random(f"{cfg.seed}:{cfg.worker}")
    stats = Stats(cfg.stats)
    fx = make_fx(cfg.fx_kind, cfg.fx_dsn)

    def step() -> None:
        time.sleep(rng.uniform(*cfg.step_ms) / 1000)

    def value_of(job: int, fence: int) -> str:
        return f"job-{job}/fence-{fence}/{cfg.worker}"

    coord: Any = None
    port: Any = None
    ran: list[int] = []
    if cfg.mode == "idemlock":
        coord = idemlock.connect(cfg.store_url, **store_options(cfg.store_url))
        spec = idemlock.IdempotencySpec(
            SPEC, ttl=timedelta(hours=2), lease=timedelta(seconds=cfg.lease)
        )
        port = coord.idempotency(spec)

    def body(job: int) -> str:
        claim = idemlock.current_claim()
        assert claim is not None
        ran.append(job)
        step()
        value = value_of(job, claim.fence)
        if isinstance(fx, PgFx):
            accepted = fx.effect_fenced(job, claim.fence, value, cfg.worker)
        else:
            accepted = fx.effect(job, claim.fence, value, cfg.worker, fenced=True)
        if not accepted:
            raise FencedOut(f"effects/{job}", claim.fence, None)
        step()  # the rest of the handler: the window between the effect and complete
        return value

    run_job = idempotent_job(coord, cfg.lease, body) if coord is not None else None

    def same_tx(job: int) -> str:
        assert isinstance(fx, PgFx)
        from idemlock.stores.postgres import complete_in_transaction

        claim = port.claim(job_key(job), payload={"job": job})
        if isinstance(claim, Completed):
            return "replayed"
        if isinstance(claim, InFlight):
            raise InFlightError(job_key(job), claim.expires_at)
        token = claim.token
        ran.append(job)
        try:
            step()
            value = value_of(job, token.fence)

            def finish(conn: Any) -> None:
                step()  # the window: inside the transaction here
                complete_in_transaction(conn, port, token, value)

            if not fx.effect_and_complete(job, token.fence, value, cfg.worker, finish):
                raise FencedOut(f"effects/{job}", token.fence, None)
        except BaseException:
            with contextlib.suppress(Exception):
                port.abandon(token)
            raise
        return "ran"

    def plain(job: int, delivery: int) -> None:
        ran.append(job)
        step()
        fx.effect(job, delivery, f"job-{job}/delivery-{delivery}/{cfg.worker}", cfg.worker, False)
        step()

    idle = 0.0
    while True:
        try:
            got = fx.take(cfg.worker, cfg.visibility)
        except FxError:
            stats.add("fx_error")
            time.sleep(0.05)
            continue
        if got is None:
            idle = min(0.02, idle + 0.002)
            time.sleep(idle)
            continue
        idle = 0.0
        job, delivery = got
        ran.clear()
        retry_at: float | None = None
        try:
            if cfg.mode == "plain":
                plain(job, delivery)
            elif cfg.same_tx:
                same_tx(job)
            else:
                assert run_job is not None
                run_job(job)
            stats.add("ran" if ran else "replayed")
        except InFlightError as exc:
            stats.add("in_flight")
            until = exc.expires_at.timestamp() if exc.expires_at else time.time() + cfg.lease
            retry_at = until + 0.01
        except FencedOut:
            stats.add("fenced_out")
            retry_at = time.time() + 0.05
        except StaleClaim:
            stats.add("stale_complete")
            retry_at = time.time()
        except StoreUnavailable as exc:
            stats.add("store_error")
            print(f"{time.time():.3f} job {job}: store error: {exc}", file=sys.stderr, flush=True)
            retry_at = time.time() + 0.05
        except FxError:
            stats.add("fx_error")
            retry_at = time.time() + 0.05
        except Exception as exc:
            # Not a failure a worker expects: report it (the run fails) and go on.
            stats.add(f"unexpected:{type(exc).__module__}.{type(exc).__name__}")
            traceback.print_exc()
            sys.stderr.flush()
            retry_at = time.time() + 0.05
        try:
            if retry_at is None:
                fx.ack(job)
            else:
                fx.nack(job, cfg.worker, delivery, retry_at)
        except FxError:
            stats.add("fx_error")  # the visibility timeout delivers it again


def resource_name(i: int) -> str:
    # The hash tag keeps the gate and the key set_if_fresh writes in one slot on a
    # Redis Cluster (set_if_fresh writes the resource's own name).
    return f"{{res-{i}}}"


def lock_worker_main(cfg: WorkerConfig) -> None:
    """Hold a random resource's lock with renewals for 0.2-2.5 ttls, writing fenced
    records under it, again and again until killed. Each write is logged with the
    holder, its token, a sequence number and the times around it."""
    import idemlock
    from idemlock import FencedOut, LockLost, LockNotAcquired, StoreUnavailable

    rng = random.Random(f"{cfg.seed}:{cfg.worker}")
    stats = Stats(cfg.stats)
    lost_fd = os.open(cfg.stats + ".lost", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    state_fd = os.open(cfg.state, os.O_WRONLY | os.O_CREAT, 0o644)
    fx = make_fx(cfg.fx_kind, cfg.fx_dsn)
    coord = idemlock.connect(cfg.store_url, **store_options(cfg.store_url))
    ttl = cfg.lease
    locks = coord.lock(idemlock.LockSpec(LOCK_SPEC, ttl=timedelta(seconds=ttl)))
    resources = [resource_name(i) for i in range(cfg.resources)]
    # Redis: the write is the store's own gate (set_if_fresh: check the token and SET
    # in one script); SQL stores: a fenced upsert in the effects database.
    # Plain mode: an unfenced upsert in the effects database (the negative control).
    redis = cfg.store_url.startswith("redis") and cfg.mode == "idemlock"
    # etcd: the gate's check_and_advance (one Txn), logged afterwards as Redis's is
    etcd = cfg.store_url.startswith("etcd") and cfg.mode == "idemlock"
    gates = {r: coord.fence(r) for r in resources} if redis or etcd else {}

    def write(res: str, holder: str, lease: Any, seq: int) -> None:
        # What the holder knows when it decides to write; then it prepares the write
        # (a pause there, SIGSTOP or blackhole, is the window only the fence closes).
        sent = time.monotonic()  # before remaining(): a pause in between only shortens it
        left = lease.remaining_seconds()
        lost = bool(lease.lost)
        token = int(lease.token)
        time.sleep(rng.uniform(*cfg.step_ms) / 1000)
        if not gates:
            fenced = cfg.mode == "idemlock"
            ok = fx.lock_write(res, holder, token, seq, sent, lost, left, fenced)
            stats.add("write_accepted" if ok else "write_refused")
            return
        accepted: bool | None
        try:
            if etcd:
                gates[res].check_and_advance(token)
            else:
                gates[res].set_if_fresh(token, res, f"{holder}/{token}/{seq}")
            accepted = True
        except FencedOut:
            accepted = False
        except StoreUnavailable:
            accepted = None  # maybe applied: never counted either way
        done = time.monotonic()
        fx.lock_log((res, holder, token, seq, sent, done, accepted, lost, left))
        stats.add({True: "write_accepted", False: "write_refused", None: "write_unknown"}[accepted])

    n = 0
    while True:
        n += 1
        res = rng.choice(resources)
        holder = f"{cfg.worker}#{n}"

        entered: list[float] = []

        def on_lost(lease: Any, entered: list[float] = entered) -> None:
            # The lease's own deadline (from the last renewal's send), when we were told,
            # and since when we held it: an acquire answered after its own deadline (sent
            # into a silent network) gives a lease that is lost on arrival, and telling
            # then is on time.
            now = time.monotonic()
            deadline = lease._sent + lease._ttl_ms / 1000
            since = entered[0] if entered else now
            os.write(lost_fd, f"{max(deadline, since):.4f} {now:.4f}\n".encode())

        before = time.monotonic()
        try:
            with locks.hold(
                res, wait=3 * ttl, owner=holder, renew_every=ttl / 3, on_lost=on_lost
            ) as lease:
                after = time.monotonic()
                entered.append(after)
                os.pwrite(state_fd, b"1", 0)
                fx.lock_hold(res, holder, int(lease.token), before, after)
                until = after + ttl * rng.uniform(0.2, 2.5)
                seq = 0
                while not lease.lost and time.monotonic() < until:
                    seq += 1
                    write(res, holder, lease, seq)
                os.pwrite(state_fd, b"0", 0)
            stats.add("held")
        except LockLost:
            stats.add("lock_lost")
        except LockNotAcquired:
            stats.add("not_acquired")
        except StoreUnavailable as exc:
            stats.add("store_error")
            print(f"{time.time():.3f} {holder}: store error: {exc}", file=sys.stderr, flush=True)
        except FxError:
            stats.add("fx_error")
        except Exception as exc:
            stats.add(f"unexpected:{type(exc).__module__}.{type(exc).__name__}")
            traceback.print_exc()
            sys.stderr.flush()
        os.pwrite(state_fd, b"0", 0)
        time.sleep(rng.uniform(0, 0.02))


def _worker_entry(raw: dict[str, Any], log: str) -> None:
    redirect(log, append=True)
    raw["step_ms"] = tuple(raw["step_ms"])
    cfg = WorkerConfig(**raw)
    (lock_worker_main if cfg.workload == "lock" else worker_main)(cfg)


#: what the workers' fork server imports once, so a replacement starts in milliseconds
PRELOAD = ["idemlock", "idemlock.stores.postgres", "redis", "psycopg", "faults.worker"]
