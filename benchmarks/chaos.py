"""Fault injection: do effects stay exactly-once-in-effect while everything breaks?

    python benchmarks/chaos.py --store sqlite|redis|redis-cluster|redis-sentinel|postgres|etcd
        [--same-transaction] [--mode idemlock|plain|both]
        [--workload jobs|steps|lock|permits|election|both|all] [--limit N]
        [--duration S --until-faults N --seed X --json]
    python benchmarks/chaos.py --all [--mode both]      # every store (the long run)
    python benchmarks/chaos.py --all --short            # what CI runs (tests/test_chaos.py)

Worker processes on throwaway servers run jobs from an at-least-once queue through
``@coord.idempotent`` with a fenced effect (``--mode plain``: without idemlock, the
negative control), or in three steps each with its own effect (``--workload steps``:
no finished step may run again), or write under ``hold()`` (``--workload lock``), under a
semaphore's permits (``--workload permits``) or as an election's leader (``--workload
election``), while ``faults``
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

from faults import (  # noqa: E402
    FIXED,
    KINDS,
    LEASE_PRESETS,
    LEASE_WORKLOADS,
    LOCK_KINDS,
    PRESETS,
    STORE_KINDS,
    STORES,
)
from faults.locks import check_lock_history, check_permit_history  # noqa: E402
from faults.run import (  # noqa: E402
    ElectionRun,
    LockRun,
    PermitRun,
    Run,
    StepsRun,
    check_steps_history,
)

__all__ = ["check_lock_history", "check_permit_history", "check_steps_history", "main"]

#: each workload's run
RUNS = {
    "jobs": Run,
    "steps": StepsRun,
    "lock": LockRun,
    "permits": PermitRun,
    "election": ElectionRun,
}
#: what ``--workload`` may name: one workload, or several
WORKLOADS = {name: (name,) for name in RUNS} | {
    "both": ("jobs", "lock"),
    "all": tuple(RUNS),
}

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
STEP_COLUMNS = [*COLUMNS[:2], ("jobs", 5, "jobs"), ("steps run", 9, "steps_run"), *FAULTS,
                ("repeated", 8, "steps_repeated"), ("interrupted", 11, "steps_interrupted"),
                ("lost with data", 14, "steps_rerun_after_data_loss"),
                ("stale refused", 13, "stale_writes_refused"),
                ("viol.", 5, "violations_total")]  # fmt: skip
PERMIT_COLUMNS = [*LOCK_COLUMNS[:-1], ("limit", 5, "limit"),
                  ("most inside", 11, "most_holders_interleaved"),
                  ("viol.", 5, "violations_total")]  # fmt: skip


def table(
    columns: list[tuple[str, int, str]], reports: list[dict[str, Any]], left: int
) -> list[str]:
    """One row per report, padded to the widths; the first ``left`` columns left-aligned;
    a fault that does not apply to the store is "-"."""

    def cell(r: dict[str, Any], key: str) -> str:
        applies = LOCK_KINDS if r.get("workload") in LEASE_WORKLOADS else STORE_KINDS
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


def steps_lines(r: dict[str, Any]) -> list[str]:
    ev, v = r["worker_events"], r["violations"]
    line = (
        f"{r['store']}, steps, {r['mode']}: {r['seconds']}s, {r['jobs']} jobs of {r['steps']} "
        f"steps ({r['once_step']} once=True), {r['deliveries']} deliveries, {r['steps_run']} "
        f"steps run, {r['steps_repeated']} repeated (in flight at a fault, or their record "
        f"lost with Redis data: {r['steps_rerun_after_data_loss']}), "
        f"{v.get('finished_step_ran_again', 0)} finished steps run again, "
        f"{v.get('once_step_repeated', 0)} once=True steps repeated, {r['steps_interrupted']} "
        f"found interrupted and settled; {ev.get('replayed', 0)} replayed, "
        f"{ev.get('in_flight', 0)} found in flight, {ev.get('store_error', 0)} store errors, "
        f"{ev.get('claim_lost', 0)} steps refused (claim lost), {r['records_lost_with_data']} "
        "records lost with Redis data"
    )
    if r["mode"] == "plain":
        line = (
            f"{r['store']}, steps, plain (steps called directly): {r['seconds']}s, "
            f"{r['jobs']} jobs, {r['deliveries']} deliveries, {r['steps_run']} steps run; "
            f"without records: {r['unguarded_findings']}"
        )
    return [line, *(f"    VIOLATION {text[:300]}" for text in r["examples"])]


def lock_lines(r: dict[str, Any]) -> list[str]:
    ev, late = r["worker_events"], r["on_lost_late_s"]
    line = (
        f"{r['store']}, {r['workload']}, {r['mode']}: {r['seconds']}s, ttl {r['ttl_s']:g}s, "
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
    "steps": (["steps workload:"], STEP_COLUMNS, 2, steps_lines),
    "lock": (["lock workload:"], LOCK_COLUMNS, 1, lock_lines),
    "permits": (["permits workload:"], PERMIT_COLUMNS, 1, lock_lines),
    "election": (["election workload:"], LOCK_COLUMNS, 1, lock_lines),
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
    arg("--workload", choices=tuple(WORKLOADS), default="jobs",
        help="jobs: keyed jobs from an at-least-once queue; steps: the same jobs in three "
        "steps, each an effect (one once=True); lock: hold() with renewals "
        "and fenced writes under the lock; permits: the same under a semaphore's "
        "permits; election: under campaign()'s terms; both: jobs and lock; all: every "
        "one")  # fmt: skip
    arg("--limit", type=int, help="the permits workload's permits per key")
    arg("--short", action="store_true", help="the CI configuration")
    arg("--duration", type=float, help="seconds over which jobs are released")
    arg("--until-faults", type=int, metavar="N",
        help="end the faults as soon as every kind has landed N times and the run shows "
        "what it is about (at the latest after --duration, or a little more); 0: after "
        "--duration (the default but with --short: 1)")  # fmt: skip
    arg("--seed", type=int)
    arg("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    if not args.all and not args.store:
        ap.error("give --store or --all")
    if args.same_transaction and args.store != "postgres":
        ap.error("--same-transaction needs --store postgres")
    if args.same_transaction and "jobs" not in WORKLOADS[args.workload]:
        ap.error(f"the {args.workload} workload has no --same-transaction")
    if args.limit is not None and args.limit < 1:
        ap.error("--limit must be at least 1")
    if args.until_faults is not None and args.until_faults < 0:
        ap.error("--until-faults must be at least 0")
    # the options given; the others are each workload's presets (options())
    args.given = {k: v for k, v in vars(args).items() if v is not None}
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1_000_000)
    return args


def options(args: argparse.Namespace, workload: str) -> argparse.Namespace:
    """The options of one workload's runs: those given, else its presets (short or
    long), else the job workload's."""
    size = "short" if args.short else "long"
    preset = LEASE_PRESETS[workload][size] if workload in LEASE_PRESETS else {}
    values = vars(args) | PRESETS[size] | FIXED | preset | args.given
    return argparse.Namespace(**{k: v for k, v in values.items() if k != "given"})


def plan(args: argparse.Namespace) -> list[tuple[str, str, bool, str]]:
    """(store, mode, same transaction, workload) of each run."""
    modes = ("plain", "idemlock") if args.mode == "both" else (args.mode,)
    stores = STORES if args.all else (args.store,)
    workloads = WORKLOADS[args.workload]
    runs = []
    for store in stores if "jobs" in workloads else ():
        for mode in modes:
            if args.all or not args.same_transaction:
                runs.append((store, mode, False, "jobs"))
            if (store, mode) == ("postgres", "idemlock") and (args.all or args.same_transaction):
                runs.append((store, mode, True, "jobs"))
    if "steps" in workloads:
        runs += [(store, mode, False, "steps") for store in stores for mode in modes]
    for workload in (w for w in workloads if w in LEASE_WORKLOADS):
        runs += [(store, mode, False, workload) for store in stores for mode in modes]
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
        run = RUNS[workload](store, mode, same_tx, options(args, workload), say)
        reports.append(run.execute())
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
