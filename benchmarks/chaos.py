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


from faults import (  # noqa: E402
    KINDS,
    LOCK_KINDS,
    LOCK_PRESETS,
    PRESETS,
    STORE_KINDS,
    STORES,
    WORKLOADS,
)
from faults.locks import LockRun, check_lock_history  # noqa: E402
from faults.run import Options, Run  # noqa: E402

__all__ = ["check_lock_history", "main"]


# ---- the report tables --------------------------------------------------------------


def _faults(r: dict[str, Any], applies: dict[str, tuple[str, ...]]) -> list[str]:
    return [str(r["faults"][k]) if k in applies[r["store"]] else "-" for k in KINDS]


#: (header, width) of each column, then the cells of a report
COLUMNS = [("store", 24), ("mode", 8), ("jobs", 5), ("kill", 5), ("stop", 5), ("restart", 7),
           ("cut", 4), ("blackhole", 9), ("repeated effects", 16), ("stale refused", 13),
           ("stale accepted", 14), ("viol.", 5)]  # fmt: skip
LOCK_COLUMNS = [("store", 24), ("mode", 8), ("holds", 6), ("writes", 7), ("kill", 5),
                ("stop", 5), ("restart", 7), ("cut", 4), ("blackhole", 9), ("accepted", 8),
                ("stale refused", 13), ("unknown", 7), ("leases lost", 11),
                ("viol.", 5)]  # fmt: skip


def row_of(r: dict[str, Any]) -> list[str]:
    store = r["store"] + (" (same tx)" if r["same_transaction"] else "")
    return [store, r["mode"], str(r["jobs"]), *_faults(r, STORE_KINDS)] + [
        str(r[k]) for k in ("repeated_effects", "stale_writes_refused",
                            "stale_writes_accepted", "violations_total")]  # fmt: skip


def lock_row_of(r: dict[str, Any]) -> list[str]:
    return [r["store"], r["mode"], str(r["holds"]), str(r["writes"]),
            *_faults(r, LOCK_KINDS)] + [str(r[k]) for k in (
        "writes_accepted", "stale_writes_refused", "writes_unknown", "leases_lost",
        "violations_total")]  # fmt: skip


def _table(columns: list[tuple[str, int]], rows: list[list[str]], left: int = 1) -> list[str]:
    """Columns padded to their widths; the first ``left`` ones left-aligned."""

    def line(cells: list[str]) -> str:
        return " ".join(
            c.rjust(w) if i >= left else c.ljust(w)
            for i, (c, (_, w)) in enumerate(zip(cells, columns, strict=True))
        )

    head = line([name for name, _ in columns])
    return [head, "-" * len(head), *(line(cells) for cells in rows)]


def render_locks(reports: list[dict[str, Any]]) -> list[str]:
    lines = ["lock workload:", *_table(LOCK_COLUMNS, [lock_row_of(r) for r in reports]), ""]
    for r in reports:
        ev, late = r["worker_events"], r["on_lost_late_s"]
        lines.append(
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
        if r["unfenced_findings"]:
            lines.append(f"    without a fence: {r['unfenced_findings']}")
        for text in r["examples"]:
            lines.append(f"    VIOLATION {text[:400]}")
    return lines


def render(reports: list[dict[str, Any]]) -> str:
    locks = [r for r in reports if r.get("workload") == "lock"]
    reports = [r for r in reports if r.get("workload") != "lock"]
    if not reports:
        return "\n".join(render_locks(locks))
    lines = _table(COLUMNS, [row_of(r) for r in reports], left=2)
    lines.append("")
    for r in reports:
        ev = r["worker_events"]
        extra = (
            f"{r['store']}{' (same tx)' if r['same_transaction'] else ''}, {r['mode']}: "
            f"{r['seconds']}s, {r['deliveries']} deliveries, {r['effects_run']} effects run "
            f"({r['jobs_with_repeats']} jobs more than once)"
        )
        if r["mode"] == "idemlock":
            extra += (
                f", {ev.get('replayed', 0)} replayed, {ev.get('in_flight', 0)} found in flight, "
                f"{ev.get('store_error', 0)} store errors, {ev.get('stale_complete', 0)} stale "
                f"completes, {r['records_lost_with_data']} records lost with Redis data"
            )
        lines.append(extra)
        for text in r["examples"]:
            lines.append(f"    VIOLATION {text[:300]}")
    if locks:
        lines += ["", *render_locks(locks)]
    return "\n".join(lines)


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
    ap.add_argument("--seed", type=int)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--verbose", action="store_true", help="print every fault as it happens")
    args = ap.parse_args(argv)
    if not args.all and not args.store:
        ap.error("give --store or --all")
    if args.same_transaction and args.store != "postgres":
        ap.error("--same-transaction needs --store postgres")
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
