"""The fault injector behind ``benchmarks/chaos.py``: ``network`` (cuts, blackholes),
``effects`` (the effects database, on ``idemlock.cli._faults.queue``), ``worker`` (the worker
processes), ``run`` (a run, start to check; its workers and killer are
``idemlock.cli._faults.workers``, shared with ``idemlock demo``), ``locks`` (the lock
history checker)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HOST = "127.0.0.1"
STORES = ("sqlite", "redis", "redis-cluster", "redis-sentinel", "postgres", "etcd")
KINDS = ("kill", "stop", "restart", "cut", "blackhole")
#: which faults apply: SQLite has no server to restart and no connection to cut. Redis
#: behind Sentinel: its "restart" is a failover (the primary SIGKILLed, a replica
#: promoted, the old one back as a replica); no cuts (the Sentinels name the servers'
#: own addresses, so no proxy stands between the workers and them).
SENTINEL_KINDS = ("kill", "stop", "restart")
STORE_KINDS = {store: KINDS for store in STORES} | {
    "sqlite": ("kill", "stop"),
    "redis-sentinel": SENTINEL_KINDS,
}
#: the lock workload's: no Redis restarts (an empty Redis forgets its leases and gates:
#: data loss the job workload measures, not a failure of the lock)
NO_RESTART = ("kill", "stop", "cut", "blackhole")
LOCK_KINDS = STORE_KINDS | {"redis": NO_RESTART, "redis-cluster": NO_RESTART}
#: slack for clock granularity between processes (one machine, CLOCK_MONOTONIC)
SLACK = 0.02
#: stores whose restart loses data (their records are not expected to survive; Redis
#: behind Sentinel runs with durability=replicas:1, so a failover must lose nothing)
LOSSY = ("redis", "redis-cluster")
SPEC, LOCK_SPEC = "chaos", "chaos-lock"
#: the counted leases' specs (issue 24): a semaphore's permits, an election's terms
PERMIT_SPEC, ELECTION_SPEC = "chaos-permits", "chaos-election"
#: the workloads of fenced leases (LockRun and its kin): ``hold()`` on a lock, on a
#: semaphore's permits, ``campaign()`` on an election; same faults, same history tables
LEASE_WORKLOADS = ("lock", "permits", "election")
#: stores whose lock write is the store's own gate (timed log, not acceptance order)
GATED = ("redis", "redis-cluster", "redis-sentinel", "etcd")
PRESETS: dict[str, dict[str, Any]] = {
    # CI: the window ends as soon as every kind of fault has landed (``until_faults``
    # times) and the run shows what it is about; ``duration`` is then its nominal
    # length, which a busy machine may need (and EXTRA past it).
    "short": {"jobs": 120, "workers": 4, "duration": 8.0, "fault_every": 0.25, "until_faults": 1},
    # By command; the figures of docs/fault-injection.md (the whole window, always).
    "long": {"jobs": 3000, "workers": 6, "duration": 120.0, "fault_every": 0.5, "until_faults": 0},
}
#: in every run: the claim lease or lock ttl (s), the queue's visibility timeout (s),
#: the locks contended
FIXED = {"lease": 1.0, "visibility": 1.0, "resources": 3}
#: the lock workload's (workers contend for locks: no job count)
LOCK_PRESETS: dict[str, dict[str, Any]] = {
    "short": {"workers": 4, "duration": 6.0, "fault_every": 0.25},
    "long": {"workers": 6, "duration": 180.0, "fault_every": 0.5},
}
#: the permits workload's: more workers than permits on each key (``limit``), so that
#: the keys are contended and a paused holder's permit goes to a waiter
PERMIT_PRESETS: dict[str, dict[str, Any]] = {
    "short": {"workers": 4, "duration": 6.0, "fault_every": 0.25, "limit": 2, "resources": 1},
    "long": {"workers": 6, "duration": 180.0, "fault_every": 0.5, "limit": 3, "resources": 1},
}
#: each lease workload's presets (the election's are the lock's: a term is a lock's lease)
LEASE_PRESETS = {"lock": LOCK_PRESETS, "permits": PERMIT_PRESETS, "election": LOCK_PRESETS}


@dataclass
class Findings:
    """Violations counted by kind, with the first few examples."""

    violations: Counter[str] = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def bad(self, kind: str, text: str, n: int = 1) -> None:
        self.violations[kind] += n
        if len(self.examples) < 10:
            self.examples.append(f"{kind}: {text}")


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
