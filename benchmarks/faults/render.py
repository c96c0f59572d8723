"""The report tables of a set of runs."""

from __future__ import annotations

from typing import Any

from faults import KINDS, LOCK_KINDS, STORE_KINDS

# ---- output -----------------------------------------------------------------------------


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
