"""The renderer: the JSON of a report run as Markdown tables and a PNG chart.

    python benchmarks/render.py [--json docs/benchmarks.json] [--out docs/benchmarks.md]
                                [--png docs/benchmarks.png]

``report.py`` calls it after a run; alone, it renders the JSON of an earlier run again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from pathlib import Path
from typing import Any

import common as c

X = c.X
DRIVERS = ("redis-py", "hiredis", "psycopg", "psycopg-pool", "asyncpg")
OMIT = "\0"  # an optional table without rows: its section is left out of the page
SCALED = (
    f" (memory {X}{c.SCALE['memory']}, SQLite {X}{c.SCALE['sqlite']}: their operations take "
    "microseconds)"
)
#: the columns of the long tables after store and subject
HAND_COLUMNS = (
    f"critical sections/s|{X} baseline|hand-offs|gap median / p90 / p99|hand-off gap median|"
    "worst wait|overlapping holds"
)
JOB_COLUMNS = f"the job|fenced|round trips|jobs/s|{X} baseline"
REPRODUCE = """\
```sh
pip install -e ".[test]" matplotlib python-redis-lock fencekit idemkit asyncpg \
"aws-lambda-powertools[redis]" coredis valkey-glide
python benchmarks/report.py            # this page, a few minutes; --quick for CI
python benchmarks/report.py --stores redis,postgres   # a subset of the stores
python benchmarks/goals.py --doc docs/benchmarks.md   # issue 13's goal table
python benchmarks/scale.py --doc docs/benchmarks.md   # issue 28's scale figures
python benchmarks/chaos.py --all --short              # the fault injection (CI)
```"""


def fmt_rate(v: float) -> str:
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 1e4:
        return f"{v / 1e3:.1f}k"
    if v >= 100:
        return f"{v:,.0f}"
    return f"{v:.1f}"


def index(data: dict[str, Any]) -> dict[tuple[str, ...], tuple[Any, Any]]:
    """(scenario, operation, store, subject) -> (result row, None) or (None, why not)."""
    out: dict[tuple[str, ...], tuple[Any, Any]] = {}
    for n in data["not_run"]:
        out.setdefault(tuple(n[k] for k in c.KEYS), (None, n))
    for r in data["results"]:
        out[tuple(r[k] for k in c.KEYS)] = (r, None)
    return out


def table(head: str, rows: list[list[Any]], right: int = 99, optional: bool = False) -> str:
    """A Markdown table of the columns named in ``head`` ("|" between them), those from
    ``right`` on right-aligned; OMIT if ``optional`` and without rows."""
    if optional and not rows:
        return OMIT
    names = head.split("|")
    rule = ["---:" if i >= right else "---" for i in range(len(names))]
    cells = ([f" {v} " if v != "" else " " for v in r] for r in (names, rule, *rows))
    return "\n".join("|" + "|".join(r) + "|" for r in cells)


def ratio_text(r: dict[str, Any], rate: bool = False) -> str:
    """The ratio; with ``rate``, the rate and (if measured) the CPU µs per operation."""
    cpu = f", {r['cpu_us']:.3g} µs CPU" if rate and r.get("cpu_us") is not None else ""
    text = f"{r['ratio']:.2f}{X}" + (f" ({fmt_rate(r['value'])}/s{cpu})" if rate else "")
    return f"**{text}**" if r["subject"] == c.OURS else text


def wide(data: dict[str, Any], scenarios: list[str], stores: list[str], trips: bool = False) -> str:
    """Subjects down, ``stores`` across, for each operation of the ``scenarios``: the ratio
    and rate, or why not; with ``trips``, the round trips counted (and no scenario column)."""
    found, rows, first = index(data), [], int(trips)  # the first column shown
    for key in ((s, op) for s in scenarios for op in (c.LOCK_OP, c.CLAIM_OP)):
        for subject in c.SUBJECTS:
            got = [found.get((*key, s, subject), (None, None)) for s in stores]
            if trips:
                cells = [r and r.get("round_trips") and f"{r['round_trips']:g}" for r, _ in got]
            else:
                cells = [ratio_text(r, True) if r else miss and miss["status"] for r, miss in got]
            if any(cells):
                rows.append([*key, subject, *(v or "—" for v in cells)][first:])
    head = ["scenario", "operation", "subject", *(c.TITLE[s] for s in stores)][first:]
    return table("|".join(head), rows, 3 - first)


def long(data: dict[str, Any], key: tuple[str, str], head: str, right: int, cells: Any) -> str:
    """Stores down: a row per store and subject that ran or tried ``key``, its ``head``
    columns from ``cells(store, subject, row, not_run)`` (one of the last two None)."""
    found = index(data)
    rows = [
        [c.TITLE[store], subject, *cells(store, subject, *found[(*key, store, subject)])]
        for store in data["stores"]
        for subject in c.SUBJECTS
        if (*key, store, subject) in found
    ]
    return table("store|subject|" + head, rows, right)


def ms(value: float | None, digits: int = 2) -> str:
    """Milliseconds; "—" for a gap not measured (None in the JSON, NaN in a run)."""
    return "—" if value is None or math.isnan(value) else f"{value:.{digits}f} ms"


def hand_cells(store: str, subject: str, r: Any, miss: Any) -> list[str]:
    if r is None:
        return [miss["status"], *[""] * 6]
    # .get: a run's JSON from before p90, p99 and overlapping holds renders too
    gaps = " / ".join(ms(r.get(k)) for k in ("gap_median_ms", "gap_p90_ms", "gap_p99_ms"))
    share, handoff = f"{r['handoff_share']:.0%}", ms(r["handoff_gap_median_ms"])
    figures = [gaps, handoff, ms(r["worst_wait_ms"], 1), f"{r.get('overlapping_holds', '—')}"]
    return [f"{r['value']:,.0f}", ratio_text(r), share, *figures]


def job_cells(store: str, subject: str, r: Any, miss: Any) -> list[str]:
    """The job's steps, whether its write is fenced, its round trips (counted), its rate."""
    what, fenced = c.JOB_DESC[subject]
    steps = [c.BASE_JOB[store] if subject == c.BASE else what, fenced]
    if r is None:
        return [*steps, "", miss["status"], ""]
    trips = r.get("round_trips")
    trips = "in-process" if trips is None else f"{trips:g}" + (" txn" if store == "sqlite" else "")
    return [*steps, trips, fmt_rate(r["value"]), ratio_text(r)]


def markdown(data: dict[str, Any], png: str) -> str:
    """The page of a run's JSON (``png``: the chart, relative to the page): its blocks
    separated by blank lines, without the sections whose optional table has no rows."""
    m, stores, cfg = data["meta"], data["stores"], data["meta"]["config"]
    versions = {"redis-server": "(not run)", "postgresql": "(not run)", **m["versions"]}
    load, cpus = m["load_average_start"][0], m["cpu_count"]
    unc = [r for r in data["results"] if r["scenario"] == c.UNC and r.get("round_trips")]
    counted = [s for s in stores if any(r["store"] == s for r in unc)]
    peers = [
        [name, p["version"] or "—", p["status"], ", ".join(c.TITLE[s] for s in p["stores"]) or "—",
         p["notes"] + "".join(f"; failed on {f}" for f in p["failures"])]
        for name, p in data["peers"].items()
    ]  # fmt: skip
    waits = [
        [c.TITLE[s], subject, ms(w["handoff_gap_median_ms"]), f"{w['count']:.0f}"]
        for s, ours in data.get("single_waiter", {}).items()
        for subject, w in {c.OURS: ours, **data.get("single_waiter_peers", {}).get(s, {})}.items()
    ]
    missed: dict[tuple[str, ...], list[str]] = {}  # the first of each scenario, store, subject
    for n in data["not_run"]:
        where = f"{n['scenario']}, {n['operation']}"
        row = [c.TITLE[n["store"]], where, n["subject"], n["status"], n["why"].replace("|", "/")]
        missed.setdefault(tuple(n[k] for k in c.KEYS), row)
    loads = [", ".join(f"{v:.2f}" for v in m[f"load_average_{k}"]) for k in ("start", "end")]
    drivers = ", ".join(f"{k} {versions[k]}" for k in DRIVERS if versions.get(k))
    blocks = [
        "# idemlock benchmarks",
        f"Generated by `{m['command']}` on {m['date']} in {m['wall_seconds']:.0f} s "
        f"({'quick' if m['quick'] else 'full'} configuration), on throwaway servers. **Every "
        "figure is a ratio against a baseline measured in the same run**: the raw driver doing "
        f"the same work in the same round trips (below); above 1.00{X} is faster. Subjects run "
        f"interleaved ({cfg['rounds']} rounds) and a ratio is the median of the per-round "
        "ratios, so drift on a shared machine moves every side alike; rates in brackets are "
        "medians, for scale only; idemlock's rows are in bold.",
        "## Machine",
        "| | |\n| --- | --- |\n"
        f"| CPUs | {cpus} {X} {m['cpu_model']} |\n"
        f"| load average at start (1, 5, 15 min) | {loads[0]} |\n"
        f"| load average at end (1, 5, 15 min) | {loads[1]} (the run itself keeps both cores "
        "busy) |\n"
        f"| system | {m['platform']} |\n"
        f"| Python | {m['python']} |\n"
        f"| idemlock | {versions['idemlock']} |\n"
        f"| Redis | redis-server {versions['redis-server']} (standalone; Cluster: 3 masters, no "
        "replicas), no persistence |\n"
        f"| PostgreSQL | {versions['postgresql']} (fsync, synchronous_commit, full_page_writes "
        "off: throwaway data) |\n"
        f"| SQLite | {versions['sqlite']} (WAL, synchronous=NORMAL) |\n"
        f"| drivers | {drivers} |\n"
        f"| configuration | {cfg['n']} pairs {X} {cfg['rounds']} rounds per subject, "
        f"{cfg['job_n']} jobs per round{SCALED if cfg['scaled'] else ''}, contention runs of "
        f"{cfg['seconds']:g} s, round trips counted over {cfg['count']} operations |",
        f"> The machine was busy when the run started (load {load:.2f} on {cpus} CPUs): "
        "absolute rates are low, ratios still pair rounds."
        if load > cpus * 0.5
        else "",
        "## Peers",
        table("peer|version|status|stores|notes", peers),
        "## Baselines",
        table(f"store|baseline (1.00{X})", [[c.TITLE[s], c.BASELINES[s]] for s in stores]),
        f"![ratios to the baseline per scenario and store]({png})",
        "## Uncontended: sync, one thread",
        "Pairs per second (acquire+release of one key; claim+complete of a new key each time), "
        "and this process's CPU time per pair (steadier than the rate on a busy machine). The "
        "store port: idemlock's store adapter called directly; its SQL, raw driver: the "
        "store's own statements and arguments through the raw driver (SQLite: each in the "
        "baseline's transaction; PostgreSQL: prepared, as the store sends them).",
        wide(data, [c.UNC], stores),
        "Round trips per pair, counted (SQLite: transactions):",
        wide(data, [c.UNC], counted, trips=True),
        "## asyncio: 1 task and 100 concurrent tasks",
        "The same pairs on the asyncio API, over 1 task or 100 (each its own lock key), against "
        "the raw asyncio driver (SQLite: transactions in asyncio.to_thread; memory: the dict); "
        "the store port alone next to the API. CPU: this process's, all threads, per pair.",
        wide(data, [c.AIO1, c.AIO100], stores),
        "## Contended hand-off",
        "4 processes (threads for the memory store) take turns on one lock, holding it ~1 ms, "
        f"for {cfg['seconds']:g} s; idemlock (asyncio): each process acquires through "
        "idemlock.aio on its own event loop. Hand-offs: acquisitions by a contender already "
        "waiting at the release; gap: release to the next acquisition (hand-off gap: of the "
        "hand-offs alone); worst wait: the longest any contender waited; overlapping holds: "
        "acquisitions made before an earlier holder released (mutual exclusion broken), 0 for "
        "a correct lock.",
        long(data, (c.HAND, c.HAND_OP), HAND_COLUMNS, 2, hand_cells),
        "redis-py's Lock polls every 0.1 s and fencekit's every 50 ms (as shipped); "
        "python-redis-lock wakes waiters through a signal list; idemlock notifies the longest "
        "waiter (pub/sub on Redis, LISTEN/NOTIFY on PostgreSQL, a condition in-process; SQLite "
        "waiters in other processes poll with a short jittered backoff).",
        "## Idempotent job, end to end",
        "Claim the key, write the effect guarded by the claim's fence, record the result. Round "
        "trips are counted: on Redis, requests written to its sockets; on PostgreSQL, "
        "request/response turns through a counting TCP relay, whatever the driver; on SQLite, "
        'transactions. "fenced: no": the write has no fencing token, so a worker paused past '
        "its lease can still land it late.",
        long(data, (c.JOB, c.JOB_OP), JOB_COLUMNS, 4, job_cells),
        "## Single waiter",
        "One holder and one waiter (2 processes, each holding the lock 2 ms, then off it "
        "0.5 ms): the median gap from the holder's release to the waiter's acquisition, for "
        "every lock that ran the contended hand-off.",
        table("store|subject|gap median|acquisitions", waits, 2, optional=True),
        "## Redis memory per key",
        "`MEMORY USAGE` of one key, as stored.",
        table("what|bytes", data.get("redis_memory") or [], optional=True),
        "## Not run",
        table("store|scenario|subject|status|why", list(missed.values()), optional=True),
        "## Reproduce",
        REPRODUCE,
        "It needs `redis-server`, `redis-cli` and the PostgreSQL server binaries, and starts "
        "its own servers (`tests/servers/`, shared with the tests). The figures are in "
        "`docs/benchmarks.json`.",
        "In `benchmarks/`: `subjects/` (an adapter per store: its raw baseline; the peers), "
        "`scenarios.py` (each scenario once), `report.py` (runs them, writes the JSON), "
        "`render.py` (this page, the chart); `goals.py`, `scale.py`, `costs.py` (its `steps` "
        "in `step_costs.py`) and `chaos.py` (over `faults/`) are the others.",
    ]
    page = "\n\n".join(b for b in blocks if b) + "\n"
    return "\n## ".join(s for s in page.split("\n## ") if OMIT not in s)


#: the chart's colour of each subject but the baseline, in the order of c.SUBJECTS
PALETTE = "#1f5fbf #9ecae1 #c6dbef #6fa8ff #0b3b80 #17becf #d62728 #ff7f0e #2ca02c #9467bd #8c564b"
COLORS = dict(zip(c.SUBJECTS[1:], PALETTE.split(), strict=True))
#: the chart's label of each scenario: its operation and how it ran, or its name
HOW = {c.UNC: "sync", c.AIO1: f"asyncio {X}1", c.AIO100: f"asyncio {X}100"}
SHORT = {
    (sc, op): f"{op}\n{HOW[sc]}" if sc in HOW else sc.replace(" ", "\n") for sc, op in c.SCENARIOS
}
#: the chart's name of each store's baseline
BASELINE_SHORT = {
    "memory": "dict + threading.Lock",
    "sqlite": "raw sqlite3, same transactions",
    "redis": "raw redis-py EVALSHA, same round trips",
    "redis-cluster": "raw RedisCluster EVALSHA, same round trips",
    "postgres": "raw psycopg, same statements",
}


def chart(data: dict[str, Any], path: Path) -> None:
    """One panel per store; in each, one group of bars per scenario (idemlock's
    variants and the peers that ran it), as ratios to that store's baseline (the
    dashed line), on a log scale so 0.5x and 2x are as far from it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    stores, height = data["stores"], 2.9 * len(data["stores"]) + 1.3
    fig, axes = plt.subplots(len(stores), 1, figsize=(13, height), squeeze=False)
    handles: dict[str, Any] = {}
    for ax, store in zip(axes[:, 0], stores, strict=True):
        rows = [r for r in data["results"] if r["store"] == store and r["subject"] != c.BASE]
        ratios = [r["ratio"] for r in rows]
        for i, key in enumerate(c.SCENARIOS):
            group = [r for r in rows if (r["scenario"], r["operation"]) == key]
            group.sort(key=lambda r: c.SUBJECTS.index(r["subject"]))
            width = min(0.2, 0.84 / max(1, len(group)))
            for j, r in enumerate(group):
                x = i + (j - (len(group) - 1) / 2) * width
                bar = ax.bar(x, r["ratio"], width * 0.9, color=COLORS[r["subject"]], zorder=3)
                handles.setdefault(r["subject"], bar)
                if r["role"] == "idemlock":
                    ax.annotate(f"{r['ratio']:.2f}", (x, r["ratio"]), ha="center",
                                va="bottom", fontsize=7, xytext=(0, 1),
                                textcoords="offset points")  # fmt: skip
        ax.axhline(1.0, color="black", linewidth=1.0, linestyle="--", zorder=2)
        ax.set(yscale="log", ylim=(min([*ratios, 0.8]) / 1.5, max([*ratios, 1.25]) * 1.5))
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
        ax.set_xticks(range(len(c.SCENARIOS)), [SHORT[k] for k in c.SCENARIOS], fontsize=8)
        ax.set(xlim=(-0.55, len(c.SCENARIOS) - 0.45), ylabel=f"{X} baseline")
        ax.set_title(f"{c.TITLE[store]}  (1 = {BASELINE_SHORT[store]})", fontsize=10, loc="left")
        ax.grid(axis="y", which="major", alpha=0.3, zorder=0)
        ax.set_axisbelow(True)
        for i in range(1, len(c.SCENARIOS)):
            ax.axvline(i - 0.5, color="#dddddd", linewidth=0.6, zorder=1)
    order = [s for s in c.SUBJECTS if s in handles]
    title = (
        "idemlock and its peers: throughput as a ratio to the raw driver measured in the "
        "same run (dashed line = 1; higher is faster; log scale)"
    )
    fig.suptitle(title, fontsize=11, y=0.995)
    fig.legend([handles[s] for s in order], order, loc="upper center", ncol=5, fontsize=9,
               frameon=False, bbox_to_anchor=(0.5, 0.975))  # fmt: skip
    fig.tight_layout(rect=(0, 0, 1, 1 - 1.1 / height))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(data: dict[str, Any], json_path: Path, out: Path, png: Path) -> None:
    """The JSON, the chart and the page; its goals and scale sections (goals.py, scale.py)
    are kept."""
    for r in data["results"]:  # NaN (no gap measured) is not valid JSON
        r.update([(k, None) for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)])
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    chart(data, png)
    out.parent.mkdir(parents=True, exist_ok=True)
    text = out.read_text() if out.exists() else ""
    kept = [goals_section(text), goals_section(text, c.SCALE_START, c.SCALE_END)]
    page = markdown(data, os.path.relpath(png, out.parent))
    out.write_text(page + "".join(f"\n{k}\n" for k in kept if k))


def goals_section(text: str, first: str = c.GOALS_START, last: str = c.GOALS_END) -> str:
    """The goals section (or another between ``first`` and ``last``) of a Markdown file's
    text, markers included ("" if none)."""
    start, end = text.find(first), text.find(last)
    return text[start : end + len(last)] if 0 <= start < end else ""


def add_paths(parser: argparse.ArgumentParser, *names: str) -> None:
    """The options ``--out`` (the page), ``--json`` and ``--png``, in docs/ by default."""
    for name in names:
        ext = "md" if name == "out" else name
        parser.add_argument(f"--{name}", type=Path, default=c.DOCS / f"benchmarks.{ext}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_paths(parser, "json", "out", "png")
    args = parser.parse_args(argv)
    write(json.loads(args.json.read_text()), args.json, args.out, args.png)
    print(f"wrote {args.out}, {args.png}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
