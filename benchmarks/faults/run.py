"""One run: servers, workers, faults, drain, checks (the job workload)."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from tests.servers.postgres import PgServer, start_postgres
from tests.servers.redis import RedisCluster, RedisServer, start_cluster, start_redis

from faults import HOST, KINDS, LOCK_KINDS, LOSSY, NETWORK_KINDS, SPEC, STORE_KINDS, Findings
from faults.effects import Fx, FxError, PgFx, SqliteFx
from faults.network import Network
from faults.worker import (
    PRELOAD,
    WorkerConfig,
    _worker_entry,
    idempotent_job,
    job_key,
    store_options,
)
from idemlock._faults.workers import Slot, Workers, context

# ---- the supervisor: servers, workers, faults ------------------------------------------


@dataclass
class Options:
    jobs: int
    workers: int
    duration: float
    fault_every: float
    lease: float
    visibility: float
    seed: int
    verbose: bool = False
    resources: int = 3


@dataclass
class Outcome:
    faults: Counter[str] = field(default_factory=Counter)
    #: (worker, from, until) of each SIGSTOP, CLOCK_MONOTONIC
    stops: list[tuple[str, float, float]] = field(default_factory=list)
    worker_exits: list[str] = field(default_factory=list)
    seconds: float = 0.0
    drained: bool = False


class Run:
    """One store, one mode: start, inject, drain, check, tear down."""

    workload = "jobs"

    def __init__(self, store: str, mode: str, same_tx: bool, opts: Options, say: Any) -> None:
        assert not same_tx or (store, mode) == ("postgres", "idemlock")
        self.store, self.mode, self.same_tx, self.opts = store, mode, same_tx, opts
        self.say = say
        applies = LOCK_KINDS if self.workload == "lock" else STORE_KINDS
        self.kinds = applies[store]
        self.rng = random.Random(f"{opts.seed}:{store}:{mode}:{same_tx}:{self.workload}:faults")
        self.root = Path(tempfile.mkdtemp(prefix=f"idemlock-chaos-{store}-"))
        self.hub: Network | None = None
        self.redis: RedisServer | None = None
        self.cluster: RedisCluster | None = None
        self.pg: PgServer | None = None  # the store's PostgreSQL
        self.fx_pg: PgServer | None = None  # the effects' PostgreSQL (Redis runs)
        self.etcd: Any = None  # tests.servers.etcd.EtcdCluster
        self.etcd_proxies: list[Any] = []
        #: (member, until) of the one paused etcd member
        self.member_paused: tuple[int, float] | None = None
        self.etcd_faults: Counter[str] = Counter()
        self.store_url = ""
        self.fx_kind = ""
        self.fx_worker_dsn = ""
        self.fx: Fx | None = None  # the supervisor's own view (never through the proxy)
        self.workers: Workers | None = None
        self.outcome = Outcome()

    @property
    def name(self) -> str:
        return f"{self.store}{' (same transaction)' if self.same_tx else ''}"

    # -- servers ------------------------------------------------------------------------

    def start_servers(self) -> None:
        if self.store != "sqlite":
            self.hub = Network()
        if self.store == "sqlite":
            self.store_url = f"sqlite:///{self.root / 'idemlock.db'}"
            self.fx_kind, self.fx_worker_dsn = "sqlite", str(self.root / "effects.db")
            self.fx = SqliteFx(self.fx_worker_dsn, supervisor=True)
            return
        assert self.hub is not None
        hub = self.hub
        if self.store == "etcd":
            from tests.servers.etcd import start_etcd

            self.etcd = start_etcd(3)
            self.etcd_proxies = [hub.add(port) for port in self.etcd.client_ports]
            self.store_url = "etcd://" + ",".join(f"{HOST}:{p.port}" for p in self.etcd_proxies)
            self.fx_kind, self.fx_worker_dsn = "sqlite", str(self.root / "effects.db")
            self.fx = SqliteFx(self.fx_worker_dsn, supervisor=True)
            return
        if self.store == "postgres":
            # Crashed by the restarts: every acknowledged commit must come back.
            self.pg = start_postgres({"synchronous_commit": "on"})
            proxy = hub.add(self.pg.port)
            self.store_url = self.pg.dsn_at(proxy.port)
            self.fx_kind, self.fx_worker_dsn = "postgres", self.store_url
            self.fx = PgFx(self.pg.dsn, supervisor=True)
            return
        if self.store == "redis":
            self.redis = start_redis(self.root / "redis")
            self.store_url = f"redis://{HOST}:{hub.add(self.redis.port).port}/0"
        else:
            self.cluster = start_cluster(
                self.root / "cluster", announce=lambda port: hub.add(port).port
            )
            self.store_url = self.cluster.url
        self.fx_pg = start_postgres()
        self.fx_kind, self.fx_worker_dsn = "postgres", self.fx_pg.dsn
        self.fx = PgFx(self.fx_pg.dsn, supervisor=True)

    def restart_store(self) -> str:
        if self.etcd is not None:
            return self.etcd_member_fault()
        if self.redis is not None:
            self.redis.restart()
            return "redis-server restarted empty"
        if self.cluster is not None:
            node = self.rng.choice(self.cluster.nodes)
            node.restart()
            return f"cluster node :{node.port} restarted empty"
        assert self.pg is not None
        self.pg.restart("immediate")
        return "postgres crashed and restarted"

    def etcd_member_fault(self) -> str:
        """A SIGKILL of the leader and its restart, or a pause (SIGSTOP) of a member."""
        cluster = self.etcd
        self.wake_member(force=True)  # one member fault at a time: quorum stays
        if self.rng.random() < 0.5:
            i = self.rng.randrange(cluster.size)
            pause = self.opts.lease * self.rng.uniform(0.5, 3.0)
            os.kill(cluster.procs[i].pid, signal.SIGSTOP)
            self.member_paused = (i, time.monotonic() + pause)
            self.etcd_faults["member_pause"] += 1
            return f"etcd member {cluster.names[i]} paused for {pause:.2f}s"
        leader = cluster.leader()
        cluster.kill(leader)
        cluster.start_member(leader)
        cluster.wait_ready()
        self.etcd_faults["leader_kill"] += 1
        return f"etcd leader {cluster.names[leader]} killed and restarted"

    def wake_member(self, force: bool = False) -> None:
        if self.member_paused is None:
            return
        i, until = self.member_paused
        if force or time.monotonic() >= until:
            proc = self.etcd.procs[i]
            if proc is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
            self.member_paused = None

    def heal_store(self) -> None:
        """End every network fault and member pause (the fault window is over)."""
        if self.hub is not None:
            self.hub.heal()
        self.wake_member(force=True)

    def settle(self, seconds: float) -> None:
        """End the faults, let paused workers wake and finish what they were doing
        (their late writes are part of the test), wait ``seconds``; then the workers
        may be ended wherever they are."""
        self.heal_store()
        while any(s.stopped_until is not None for s in self.slots):
            self.wake_due()
            time.sleep(0.01)
        time.sleep(seconds)
        self.reap()

    def stop_servers(self) -> None:
        if self.hub is not None:
            self.hub.close()
        if self.etcd is not None:
            self.etcd.destroy()  # SIGCONTs a paused member, kills all by pid
        for server in (self.redis, self.cluster):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()
        for pg in (self.pg, self.fx_pg):
            if pg is not None:
                pg.destroy()
        if self.fx is not None:
            self.fx.reset()
        shutil.rmtree(self.root, ignore_errors=True)

    # -- workers --------------------------------------------------------------------------

    @property
    def slots(self) -> list[Slot]:
        return self.workers.slots if self.workers is not None else []

    def config(self, slot: Slot) -> dict[str, Any]:
        cfg = WorkerConfig(
            worker=slot.worker,
            mode=self.mode,
            same_tx=self.same_tx,
            store_url=self.store_url,
            fx_kind=self.fx_kind,
            fx_dsn=self.fx_worker_dsn,
            lease=self.opts.lease,
            visibility=self.opts.visibility,
            seed=self.opts.seed,
            stats=str(self.root / "stats" / f"{slot.worker}.txt"),
            workload=self.workload,
            resources=self.opts.resources,
            state=str(self.root / "stats" / f"{slot.worker}.state"),
        )
        return asdict(cfg)

    def start_workers(self) -> Workers:
        (self.root / "stats").mkdir()
        self.workers = Workers(
            context(PRELOAD), _worker_entry, self.config, self.root / "logs", self.opts.workers
        )
        self.workers.start()
        return self.workers

    def candidates(self) -> list[Slot]:
        """Live, running workers that hold a job (a fault on an idle worker tests
        nothing; the fault waits for a busy one). If the queue cannot be read (its
        database is restarting), any live worker."""
        assert self.fx is not None and self.workers is not None
        live = self.workers.live()
        try:
            busy = self.fx.busy()
        except FxError:
            return live
        return [s for s in live if s.worker in busy]

    # -- faults ---------------------------------------------------------------------------

    def inject(self, kind: str) -> bool:
        """Inject one fault of ``kind``; False if there was nothing to do it to."""
        now = time.monotonic()
        detail = ""
        if kind in ("kill", "stop"):
            pool = self.candidates()
            if kind == "stop":
                stopped = sum(1 for s in self.slots if s.stopped_until is not None)
                if stopped >= len(self.slots) - 1:
                    return False
            if not pool:
                return False
            slot = self.rng.choice(pool)
            assert self.workers is not None
            if kind == "kill":
                self.workers.kill_and_replace(slot, self.redeliver)
                detail = slot.worker
            else:
                pause = self.opts.lease * self.rng.uniform(1.3, 2.5)
                self.workers.stop(slot, pause)
                # (woken by a poll every few ms: a little later than planned)
                self.outcome.stops.append((slot.worker, now, now + pause + 0.1))
                detail = f"{slot.worker} for {pause:.2f}s"
        elif kind == "restart":
            detail = self.restart_store()
        elif kind == "cut":
            assert self.hub is not None
            only = None
            if self.etcd is not None and self.rng.random() < 0.5:
                only = self.rng.choice(self.etcd_proxies)  # one member's connections
            cut = self.hub.cut(only)
            if not cut:
                return False  # nothing connected (e.g. during a blackhole): not a fault
            detail = f"{cut} connections"
        elif kind == "blackhole":
            assert self.hub is not None
            # Half of them silence everything (a partition of the store), half a random
            # half of the open connections (one path dies; others and new ones work).
            share = 1.0 if self.rng.random() < 0.5 else 0.5
            seconds = self.opts.lease * self.rng.uniform(0.5, 4.0)
            only = None
            if self.etcd is not None and share < 1:
                # etcd: one member cut off (of those the clients use)
                used = [p for p in self.etcd_proxies if p.connections()]
                only = self.rng.choice(used) if used else None
            detail = self.hub.blackhole(seconds, share, self.rng, only)
            if not detail:
                return False
        self.outcome.faults[kind] += 1
        if self.opts.verbose:
            took = time.monotonic() - now
            self.say(f"  {time.time():.3f} {kind}: {detail} ({took:.3f}s)")
        return True

    def next_fault(self, order: list[str], restarts: bool = True) -> float:
        """Inject the next fault of a shuffled round of every kind; when the one after."""
        if not order:
            order += self.kinds
            self.rng.shuffle(order)
        if order[0] == "restart" and not restarts:
            order.pop(0)  # skipped, not counted: the next kind goes next tick
            gap = 0.0
        elif self.inject(order[0]):
            order.pop(0)
            gap = self.rng.expovariate(1 / self.opts.fault_every)
        elif order[0] in NETWORK_KINDS:
            order.pop(0)  # nothing connected (plain mode never uses Redis): skipped
            gap = 0.0
        else:
            gap = 0.01  # nobody to do it to yet (or no lock held): try again shortly
        return time.monotonic() + gap

    def redeliver(self, worker: str) -> None:
        assert self.fx is not None
        # As a broker does when the consumer's connection drops.
        with contextlib.suppress(FxError):
            self.fx.release(worker)

    def wake_due(self, force: bool = False) -> None:
        self.wake_member(force)
        if self.workers is not None:
            self.workers.wake_due(force)

    def reap(self) -> None:
        """A worker that exited without being killed by us: note it, replace it."""
        for slot in self.slots:
            code = slot.proc.exitcode
            if code is None:
                continue
            tail = slot.log.read_text(errors="replace")[-2000:] if slot.log else ""
            self.outcome.worker_exits.append(f"{slot.worker} exited with {code}: {tail}")
            assert self.workers is not None
            self.workers.spawn(slot)

    def undone(self) -> int | None:
        assert self.fx is not None
        try:
            return self.fx.undone()
        except FxError:
            return None

    def drive(self) -> None:
        opts = self.opts
        assert self.fx is not None
        t0 = time.time() + 0.5
        visible = [t0 + opts.duration * i / opts.jobs for i in range(opts.jobs)]
        self.fx.create(visible)
        if self.mode == "idemlock":
            import idemlock

            # Create the store's schema once, before the workers race to.
            with idemlock.connect(self.store_url, **store_options(self.store_url)) as coord:
                coord.keys()
        workers = self.start_workers()
        start = time.monotonic()
        faults_until = start + 0.5 + opts.duration
        # A restart of Redis deletes every record: they stop for the last quarter of
        # the window, so the keys completed after the last one can be replay-checked.
        lossy_until = start + 0.5 + opts.duration * (0.75 if self.store in LOSSY else 1.0)
        deadline = faults_until + 60 + 10 * opts.lease
        order: list[str] = []
        next_fault = start + 0.5 + self.rng.expovariate(1 / opts.fault_every)
        next_check = start
        try:
            while True:
                now = time.monotonic()
                self.wake_due()
                self.reap()
                if self.kinds and now >= next_fault and now < faults_until:
                    next_fault = self.next_fault(order, restarts=now < lossy_until)
                if now >= next_check and now >= faults_until:
                    next_check = now + 0.2
                    if self.undone() == 0:
                        self.outcome.drained = True
                        break
                if now > deadline:
                    break
                time.sleep(0.005)
            self.outcome.seconds = time.monotonic() - start
            self.settle(0.5)
        finally:
            self.wake_member(force=True)
            workers.close()

    # -- checks ---------------------------------------------------------------------------

    def check(self) -> dict[str, Any]:
        snap = self.snapshot(self.fx.snapshot if self.fx else None)
        found = Findings()
        bad = found.bad
        jobs = {int(j): (state, int(d)) for j, state, d in snap["jobs"]}
        effects = {int(j): (int(f), v) for j, f, v in snap["effects"]}
        accepted: dict[int, list[int]] = {}
        refused = 0
        stale_accepted = 0
        for _id, job, fence, _worker, ok in snap["log"]:
            if not ok:
                refused += 1
                continue
            seen = accepted.setdefault(int(job), [])
            if seen and int(fence) < max(seen):
                stale_accepted += 1
                if self.mode == "idemlock":
                    bad("stale_write_accepted", f"job {job}: fence {fence} after {max(seen)}")
            seen.append(int(fence))
        for job, (state, _) in jobs.items():
            if state != "done":
                bad("job_not_done", f"job {job} is {state}")
            if job not in effects:
                bad("missing_effect", f"job {job} has no effect row")
            elif self.mode == "idemlock" and effects[job][0] != max(accepted.get(job, [0])):
                bad(
                    "effect_not_highest",
                    f"job {job}: row fence {effects[job][0]}, log {accepted.get(job)}",
                )
        runs = {job: len(f) for job, f in accepted.items()}
        repeated = sum(n - 1 for n in runs.values() if n > 1)
        if self.same_tx:
            for job, n in runs.items():
                if n != 1:
                    bad("effect_ran_twice", f"job {job}: {n} accepted effects")
        lost = 0
        if self.mode == "idemlock":
            lost = self.check_store(jobs, effects, bad)
        events = self.worker_problems(found)
        if not self.outcome.drained:
            bad("not_drained", f"jobs still undone after {self.outcome.seconds:.0f}s")
        return {
            "store": self.store,
            "mode": self.mode,
            "same_transaction": self.same_tx,
            "seed": self.opts.seed,
            "jobs": len(jobs),
            "workers": self.opts.workers,
            "seconds": round(self.outcome.seconds, 1),
            "lease_s": self.opts.lease,
            "faults": {k: self.outcome.faults.get(k, 0) for k in KINDS},
            "deliveries": sum(d for _, d in jobs.values()),
            "effects_run": sum(runs.values()),
            "repeated_effects": repeated,
            "jobs_with_repeats": sum(1 for n in runs.values() if n > 1),
            "stale_writes_refused": refused,
            "stale_writes_accepted": stale_accepted,
            "records_lost_with_data": lost,
            **({"etcd_faults": dict(self.etcd_faults)} if self.etcd is not None else {}),
            **self.verdict(found, events),
        }

    def verdict(self, found: Findings, events: Counter[str]) -> dict[str, Any]:
        return {
            "worker_events": dict(sorted(events.items())),
            "violations": dict(found.violations),
            "violations_total": sum(found.violations.values()),
            "examples": found.examples,
        }

    def snapshot(self, read: Callable[[], dict[str, Any]] | None) -> dict[str, Any]:
        """The effects database's data (its PostgreSQL may still be recovering from a
        crash)."""
        assert read is not None
        return retried(read, FxError)

    def worker_problems(self, found: Findings) -> Counter[str]:
        """Workers that crashed and errors they did not expect; their event counts."""
        for text in self.outcome.worker_exits:
            found.bad("worker_crashed", text)
        events: Counter[str] = Counter()
        for path in (self.root / "stats").glob("*.txt"):
            events.update(line for line in path.read_text().splitlines() if line)
        for event, n in events.items():
            if event.startswith("unexpected:"):
                found.bad("unexpected_error", f"{n} x {event[11:]}", n)
        return events

    def check_store(
        self,
        jobs: dict[int, tuple[str, int]],
        effects: dict[int, tuple[int, str]],
        bad: Callable[[str, str], None],
    ) -> int:
        """After a lease: no key claimed; every completed key replays its effect's value
        (the wrapped function is called and must not run)."""
        import idemlock

        time.sleep(self.opts.lease + 0.2)
        lost = 0
        coord = self.connect_checker()
        try:
            spec = idemlock.IdempotencySpec(
                SPEC, ttl=timedelta(hours=2), lease=timedelta(seconds=self.opts.lease)
            )
            port = coord.idempotency(spec)
            records = coord.keys()
            for rec in records:
                if rec.state == "in_flight":
                    bad("left_claimed", f"{rec.key} still in flight after the lease")
            ran: list[int] = []

            def body(job: int) -> str:
                ran.append(job)
                return "ran-in-checker"

            run_job = idempotent_job(coord, self.opts.lease, body)
            for job in jobs:
                status = port.status(job_key(job))
                if status is None:
                    if self.store in LOSSY and self.outcome.faults["restart"]:
                        lost += 1  # the restart deleted it with the rest of the data
                    else:
                        bad("record_missing", f"{job_key(job)} has no record")
                    continue
                if status.state != "completed":
                    bad("left_claimed", f"{job_key(job)} is {status.state}")
                    continue
                got = run_job(job)
                if ran:
                    ran.clear()
                    bad("replay_ran", f"{job_key(job)} ran again instead of replaying")
                elif job in effects and got != effects[job][1]:
                    bad("replay_differs", f"{job_key(job)}: {got!r} != {effects[job][1]!r}")
        finally:
            coord.close()
        return lost

    def connect_checker(self) -> Any:
        import idemlock

        def connect() -> Any:
            coord = idemlock.connect(self.store_url, **store_options(self.store_url))
            coord.keys()
            return coord

        return retried(connect, idemlock.StoreUnavailable)

    def execute(self) -> dict[str, Any]:
        try:
            self.say(f"{self.name}, {self.mode}: starting servers in {self.root}")
            self.start_servers()
            what = (
                f"locks on {self.opts.resources} resources (ttl {self.opts.lease:g}s)"
                if self.workload == "lock"
                else f"{self.opts.jobs} jobs"
            )
            self.say(
                f"{self.name}, {self.workload}, {self.mode}: {what} over "
                f"{self.opts.duration:g}s, {self.opts.workers} workers, faults "
                f"{'/'.join(self.kinds)} every ~{self.opts.fault_every:g}s"
            )
            self.drive()
            report = self.check()
        finally:
            self.stop_servers()
        return report


def retried(fn: Callable[[], Any], errors: type[BaseException], seconds: float = 30) -> Any:
    """``fn()``, tried again every 0.2 s for ``seconds`` while it raises ``errors``."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            return fn()
        except errors:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
