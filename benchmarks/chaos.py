"""Fault injection: do effects stay exactly-once-in-effect while everything breaks?

    python benchmarks/chaos.py --store sqlite|redis|redis-cluster|postgres|etcd
        [--same-transaction] [--mode idemlock|plain|both]
        [--jobs N --workers W --duration S --seed X --fault-every S --lease S ...]
    python benchmarks/chaos.py --all [--mode both]      # every store (the long run)
    python benchmarks/chaos.py --all --short            # what CI runs
    python benchmarks/chaos.py --all --workload lock    # the lock workload, every store
    ... --json                                          # the report as JSON

What one run does, on throwaway servers on free loopback ports (never anything else):

* The **effects database** holds an at-least-once queue (``jobs``: a job taken by a
  worker turns invisible for ``--visibility`` seconds and is delivered again when its
  worker dies or stalls), the side effect (``effects(job_id PRIMARY KEY, fence,
  value)``) and an append-only ``effect_log(id, job_id, fence, worker, accepted)``
  written in the same transaction as each attempted effect. It is a SQLite file for
  the SQLite store and a PostgreSQL database otherwise (for the PostgreSQL store, the
  store's own database, reached through the same proxy as the store).
* ``--workers`` processes take jobs (released at a steady rate over ``--duration``)
  and run each through ``@coord.idempotent`` keyed ``job-<id>``: the function writes
  the effect **fenced** by ``current_claim().fence`` (``... ON CONFLICT (job_id) DO
  UPDATE ... WHERE effects.fence <= new fence``) and returns the value it wrote; then
  the job is acknowledged. In **same-transaction** mode (PostgreSQL) the worker claims
  through the port and commits the effect, its log row and ``complete_in_transaction``
  in one transaction. In **plain** mode there is no idemlock: the effect is an
  unfenced upsert and the retry is the queue's redelivery (the delivery number stands
  in for the token, so stale overwrites can be counted).
* Faults, at random (exponential gaps of mean ``--fault-every``, kinds taken in
  shuffled rounds so each kind occurs): SIGKILL of a worker (a replacement starts; its
  jobs are redelivered at once, as a broker does when a consumer's connection drops),
  SIGSTOP of a worker for 1.3-2.5 leases then SIGCONT, a restart of the store server
  (Redis: killed and started empty, ``--save '' --appendonly no``; a Cluster node the
  same; PostgreSQL: ``pg_ctl restart -m immediate``, a crash), a cut of every
  connection through the loopback TCP proxy between the workers and the store, and a
  **blackhole** of that proxy for 0.5-4 leases: it stops forwarding without closing
  anything (a dead switch, a partition), either everything (new connections hang
  after the kernel's accept) or a random half of the open connections.
* At the end, from the data alone: every job is done and has exactly one effect row;
  in the log, no write was accepted with a token lower than one accepted before it
  for that key, and the effect row carries the highest accepted token; every
  completed key replays (the wrapped function is called again in the checker: it
  must not run) the value found in the effect row; after a lease no key is still
  claimed; in same-transaction mode every effect ran exactly once. Counted, not
  violations: effects that ran again (a worker died or stalled between its effect and
  ``complete``: the window no claim can close; the fenced, keyed write makes the
  re-run replace the row instead of adding one), stale writes refused by the fence,
  and records Redis lost with its data.

The **lock workload** (``--workload lock``): workers contend for ``--resources`` locks
through ``hold()`` (ttl ``--lease``, renewed every ttl/3), each hold lasting 0.2-2.5
ttls, and under it decide to write (noting the time, ``lease.remaining()`` and
``lease.lost``), prepare for 5-25 ms, then make a **fenced write** with the lease's
token: Redis and Cluster through the store's own gate, ``FenceGate.set_if_fresh``,
logged afterwards with the times around it; SQLite and PostgreSQL by a fenced upsert
(PostgreSQL: idemlock's ``fenced_upsert``) committed with its log row, so the log's ids
are the order of acceptance. Faults: SIGKILL and SIGSTOP past the ttl of a holder,
blackholes, cuts, and PostgreSQL crashes (no Redis restarts here: an empty Redis
forgets its leases and gates, the data loss the job workload already counts). The
checker (``check_lock_history``) reads the history: no accepted write's token is below
one accepted before it; accepted writes of two holders never go A, B, A; a hold that
began after another was granted got a higher token, and no token went to two holders;
no write was decided while ``remaining()`` still showed time on a lease another holder
had been granted. ``--mode plain`` writes without the fence: the negative control,
whose stale and interleaved writes are reported, not failures.

**etcd** (``--store etcd``): a 3-member cluster on free loopback ports, each member
behind its own proxy (the workers' URL names the three proxies). Its "restart" is, at
random, a SIGKILL of the current leader followed by its restart (same ports and data;
the supervisor waits for the member to answer again) or a SIGSTOP of one member for
0.5-3 leases, then SIGCONT (a pause; at most one member paused at a time); the report's
``etcd_faults`` counts each. A cut aborts the connections of one member's proxy or of
all; a blackhole silences everything or every connection of one member's proxy. The
effects database is a local SQLite file; the lock workload's write is
``FenceGate.check_and_advance`` on the workers' own coordinator, logged to that file
afterwards with the times around it (judged as the Redis gate's writes are).

Exits 1 on any violation (plain mode: duplicates and stale overwrites are reported,
not violations; only harness failures fail it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import signal
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for _p in (str(HERE), str(ROOT / "src"), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)


from faults import KINDS, LOCK_PRESETS, PRESETS, STORES, WORKLOADS  # noqa: E402
from faults.locks import LockRun, check_lock_history  # noqa: E402
from faults.render import render  # noqa: E402
from faults.run import Options, Run  # noqa: E402

__all__ = ["check_lock_history", "main"]


# ---- the command ------------------------------------------------------------------------


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="chaos.py", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    ap.add_argument("--store", choices=STORES)
    ap.add_argument("--all", action="store_true", help="every store (and same-transaction)")
    ap.add_argument(
        "--same-transaction",
        action="store_true",
        help="PostgreSQL: effect, log row and complete commit in one transaction",
    )
    ap.add_argument("--mode", choices=("idemlock", "plain", "both"), default="idemlock")
    ap.add_argument(
        "--workload",
        choices=(*WORKLOADS, "both"),
        default="jobs",
        help="jobs: keyed jobs from an at-least-once queue; lock: hold() with renewals "
        "and fenced writes under the lock (ttl --lease)",
    )
    ap.add_argument("--resources", type=int, default=3, help="lock workload: locks contended")
    ap.add_argument("--short", action="store_true", help="the CI configuration")
    ap.add_argument("--jobs", type=int)
    ap.add_argument("--workers", type=int)
    ap.add_argument("--duration", type=float, help="seconds over which jobs are released")
    ap.add_argument("--fault-every", type=float, help="mean seconds between faults")
    ap.add_argument("--lease", type=float, default=1.0, help="claim lease (s)")
    ap.add_argument("--visibility", type=float, default=1.0, help="queue visibility timeout (s)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="faults to inject (comma list)")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--verbose", action="store_true", help="print every fault as it happens")
    args = ap.parse_args(argv)
    if not args.all and not args.store:
        ap.error("give --store or --all")
    if args.same_transaction and args.store != "postgres":
        ap.error("--same-transaction needs --store postgres")
    kinds = tuple(k for k in args.kinds.split(",") if k)
    if not kinds or any(k not in KINDS for k in kinds):
        ap.error(f"--kinds takes a comma list of {', '.join(KINDS)}")
    args.kinds = kinds
    if args.workload == "lock" and args.same_transaction:
        ap.error("the lock workload has no --same-transaction")
    size = "short" if args.short else "long"
    presets = [LOCK_PRESETS[size]] if args.workload == "lock" else []
    for preset in [*presets, PRESETS[size]]:
        for name, value in preset.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1_000_000)
    return args


def plan(args: argparse.Namespace) -> list[tuple[str, str, bool, str]]:
    """(store, mode, same transaction, workload) of each run."""
    modes = ("plain", "idemlock") if args.mode == "both" else (args.mode,)
    runs: list[tuple[str, str, bool, str]] = []
    stores = STORES if args.all else (args.store,)
    if args.workload in ("jobs", "both"):
        for store in stores:
            for mode in modes:
                if args.all or not args.same_transaction:
                    runs.append((store, mode, False, "jobs"))
                if (
                    store == "postgres"
                    and mode == "idemlock"
                    and (args.all or args.same_transaction)
                ):
                    runs.append((store, mode, True, "jobs"))
    if args.workload in ("lock", "both"):
        runs += [(store, mode, False, "lock") for store in stores for mode in modes]
    return runs


def _terminate(signum: int, frame: Any) -> None:
    # Leave through the finally blocks: they stop the workers and the servers (a
    # PostgreSQL started by pg_ctl would outlive us otherwise).
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _terminate)
    opts = Options(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Options)})

    def say(text: str) -> None:
        print(text, file=sys.stderr if args.json else sys.stdout, flush=True)

    say(f"chaos: seed {opts.seed}")
    reports = []
    runs = plan(args)
    for store, mode, same_tx, workload in runs:
        kind = LockRun if workload == "lock" else Run
        reports.append(kind(store, mode, same_tx, opts, say).execute())
        if not args.json and len(runs) > 1:
            say(render(reports[-1:]))
    failed = sum(r["violations_total"] for r in reports)
    if args.json:
        print(json.dumps({"seed": opts.seed, "runs": reports, "violations": failed}, indent=2))
    else:
        print()
        print(render(reports))
        print(f"\n{'FAILED' if failed else 'OK'}: {failed} violation(s); seed {opts.seed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
