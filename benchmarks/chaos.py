"""Fault injection: do effects stay exactly-once-in-effect while everything breaks?

    python benchmarks/chaos.py --store sqlite|redis|redis-cluster|redis-sentinel|postgres|etcd
        [--same-transaction] [--mode idemlock|plain|both] [--workload jobs|lock|both]
        [--duration S --seed X --json]
    python benchmarks/chaos.py --all [--mode both]      # every store (the long run)
    python benchmarks/chaos.py --all --short            # what CI runs (tests/test_chaos.py)

Worker processes on throwaway servers run jobs from an at-least-once queue through
``@coord.idempotent`` with a fenced effect (``--mode plain``: without idemlock, the
negative control), or write under ``hold()`` (``--workload lock``), while ``faults``
kills and pauses busy workers, restarts the store, cuts and blackholes its connections;
then the data alone is checked. docs/fault-injection.md has the details and
figures. Exits 1 on any violation (plain mode: duplicates and stale overwrites are
reported, not violations).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
from pathlib import Path
from typing import Any

ROOT, HERE = Path(__file__).resolve().parents[1], Path(__file__).resolve().parent
sys.path[:0] = [p for p in (str(ROOT), str(ROOT / "src"), str(HERE)) if p not in sys.path]

from faults import FIXED, KINDS, LOCK_KINDS, LOCK_PRESETS, PRESETS, STORE_KINDS, STORES  # noqa: E402
from faults.locks import check_lock_history  # noqa: E402
from faults.run import LockRun, Run  # noqa: E402

__all__ = ["check_lock_history", "main"]

#: (header, width, cell) of each column of the two report tables
FAULTS = [(k, w, k) for k, w in zip(KINDS, (5, 5, 7, 4, 9), strict=True)]
COLUMNS = [("store", 24, "store"), ("mode", 8, "mode"), ("jobs", 5, "jobs"), *FAULTS,
           ("repeated effects", 16, "repeated_effects"),
           ("stale refused", 13, "stale_writes_refused"),
           ("stale accepted", 14, "stale_writes_accepted"),
           ("viol.", 5, "violations_total")]  # fmt: skip
LOCK_COLUMNS = [("store", 24, "store"), ("mode", 8, "mode"), ("holds", 6, "holds"),
                ("writes", 7, "writes"), *FAULTS, ("accepted", 8, "writes_accepted"),
                ("stale refused", 13, "stale_writes_refused"), ("unknown", 7, "writes_unknown"),
                ("leases lost", 11, "leases_lost"), ("viol.", 5, "violations_total")]  # fmt: skip


def table(
    columns: list[tuple[str, int, str]], reports: list[dict[str, Any]], left: int
) -> list[str]:
    """One row per report, padded to the widths; the first ``left`` columns left-aligned;
    a fault that does not apply to the store is "-"."""

    def cell(r: dict[str, Any], key: str) -> str:
        applies = LOCK_KINDS if r.get("workload") == "lock" else STORE_KINDS
        if key in KINDS:
            return str(r["faults"][key]) if key in applies[r["store"]] else "-"
        return str(r[key]) + (" (same tx)" if key == "store" and r["same_transaction"] else "")

    def line(cells: list[str]) -> str:
        return " ".join(
            c.rjust(w) if i >= left else c.ljust(w)
            for i, (c, (_, w, _)) in enumerate(zip(cells, columns, strict=True))
        )

    head = line([name for name, _, _ in columns])
    rows = [line([cell(r, key) for _, _, key in columns]) for r in reports]
    return [head, "-" * len(head), *rows]


def jobs_lines(r: dict[str, Any]) -> list[str]:
    ev = r["worker_events"]
    line = (
        f"{r['store']}{' (same tx)' if r['same_transaction'] else ''}, {r['mode']}: "
        f"{r['seconds']}s, {r['deliveries']} deliveries, {r['effects_run']} effects run "
        f"({r['jobs_with_repeats']} jobs more than once)"
    )
    if r["mode"] == "idemlock":
        line += (
            f", {ev.get('replayed', 0)} replayed, {ev.get('in_flight', 0)} found in flight, "
            f"{ev.get('store_error', 0)} store errors, {ev.get('stale_complete', 0)} stale "
            f"completes, {r['records_lost_with_data']} records lost with Redis data"
        )
    return [line, *(f"    VIOLATION {text[:300]}" for text in r["examples"])]


def lock_lines(r: dict[str, Any]) -> list[str]:
    ev, late = r["worker_events"], r["on_lost_late_s"]
    line = (
        f"{r['store']}, lock, {r['mode']}: {r['seconds']}s, ttl {r['ttl_s']:g}s, "
        f"{r['workers']} workers, "
        f"{r['resources']} resources, fence {r['fence']}; {r['writes_after_deadline']} "
        f"writes sent after the lease's deadline ({r['writes_lost_flag_late']} of them "
        f"before lease.lost turned True); on_lost ran {late['count']} times for running "
        f"holders, after their deadline by median {late['median']}s, max "
        f"{late['max']}s (and {r['on_lost_late_paused_s']['count']} times for "
        f"SIGSTOPped ones, on waking); {ev.get('store_error', 0)} store errors, "
        f"{ev.get('not_acquired', 0)} waits timed out"
    )
    unfenced = [f"    without a fence: {r['unfenced_findings']}"] if r["unfenced_findings"] else []
    return [line, *unfenced, *(f"    VIOLATION {text[:400]}" for text in r["examples"])]


#: each workload's section: title, table columns, left-aligned columns, lines per run
SECTIONS = {
    "jobs": ([], COLUMNS, 2, jobs_lines),
    "lock": (["lock workload:"], LOCK_COLUMNS, 1, lock_lines),
}


def render(reports: list[dict[str, Any]]) -> str:
    sections = []
    for workload, (title, columns, left, lines) in SECTIONS.items():
        runs = [r for r in reports if r.get("workload", "jobs") == workload]
        if runs:
            rows = [line for r in runs for line in lines(r)]
            sections.append("\n".join([*title, *table(columns, runs, left), "", *rows]))
    return "\n\n".join(sections)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="chaos.py", description=__doc__.split("\n\n")[0])
    arg = ap.add_argument
    arg("--store", choices=STORES)
    arg("--all", action="store_true", help="every store (and same-transaction)")
    arg("--same-transaction", action="store_true",
        help="PostgreSQL: effect, log row and complete commit in one transaction")  # fmt: skip
    arg("--mode", choices=("idemlock", "plain", "both"), default="idemlock")
    arg("--workload", choices=("jobs", "lock", "both"), default="jobs",
        help="jobs: keyed jobs from an at-least-once queue; lock: hold() with renewals "
        "and fenced writes under the lock")  # fmt: skip
    arg("--short", action="store_true", help="the CI configuration")
    arg("--duration", type=float, help="seconds over which jobs are released")
    arg("--seed", type=int)
    arg("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    if not args.all and not args.store:
        ap.error("give --store or --all")
    if args.same_transaction and args.store != "postgres":
        ap.error("--same-transaction needs --store postgres")
    if args.workload == "lock" and args.same_transaction:
        ap.error("the lock workload has no --same-transaction")
    size = "short" if args.short else "long"
    lock = LOCK_PRESETS[size] if args.workload == "lock" else {}
    for name, value in (PRESETS[size] | FIXED | lock).items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1_000_000)
    return args


def plan(args: argparse.Namespace) -> list[tuple[str, str, bool, str]]:
    """(store, mode, same transaction, workload) of each run."""
    modes = ("plain", "idemlock") if args.mode == "both" else (args.mode,)
    stores = STORES if args.all else (args.store,)
    runs = []
    for store in stores if args.workload in ("jobs", "both") else ():
        for mode in modes:
            if args.all or not args.same_transaction:
                runs.append((store, mode, False, "jobs"))
            if (store, mode) == ("postgres", "idemlock") and (args.all or args.same_transaction):
                runs.append((store, mode, True, "jobs"))
    if args.workload in ("lock", "both"):
        runs += [(store, mode, False, "lock") for store in stores for mode in modes]
    return runs


def _terminate(signum: int, frame: Any) -> None:
    # Leave through the finally blocks: they stop the workers and the servers and remove
    # their directories (the servers die with us anyway: tests/servers/_proc.py).
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _terminate)

    def say(text: str) -> None:
        print(text, file=sys.stderr if args.json else sys.stdout, flush=True)

    say(f"chaos: seed {args.seed}")
    reports = []
    runs = plan(args)
    for store, mode, same_tx, workload in runs:
        kind = LockRun if workload == "lock" else Run
        reports.append(kind(store, mode, same_tx, args, say).execute())
        if not args.json and len(runs) > 1:
            say(render(reports[-1:]))
    failed = sum(r["violations_total"] for r in reports)
    if args.json:
        print(json.dumps({"seed": args.seed, "runs": reports, "violations": failed}, indent=2))
    else:
        print(f"\n{render(reports)}\n")
        print(f"{'FAILED' if failed else 'OK'}: {failed} violation(s); seed {args.seed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
