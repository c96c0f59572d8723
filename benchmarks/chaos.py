"""Fault injection: do effects stay exactly-once-in-effect while everything breaks?

    python benchmarks/chaos.py --store sqlite|redis|redis-cluster|postgres|etcd
        [--same-transaction] [--mode idemlock|plain|both] [--workload jobs|lock|both]
        [--jobs N --workers W --duration S --seed X --fault-every S --lease S ...]
    python benchmarks/chaos.py --all [--mode both]      # every store (the long run)
    python benchmarks/chaos.py --all --short            # what CI runs (tests/test_chaos.py)
    ... --json                                          # the report as JSON

On throwaway servers on free loopback ports, ``--workers`` processes take jobs from an
at-least-once queue (``idemlock._faults``, shared with ``idemlock demo``) and run each
through ``@coord.idempotent``, writing the effect fenced by the claim's token, with a
log row in the same transaction (``faults.effects``); ``--mode plain`` does the same
without idemlock, as the negative control. Meanwhile ``faults.run`` injects, at random:
SIGKILL and SIGSTOP of a busy worker, restarts of the store server (etcd: a leader's
SIGKILL or a member's pause), cuts and blackholes (everything, or some connections) of
the loopback proxies between the workers and the store (``tests/servers/proxy.py``).
Then it checks from the data alone: one effect row per job, no stale token accepted,
completed keys replay the effect's value, nothing left claimed; exactly once in the
same-transaction mode. ``--workload lock`` contends for ``--resources`` locks through
``hold()`` with fenced writes under them; ``faults.locks.check_lock_history`` judges the
write history. The README's "Fault injection" section has the details and figures.

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
