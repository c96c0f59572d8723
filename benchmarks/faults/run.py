"""One run of one store, mode and workload: servers, workers, faults, drain, checks."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from common import Servers

from faults import GATED, HOST, KINDS, LOCK_KINDS, LOSSY, STORE_KINDS, Findings, retried
from faults.effects import LOCK_SNAPSHOTS, STEP_SNAPSHOTS, Fx, FxError
from faults.locks import check_lock_history, check_permit_history
from faults.network import Network
from faults.worker import ONCE, PRELOAD, STEPS, connect, idempotent_jobs, job_key, worker_entry
from idemlock.cli._faults.workers import Slot, Workers, context

#: seconds the faults may go on past the window until every kind has landed (drive())
EXTRA = 30.0


def exited(slot: Slot) -> str:
    """The end of an exited worker's log, and how it exited (one that exited before it
    opened its log: how)."""
    if slot.log is not None and slot.log.exists():
        return slot.tail(40)
    return f"worker {slot.worker} exited with status {slot.proc.exitcode} before opening its log"


class Run:
    """The job workload on one store, in one mode: start, inject, drain, check."""

    workload = "jobs"
    applies = STORE_KINDS  # the faults that apply, by store
    what = "{jobs} jobs"  # of the options

    def __init__(self, store: str, mode: str, same_tx: bool, opts: Any, say: Any) -> None:
        self.store, self.mode, self.same_tx, self.opts, self.say = store, mode, same_tx, opts, say
        self.kinds = self.applies[store]
        self.rng = random.Random(f"{opts.seed}:{store}:{mode}:{same_tx}:{self.workload}:faults")
        self.servers = Servers(f"idemlock-chaos-{store}-")  # and their directory
        self.root = self.servers.tmp
        self.stats = self.root / "stats"
        self.hub = Network()
        self.fx: Any = None  # the effects database (Fx), once started
        self.server: Any = None  # the store's
        self.etcd: Any = None  # tests.servers.etcd.EtcdCluster
        self.proxies: list[Any] = []  # etcd's, one per member
        self.paused: tuple[Any, float] | None = None  # the paused etcd member, until
        self.etcd_faults: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self.stops: list[tuple[str, float, float]] = []  # (worker, from, until) of SIGSTOPs
        self.restarts: list[float] = []  # when each store restart began (time.time())
        self.exits: list[str] = []
        self.seconds = 0.0
        self.drained = False
        logs = self.root / "logs"
        self.workers = Workers(context(PRELOAD), worker_entry, self.config, logs, opts.workers)

    # -- servers ------------------------------------------------------------------------

    def start_servers(self) -> None:
        """The store behind proxies, and the effects database: the workers' SQLite file,
        or a PostgreSQL the supervisor reads directly (the workers reach the store's own
        PostgreSQL through the proxy)."""
        hub, store = self.hub, self.store
        pg_store = store == "postgres"
        fx = ("sqlite", str(self.root / "effects.db"))
        if store == "sqlite":
            self.store_url = f"sqlite:///{self.root / 'idemlock.db'}"
        elif store == "etcd":
            self.etcd = self.server = self.servers.start("etcd", 3)
            self.proxies = [hub.add(port) for port in self.etcd.client_ports]
            self.store_url = "etcd://" + ",".join(f"{HOST}:{p.port}" for p in self.proxies)
        else:
            if store == "redis":
                self.server = self.servers.start("redis")
                self.store_url = f"redis://{HOST}:{hub.add(self.server.port).port}/0"
            elif store == "redis-cluster":
                announce = lambda port: hub.add(port).port  # noqa: E731
                self.server = self.servers.start("redis-cluster", announce=announce)
                self.store_url = self.server.url
            elif store == "redis-sentinel":
                # A primary, a replica, three Sentinels; every write waits for the replica.
                self.server = self.servers.start("redis-sentinel")
                self.store_url = self.server.url("durability=replicas:1")
            # As the store it is crashed by the restarts: every acknowledged commit must
            # come back.
            pg = self.servers.start("postgres", {"synchronous_commit": "on"} if pg_store else None)
            self.server = self.server or pg
            if pg_store:
                self.store_url = pg.dsn_at(hub.add(pg.port).port)
            fx = ("postgres", pg.dsn)
        self.fx = Fx(*fx, supervisor=True)
        self.fx_worker = (fx[0], self.store_url if pg_store else fx[1])

    def restart_store(self) -> None:
        """Redis restarts empty (a Cluster: one node), PostgreSQL crashes; etcd: a SIGKILL
        of the leader and its restart, or a pause (SIGSTOP) of a member (one at a time:
        quorum stays)."""
        server, cluster = self.server, self.etcd
        self.wake_member(force=True)
        if self.store == "redis-cluster":
            self.rng.choice(server.nodes).restart()
        elif self.store == "redis-sentinel":
            # A failover: the primary SIGKILLed, the replica promoted, the old primary
            # back (empty) as the new one's replica, so replicas:1 can be met again.
            old = server.kill_primary()
            server.wait_failover(old)
            server.rejoin(old)
        elif cluster is None:
            server.restart(*(("immediate",) if self.store == "postgres" else ()))
        elif self.rng.random() < 0.5:
            proc = cluster.procs[self.rng.randrange(cluster.size)]
            os.kill(proc.pid, signal.SIGSTOP)
            self.paused = (proc, time.monotonic() + self.opts.lease * self.rng.uniform(0.5, 3.0))
            self.etcd_faults["member_pause"] += 1
        else:
            leader = cluster.leader()
            cluster.kill(leader)
            cluster.start_member(leader)
            cluster.wait_ready()
            self.etcd_faults["leader_kill"] += 1

    def wake_member(self, force: bool = False) -> None:
        if self.paused is not None and (force or time.monotonic() >= self.paused[1]):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.paused[0].pid, signal.SIGCONT)
            self.paused = None

    # -- workers and faults -------------------------------------------------------------

    def config(self, slot: Slot) -> dict[str, Any]:
        """A worker's: the options (lease, visibility, seed, resources), and this run's."""
        return vars(self.opts) | {
            "worker": slot.worker,
            "mode": self.mode,
            "same_tx": self.same_tx,
            "workload": self.workload,
            "store_url": self.store_url,
            "fx": self.fx_worker,
            # its files: .txt its events, one a line; the lock workload's .state a byte,
            # 1 while in hold(), and .lost when on_lost ran
            "stats": str(self.stats / slot.worker),
        }

    def candidates(self) -> list[Slot]:
        """Live, running workers that hold a job (a fault on an idle worker tests
        nothing); any live one while the queue cannot be read (its database restarts)."""
        live = self.workers.live()
        try:
            busy = self.fx.busy()
        except FxError:
            return live
        return [s for s in live if s.worker in busy]

    def redeliver(self, worker: str) -> None:
        # As a broker does when the consumer's connection drops.
        with contextlib.suppress(FxError):
            self.fx.release(worker)

    def inject(self, kind: str) -> bool:
        """Inject one fault of ``kind``; False if there was nothing to do it to."""
        slots = self.workers.slots
        if kind in ("kill", "stop"):
            pool = self.candidates()
            stopped = sum(1 for s in slots if s.stopped_until is not None)
            if not pool or (kind == "stop" and stopped >= len(slots) - 1):
                return False
            slot = self.rng.choice(pool)
            if kind == "kill":
                self.workers.kill_and_replace(slot, self.redeliver)
                return True
            pause = self.opts.lease * self.rng.uniform(1.3, 2.5)
            self.workers.stop(slot, pause)
            now = time.monotonic()  # (woken by a poll every few ms: a little later)
            self.stops.append((slot.worker, now, now + pause + 0.1))
        elif kind == "restart":
            self.restarts.append(time.time())
            self.restart_store()
        elif kind == "cut":
            # etcd: half of them cut one member's connections; none connected (e.g.
            # during a blackhole): no fault
            etcd = self.etcd is not None and self.rng.random() < 0.5
            return self.hub.cut(self.rng.choice(self.proxies) if etcd else None) > 0
        else:
            # Half of them silence everything (a partition of the store), half a random
            # half of the open connections (one path dies; others and new ones work;
            # etcd: one member cut off, of those the clients use).
            share = 1.0 if self.rng.random() < 0.5 else 0.5
            seconds = self.opts.lease * self.rng.uniform(0.5, 4.0)
            used = [p for p in self.proxies if p.connections()] if share < 1 else []
            only = self.rng.choice(used) if used else None
            return self.hub.blackhole(seconds, share, self.rng, only)
        return True

    def next_fault(self, order: list[str], restarts: bool) -> float:
        """Inject the next fault of a shuffled round of every kind; when the one after."""
        if not order:
            order += self.kinds
            self.rng.shuffle(order)
        kind, now = order[0], time.monotonic()
        if kind == "restart" and not restarts:
            order.pop(0)  # skipped, not counted: the next kind goes next tick
            return now
        if not self.inject(kind):
            if kind in ("cut", "blackhole"):
                order.pop(0)  # nothing connected (plain mode never uses Redis): skipped
                return now
            return now + 0.01  # nobody to do it to yet (or no lock held): again shortly
        order.pop(0)
        self.faults[kind] += 1
        return time.monotonic() + self.rng.expovariate(1 / self.opts.fault_every)

    def drive(self, prepare: Callable[[Any], Any], done: Callable[[], bool], tail: float) -> None:
        """Faults for ``--duration``, until ``done()`` (at most a minute more); then the
        faults end, paused workers wake and finish what they were doing (their late
        writes are part of the test), and after ``tail`` seconds the workers end. A
        worker that exits without being killed by us is noted and replaced."""
        opts, workers = self.opts, self.workers
        if self.mode == "idemlock":
            # Create the store's schema once, before the workers race to.
            with connect(self.store_url) as coord:
                prepare(coord)
        self.stats.mkdir()
        workers.start()
        start = time.monotonic()
        faults_until = start + 0.5 + opts.duration
        # A restart of Redis deletes every record: they stop for the last quarter of
        # the window, so the keys completed after the last one can be replay-checked.
        restarts_until = start + 0.5 + opts.duration * (0.75 if self.store in LOSSY else 1.0)
        # A slow machine (workers slow to start and to take locks, nothing connected
        # when a cut comes) may let a kind of fault never land in the window: the faults
        # go on, at most EXTRA seconds more, until every kind that applies has landed, so
        # that no run passes without the faults it is about.
        extra_until = faults_until + EXTRA
        deadline = extra_until + 60 + 10 * opts.lease
        order: list[str] = []
        next_fault = start + 0.5 + self.rng.expovariate(1 / opts.fault_every)
        next_check = start
        needed = self.kinds if self.mode == "idemlock" else ("kill", "stop")
        # ``--until-faults N``: the window ends as soon as every kind has landed N times
        # and the run shows what it is about (enough()), at the latest as above
        until = int(getattr(opts, "until_faults", 0) or 0)
        times = max(1, until)

        asked, seen = 0.0, False  # the history is read at most twice a second

        def shown(now: float) -> bool:
            nonlocal asked, seen
            if not seen and now - asked >= 0.5:
                asked, seen = now, self.enough() if until else self.shown()
            return seen

        def injecting(now: float) -> bool:
            lacking = any(self.faults[k] < times for k in needed)
            if now < faults_until:
                return not until or lacking or not shown(now)
            return now < extra_until and (lacking or not shown(now))

        def tick() -> None:
            self.wake_member()
            workers.wake_due()
            for slot in workers.slots:
                if slot.proc.exitcode is not None:
                    self.exits.append(exited(slot))
                    workers.spawn(slot)

        try:
            window = True  # once over, over: the faults only ever add up
            while (now := time.monotonic()) < deadline:
                tick()
                if window and not injecting(now):
                    window = False
                    if until:
                        self.say(f"faults over after {now - start:.1f}s: {dict(self.faults)}")
                        self.window_over()
                if window and next_fault <= now:
                    late = now >= faults_until and self.faults["restart"] == 0
                    next_fault = self.next_fault(order, restarts=now < restarts_until or late)
                if not window and now >= next_check:
                    next_check = now + 0.2
                    if done():
                        self.drained = True
                        break
                time.sleep(0.005)
            self.seconds = time.monotonic() - start
            self.hub.heal()
            self.wake_member(force=True)
            while any(s.stopped_until is not None for s in workers.slots):
                tick()
                time.sleep(0.01)
            time.sleep(tail)
            tick()
        finally:
            self.wake_member(force=True)
            workers.close()

    def shown(self) -> bool:
        """Whether the history so far shows what the run is about (asked after the
        window, while faults may go on for EXTRA seconds more): always, but for a
        negative control."""
        return True

    def enough(self) -> bool:
        """``--until-faults``: whether the run has done enough to end its window (as
        soon as every kind of fault has landed): plain mode, a job whose effect ran
        twice (what the negative control shows); else a job done."""
        try:
            snap = self.fx.snapshot()
        except FxError:
            return False
        if self.mode == "plain":
            ran = Counter(int(job) for _id, job, _f, _w, ok in snap["log"] if ok)
            return any(n > 1 for n in ran.values())
        return any(state == "done" for _j, state, _d in snap["jobs"])

    def window_over(self) -> None:
        """The faults have ended: the jobs not yet released are, all at once (a window
        that ended early)."""
        with contextlib.suppress(FxError):
            retried(self.fx.release_all, FxError, 10)

    # -- the workload -------------------------------------------------------------------

    def run(self) -> None:
        opts = self.opts
        t0 = time.time() + 0.5
        self.fx.create([t0 + opts.duration * i / opts.jobs for i in range(opts.jobs)])

        def done() -> bool:
            with contextlib.suppress(FxError):
                return self.fx.undone() == 0
            return False

        self.drive(lambda coord: coord.keys(), done, 0.5)

    def check(self) -> dict[str, Any]:
        snap = retried(self.fx.snapshot, FxError)  # its PostgreSQL may be recovering
        found = Findings()
        bad = found.bad
        jobs = {int(j): (state, int(d)) for j, state, d in snap["jobs"]}
        effects = {int(j): (int(f), v) for j, f, v in snap["effects"]}
        accepted: dict[int, list[int]] = {}
        refused = stale_accepted = 0
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
                bad("effect_not_highest", f"job {job}: row {effects[job][0]}, {accepted.get(job)}")
        runs = {job: len(f) for job, f in accepted.items()}
        for job, n in runs.items() if self.same_tx else ():
            if n != 1:
                bad("effect_ran_twice", f"job {job}: {n} accepted effects")
        lost = self.check_store(jobs, effects, bad) if self.mode == "idemlock" else 0
        if not self.drained:
            bad("not_drained", f"jobs still undone after {self.seconds:.0f}s")
        return self.report(
            found,
            jobs=len(jobs),
            lease_s=self.opts.lease,
            deliveries=sum(d for _, d in jobs.values()),
            effects_run=sum(runs.values()),
            repeated_effects=sum(n - 1 for n in runs.values()),
            jobs_with_repeats=sum(1 for n in runs.values() if n > 1),
            stale_writes_refused=refused,
            stale_writes_accepted=stale_accepted,
            records_lost_with_data=lost,
        )

    def check_store(
        self, jobs: dict[int, Any], effects: dict[int, Any], bad: Callable[[str, str], None]
    ) -> int:
        """After a lease: no key claimed; every completed key replays its effect's value
        (the wrapped function is called and must not run). The records a restart of
        Redis deleted are counted, not judged."""
        import idemlock

        time.sleep(self.opts.lease + 0.2)
        if self.store == "redis-sentinel":
            # replicas:1 needs the replica the last failover gave back in sync again
            self.server.wait_in_sync()

        def connected() -> Any:
            coord = connect(self.store_url)
            coord.keys()
            return coord

        lost = 0
        ran: list[int] = []
        with retried(connected, idemlock.StoreUnavailable) as coord:
            port, run_job = idempotent_jobs(
                coord, self.opts.lease, lambda job: ran.append(job) or ""
            )
            for rec in coord.keys():  # noqa: SIM118 (a Coordinator, not a dict)
                if rec.state == "in_flight":
                    bad("left_claimed", f"{rec.key} still in flight after the lease")
            for job in jobs:
                status = port.status(job_key(job))
                if status is None and self.store in LOSSY and self.faults["restart"]:
                    lost += 1
                elif status is None:
                    bad("record_missing", f"{job_key(job)} has no record")
                elif status.state != "completed":
                    bad("left_claimed", f"{job_key(job)} is {status.state}")
                elif (got := run_job(job)) == "" and ran:
                    ran.clear()
                    bad("replay_ran", f"{job_key(job)} ran again instead of replaying")
                elif why := self.differs(job, got, effects):
                    bad("replay_differs", f"{job_key(job)}: {why}")
        return lost

    def differs(self, job: int, got: str, effects: dict[int, Any]) -> str:
        """How the replayed ``got`` differs from what the effect rows say ("" if not)."""
        if job in effects and got != effects[job][1]:
            return f"{got!r} != {effects[job][1]!r}"
        return ""

    def report(self, found: Findings, **figures: Any) -> dict[str, Any]:
        """The run's report: ``figures``, the faults, the workers' event counts and the
        violations (with workers that crashed or met errors they did not expect)."""
        for text in self.exits:
            found.bad("worker_crashed", text)
        events: Counter[str] = Counter()
        for path in self.stats.glob("*.txt"):
            events.update(line for line in path.read_text().splitlines() if line)
        for event, n in events.items():
            if event.startswith("unexpected:"):
                found.bad("unexpected_error", f"{n} x {event[11:]}", n)
        return {
            "store": self.store,
            "mode": self.mode,
            "same_transaction": self.same_tx,
            "seed": self.opts.seed,
            "workers": self.opts.workers,
            "seconds": round(self.seconds, 1),
            "faults": {k: self.faults[k] for k in KINDS},
            **figures,
            **({"etcd_faults": dict(self.etcd_faults)} if self.etcd is not None else {}),
            "worker_events": dict(sorted(events.items())),
            "violations": dict(found.violations),
            "violations_total": sum(found.violations.values()),
            "examples": found.examples,
        }

    def execute(self) -> dict[str, Any]:
        name = f"{self.store}{' (same transaction)' if self.same_tx else ''}"
        opts = self.opts
        try:
            self.say(f"{name}, {self.mode}: starting servers in {self.root}")
            self.start_servers()
            self.say(
                f"{name}, {self.workload}, {self.mode}: {self.what.format_map(vars(opts))} over "
                f"{opts.duration:g}s, {opts.workers} workers, faults {'/'.join(self.kinds)} "
                f"every ~{opts.fault_every:g}s"
            )
            self.run()
            return self.check()
        finally:
            self.hub.close()
            with contextlib.suppress(Exception):  # etcd's SIGCONTs a paused member, kills by pid
                self.servers.close()
            if self.fx is not None:
                self.fx.reset()


class LockRun(Run):
    """Workers contend for ``--resources`` locks with ``hold()`` (ttl ``--lease``,
    renewed every ttl/3) and write fenced records under them while faults hit; then
    the history is checked (``check_lock_history``)."""

    workload = "lock"
    applies = LOCK_KINDS
    what = "locks on {resources} resources (ttl {lease:g}s)"

    def candidates(self) -> list[Slot]:
        """Live, running workers inside ``hold()`` (a fault on a waiting one tests little)."""
        paths = [(s, self.stats / f"{s.worker}.state") for s in self.workers.live()]
        return [s for s, path in paths if path.exists() and path.read_bytes() == b"1"]

    def redeliver(self, worker: str) -> None:
        pass  # its lease runs out on its own: that is what is being tested

    def run(self) -> None:
        self.fx.create([])
        # late writes of paused holders, after the faults: fenced out
        self.drive(lambda coord: coord.locks(), lambda: True, 1.0 + self.opts.lease)

    #: what the checker reports that only the fence prevents: in plain mode (no fence)
    #: what the run shows, not failures of it
    unfenced = ("stale_write_accepted", "writes_interleaved")
    #: what the negative control must show before its faults end
    shows = unfenced

    def history(self, snap: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """The checker's findings on the history, and the fence the writes went through."""
        exact = self.store not in GATED or self.mode == "plain"
        found = check_lock_history(snap["holds"], snap["log"], exact=exact)
        gate = "set_if_fresh" if self.store.startswith("redis") else "check_and_advance"
        return found, "none" if self.mode == "plain" else "sql" if exact else gate

    def shown(self) -> bool:
        """Plain mode, the negative control: a paused holder's late write landed over a
        newer holder's. A busy machine can leave the window without one (few pauses
        land mid-write): the faults go on until one does."""
        if self.mode != "plain":
            return True
        try:
            snap = self.fx.snapshot(LOCK_SNAPSHOTS)
        except FxError:
            return False
        found = self.history(snap)[0]["violations"]
        return sum(found[kind] for kind in self.shows) > 0

    def enough(self) -> bool:
        """``--until-faults``: plain mode, what ``shown()`` asks; else leases changed
        hands and were written under, and the faults reached the holders: leases lost
        (their holders told by on_lost) or blocks ended by a store failure (PostgreSQL's
        crashes and cuts end most of its holds that way); the permits' keys full (the
        limit reached)."""
        if self.mode == "plain":
            return self.shown()
        try:
            snap = self.fx.snapshot(LOCK_SNAPSHOTS)
        except FxError:
            return False
        found = self.history(snap)[0]
        events: Counter[str] = Counter()
        for path in self.stats.glob("*.txt"):
            events.update(path.read_text().splitlines())
        hit = events["lock_lost"] + events["store_error"] + events["fx_error"]
        told = any(path.stat().st_size for path in self.stats.glob("*.lost"))
        lost = self.store == "postgres" or (events["lock_lost"] > 0 and told)
        full = self.workload != "permits" or found["most_holders_interleaved"] >= self.opts.limit
        return len(snap["holds"]) > 3 and found["writes_accepted"] > 0 and hit > 0 and lost and full

    def check(self) -> dict[str, Any]:
        snap = retried(lambda: self.fx.snapshot(LOCK_SNAPSHOTS), FxError)
        found, fence = self.history(snap)
        judged = Findings(found.pop("violations"), found.pop("examples"))
        unfenced: dict[str, int] = {}
        if self.mode == "plain":
            # Without the fence these are what the run shows, not failures of it.
            for kind in self.unfenced:
                unfenced[kind] = judged.violations.pop(kind, 0)
            judged.examples = [e for e in judged.examples if e.split(":")[0] not in unfenced]
        # How long after the lease's deadline (counted from the renewal's send; or from
        # when hold() returned a lease already past it) on_lost ran, apart for holders
        # paused meanwhile (a SIGSTOPped holder is told only when it runs again).
        late: dict[bool, list[float]] = {False: [], True: []}
        for path in self.stats.glob("*.lost"):
            stops = [(t0, t1) for w, t0, t1 in self.stops if w == path.stem]
            for line in path.read_text().splitlines():
                deadline, told = map(float, line.split())
                late[any(t0 < told and t1 > deadline for t0, t1 in stops)].append(told - deadline)
        running, paused = sorted(late[False]), sorted(late[True])
        report = self.report(
            judged,
            workload=self.workload,
            resources=self.opts.resources,
            ttl_s=self.opts.lease,
            fence=fence,
            unfenced_findings=unfenced,
            **found,
            on_lost_calls=len(running) + len(paused),
            on_lost_late_s={
                "count": len(running),
                "median": round(running[len(running) // 2], 3) if running else None,
                "max": round(running[-1], 3) if running else None,
            },
            on_lost_late_paused_s={
                "count": len(paused),
                "max": round(paused[-1], 3) if paused else None,
            },
        )
        return report | {"leases_lost": report["worker_events"].get("lock_lost", 0)}


class PermitRun(LockRun):
    """The permits workload: workers contend for ``--limit`` permits of each of
    ``--resources`` keys with a semaphore's ``hold()`` and write under them through a
    counted fence (``Fx.write_counted``); the history is checked by
    ``check_permit_history``: never more than ``limit`` holders' writes interleaved, no
    token reused, tokens increasing as granted."""

    workload = "permits"
    what = "{limit} permits on each of {resources} keys (ttl {lease:g}s)"
    unfenced = shows = ("too_many_holders",)

    def history(self, snap: dict[str, Any]) -> tuple[dict[str, Any], str]:
        found = check_permit_history(snap["holds"], snap["log"], self.opts.limit)
        return found | {"limit": self.opts.limit}, "none" if self.mode == "plain" else "counted"


class ElectionRun(LockRun):
    """The election workload: workers ``campaign()`` for the leadership of
    ``--resources`` keys and, while they lead, write fenced records with the term's
    number, as the lock workload's holders do; the same checker: no two leaders'
    writes interleave, terms strictly increase, none is reused, no stale write lands."""

    workload = "election"
    what = "terms of {resources} keys (ttl {lease:g}s)"


class StepsRun(Run):
    """The steps workload: each job runs three steps (``STEPS``), each an effect with its
    own fenced row and a log of every execution, the ``ONCE`` one with ``once=True``.
    From the data: no step that an attempt finished (recorded) ever runs again; only
    the step in flight at a fault may (and the ``once=True`` one never: found
    interrupted, it is reported and settled)."""

    workload = "steps"
    what = "{jobs} jobs of " + str(len(STEPS)) + " steps"

    def lost_between(self, t0: float, t1: float) -> bool:
        """Whether a store restart that loses records began between ``t0`` and ``t1``
        (a step it forgot runs again: the injected data loss, counted apart)."""
        return self.store in LOSSY and any(t0 < r < t1 for r in self.restarts)

    #: what only idemlock's step records prevent: in plain mode (the steps called
    #: directly, the delivery number as the fence) what the run shows, not failures of it
    unguarded = ("finished_step_ran_again", "once_step_repeated")

    def enough(self) -> bool:
        """``--until-faults``: a job done; plain mode: a finished step run again."""
        if self.mode != "plain":
            return super().enough()
        try:
            snap = self.fx.snapshot(STEP_SNAPSHOTS)
        except FxError:
            return False
        found = self.judge(snap)[0].violations
        return sum(found[kind] for kind in self.unguarded) > 0

    def check(self) -> dict[str, Any]:
        snap = retried(lambda: self.fx.snapshot(STEP_SNAPSHOTS), FxError)
        found, figures, effects = self.judge(snap)
        jobs = {int(j): (state, int(d)) for j, state, d in snap["jobs"]}
        shown: dict[str, int] = {}
        if self.mode == "plain":  # no records and no fence: what the run shows
            for kind in (*self.unguarded, "stale_write_accepted"):
                shown[kind] = found.violations.pop(kind, 0)
            found.examples = [e for e in found.examples if e.split(":")[0] not in shown]
        lost = self.check_store(jobs, effects, found.bad) if self.mode == "idemlock" else 0
        if not self.drained:
            found.bad("not_drained", f"jobs still undone after {self.seconds:.0f}s")
        return self.report(found, **figures, unguarded_findings=shown, records_lost_with_data=lost)

    def judge(self, snap: dict[str, Any]) -> tuple[Findings, dict[str, Any], dict[int, Any]]:
        """The findings on the steps' history, the figures, and each job's step values
        as their rows hold them (what a replay must return)."""
        found, figures, effects = check_steps_history(snap, self.lost_between)
        return found, {"workload": self.workload, "lease_s": self.opts.lease} | figures, effects

    def differs(self, job: int, got: str, effects: dict[int, Any]) -> str:
        """The replay is the steps' values as their rows hold them (a once=True step
        found interrupted: as it was settled, its row's value if it had one)."""
        want = effects[job][1]
        parts = got.split("|")
        same = len(parts) == len(want) and all(
            p == w or (n == ONCE and p.startswith("interrupted/"))
            for p, w, n in zip(parts, want, STEPS, strict=True)
        )
        return "" if same else f"{got!r} != {want!r}"


def check_steps_history(
    snap: dict[str, Any], lost_between: Callable[[float, float], bool]
) -> tuple[Findings, dict[str, Any], dict[int, Any]]:
    """The steps workload's checker, on its tables (``STEP_SNAPSHOTS``): the findings,
    the figures, and each job's step values as their rows hold them (what a replay
    must return). A step an attempt finished (it saw the step return after running it,
    or went on to a later step, which it reaches only once the step was recorded) that
    runs again with a higher fence is a violation, and so is a second execution of the
    ``once=True`` step, unless ``lost_between(job's first row, the rerun)`` (a store
    restart that forgot records): those are counted apart. A step repeated otherwise
    was in flight at a fault, not recorded: counted, not judged."""
    found = Findings()
    bad = found.bad
    jobs = {int(j): (state, int(d)) for j, state, d in snap["jobs"]}
    rows = {str(k): (int(f), str(v)) for k, f, v in snap["effects"]}
    order = {name: i for i, name in enumerate(STEPS)}
    runs: dict[tuple[int, str], list[tuple[int, bool, float]]] = {}  # (fence, ok, t)
    # the fences that finished each (job, step): they saw it return after running it,
    # or went on to a later step (which they reach only once it was recorded)
    finished: dict[tuple[int, str], dict[int, float]] = {}
    interrupted: set[int] = set()
    first: dict[int, float] = {}  # each job's first row
    interruptions = 0
    for _id, job, name, kind, fence, _worker, ok, t in snap["log"]:
        job, fence, t = int(job), int(fence), float(t)
        first.setdefault(job, t)
        if kind == "run":
            runs.setdefault((job, name), []).append((fence, bool(ok), t))
        if kind == "done":
            finished.setdefault((job, name), {}).setdefault(fence, t)
        if kind == "interrupted":
            interrupted.add(job)
            interruptions += 1
        for earlier in STEPS[: order[name]]:
            finished.setdefault((job, earlier), {}).setdefault(fence, t)
    refused = stale = repeated = rerun_lost = 0
    for (job, name), tries in runs.items():
        accepted = [(f, t) for f, ok, t in tries if ok]
        refused += len(tries) - len(accepted)
        repeated += max(0, len(accepted) - 1)
        fences = [f for f, _ in accepted]
        for i, (f, t) in enumerate(accepted):
            if f < max(fences[:i], default=0):
                stale += 1
                bad("stale_write_accepted", f"job {job} {name}: fence {f} after {fences[:i]}")
            if f in fences[:i]:
                bad("step_ran_twice_in_attempt", f"job {job} {name}: fence {f} twice")
            by = sorted(g for g in finished.get((job, name), {}) if g < f)
            if by and lost_between(first[job], t):
                rerun_lost += 1
            elif by:
                bad("finished_step_ran_again", f"job {job} {name}: finished by fence "
                    f"{by}, ran again with fence {f}")  # fmt: skip
        # once=True: it runs at most once, in every attempt together (a refused
        # write is an execution too: its marker, not a fence, is what stops a repeat)
        if name == ONCE and len(tries) > 1:
            if lost_between(first[job], tries[-1][2]):
                rerun_lost += len(tries) - 1
            else:
                bad("once_step_repeated", f"job {job}: {name} ran {len(tries)} times")
    effects: dict[int, Any] = {}
    for job, (state, _) in jobs.items():
        if state != "done":
            bad("job_not_done", f"job {job} is {state}")
        missing = [n for n in STEPS if f"{job}/{n}" not in rows]
        if set(missing) - ({ONCE} if job in interrupted else set()):
            bad("missing_effect", f"job {job} has no effect row for {missing}")
        effects[job] = (0, [rows[f"{job}/{n}"][1] if n not in missing else None for n in STEPS])
    ran = sum(len([x for x in tries if x[1]]) for tries in runs.values())
    figures = dict(
        jobs=len(jobs),
        steps=len(STEPS),
        once_step=ONCE,
        deliveries=sum(d for _, d in jobs.values()),
        steps_run=ran,
        steps_repeated=repeated,
        steps_rerun_after_data_loss=rerun_lost,
        steps_interrupted=interruptions,
        stale_writes_refused=refused,
        stale_writes_accepted=stale,
    )
    return found, figures, effects
