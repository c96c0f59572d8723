"""Issue 13's performance goals, measured in one command, each next to its baseline.

    python benchmarks/goals.py [--quick | --smoke] [--json PATH] [--doc PATH]

Starts its own throwaway servers and prints one Markdown table: every goal of the issue as
a same-round ratio (the median of per-round ratios of subjects run interleaved) to the
baseline it names, the goal, the figure at filing and MEETS or SHORT of goal by how much.
Reference rows (no goal): the bare-socket limit (the minimal pair as pre-encoded EVALSHA
on a plain socket) and coredis and valkey-glide next to redis.asyncio.
``--quick`` is the CI configuration: noisy figures; ``--smoke`` the smallest one
(tests/test_goals.py): every goal measured and judged, the figures meaningless.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import namedtuple
from dataclasses import asdict, dataclass, field
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the tests' servers, then common and subjects

import common as c  # noqa: E402
import redis.asyncio  # noqa: E402
from render import fmt_rate, goals_section, table  # noqa: E402
from scenarios import Contenders, single_waiter, start_benches  # noqa: E402
from subjects import base as subj  # noqa: E402
from subjects.peers import fencekit_job  # noqa: E402

import idemlock.aio  # noqa: E402

#: pairs per round, interleaved rounds, jobs per round, seconds of each contention run,
#: fresh interpreters timed each way
Config = namedtuple("Config", "n rounds job_n seconds imports")
FULL, QUICK = Config(1000, 7, 500, 5.0, 15), Config(100, 2, 50, 0.5, 2)
#: one round of the fewest pairs the 100-task runs take, contention runs long enough for
#: every process to hold the lock on a loaded machine, one interpreter timed each way
SMOKE = Config(100, 1, 20, 0.4, 1)

#: a user's smallest scripts: a fenced acquire (the lock, its fence counter; the owner's
#: token, the lease), a compare-and-delete, a compare-and-set of the result
SCRIPTS = (
    "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then\n"
    "  return redis.call('INCR', KEYS[2])\nend\nreturn false",
    "if redis.call('GET', KEYS[1]) == ARGV[1] then\n"
    "  return redis.call('DEL', KEYS[1])\nend\nreturn 0",
    "if redis.call('GET', KEYS[1]) == ARGV[1] then\n"
    "  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])\n  return 1\nend\nreturn 0",
)


# ---- raw Redis subjects ----------------------------------------------------------------


def minimal(who: str, r: Any, call: Any = None) -> dict[str, c.SyncFn]:
    """The hand-written pairs "<who> lock" and "<who> claim": EVALSHA of SCRIPTS through
    ``call`` (redis-py's, or a socket's)."""
    acquire, release, complete = (r.script_load(s) for s in SCRIPTS)
    call, ns, owner = call or r.evalsha, c.new_prefix("min"), uuid.uuid4().hex

    def lock_pairs(count: int) -> None:
        lock = f"{ns}:l"
        for _ in range(count):
            if call(acquire, 2, lock, lock + ":f", owner, 30_000) is None:
                raise RuntimeError("minimal baseline: lock not acquired")
            call(release, 1, lock, owner)

    def claim_pairs(count: int) -> None:
        tag = uuid.uuid4().hex[:6]
        for i in range(count):
            key, token = f"{ns}:c:{tag}-{i}", uuid.uuid4().hex
            if call(acquire, 2, key, key + ":f", token, 300_000) is None:
                raise RuntimeError("minimal baseline: key already claimed")
            call(complete, 1, key, token, c.RESULT_BYTES, 3_600_000)

    return {f"{who} lock": lock_pairs, f"{who} claim": claim_pairs}


def socket_evalsha(port: int, stack: contextlib.ExitStack) -> Any:
    """EVALSHA on a plain socket: the physical limit. Repeated commands are encoded once."""
    sock = stack.enter_context(socket.create_connection(("127.0.0.1", port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    @lru_cache(maxsize=8)
    def encode(*parts: Any) -> bytes:
        out = [b"*%d\r\n" % len(parts)]
        for p in parts:
            b = p if isinstance(p, bytes) else str(p).encode()
            out.append(b"$%d\r\n%s\r\n" % (len(b), b))
        return b"".join(out)

    def call(*args: Any) -> bytes | None:
        sock.sendall(encode("EVALSHA", *args))
        reply = sock.recv(4096)
        while not reply.endswith(b"\r\n"):  # every reply here is one line
            reply += sock.recv(4096)
        return None if reply[:1] in (b"$", b"_") else reply  # nil: not acquired

    return call


async def set_del(label: str, port: int, stack: contextlib.AsyncExitStack) -> tuple[str, c.Make]:
    """An asyncio client's name (with its version) and its SET NX PX 30 s + DEL pairs."""
    if label == "redis.asyncio":
        ar = redis.asyncio.Redis(port=port, **c.CLIENT)
        stack.push_async_callback(ar.aclose)
        setnx, delete = (lambda k: ar.set(k, "x", nx=True, px=30_000)), ar.delete
    elif label == "coredis":
        import coredis

        cr: Any = coredis.Redis(host="127.0.0.1", port=port)
        with contextlib.suppress(AttributeError, TypeError):
            await stack.enter_async_context(cr)  # coredis 5+: the client is a context
        label, nx = f"coredis {coredis.__version__}", coredis.PureToken.NX
        setnx = lambda k: cr.set(k, "x", condition=nx, px=30_000)  # noqa: E731
        delete = lambda k: cr.delete([k])  # noqa: E731
    else:
        import glide as g

        config = g.GlideClientConfiguration([g.NodeAddress("127.0.0.1", port)])
        gc = await g.GlideClient.create(config)
        stack.push_async_callback(gc.close)
        ex, nx = (
            g.ExpirySet(g.ExpiryType.MILLSEC, 30_000),
            g.ConditionalChange.ONLY_IF_DOES_NOT_EXIST,
        )
        label = f"valkey-glide {c.version('valkey-glide')}"
        setnx = lambda k: gc.set(k, "x", conditional_set=nx, expiry=ex)  # noqa: E731
        delete = lambda k: gc.delete([k])  # noqa: E731

    async def make(t: int, count: int) -> None:
        for _ in range(count):
            assert await setnx(f"{label}:{t}")
            await delete(f"{label}:{t}")

    return label, make


# ---- measuring: each section returns its goals' figures, by the key GOALS names --------
# A figure is (text, [one value per part of the goal]) or, when it could not be measured,
# the reason; ``{}`` in the text is the first value, shown by ``judge`` with enough digits
# to tell it from the goal (0.996 is not 1.00).


def rate(rates: c.Rates, name: str) -> str:
    return fmt_rate(statistics.median(rates[name])) + "/s"


def vs(rates: c.Rates, ours: str, base: str) -> tuple[str, list[float]]:
    """The same-round ratio of two subjects."""
    return f"{{}} ({rate(rates, ours)} vs {rate(rates, base)})", [c.ratio(rates, ours, base)]


def cs_vs(a: dict[str, float], b: dict[str, float], fair: str = "") -> tuple[str, list[float]]:
    """Critical sections/s of a contention run against its baseline's; with ``fair`` (the
    baseline's label), the hand-off share and worst wait as goals too."""
    text = f"{{}} ({a['cs_per_s']:.0f} vs {b['cs_per_s']:.0f}/s)"
    if not fair:
        return text, [a["cs_per_s"] / b["cs_per_s"]]
    text += f", hand-offs {a['handoff_share']:.0%}, worst wait {a['worst_wait_ms']:.1f} ms"
    text += f" ({fair}: {b['handoff_share']:.0%}, {b['worst_wait_ms']:.1f} ms)"
    return text, [a["cs_per_s"] / b["cs_per_s"], a["handoff_share"] * 100, a["worst_wait_ms"]]


def measure_redis(t: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """The sync pairs against the minimal and bare-socket ones, and the crash-safe job."""
    with contextlib.ExitStack() as stack:
        r = stack.enter_context(redis.Redis(port=t["ports"][0], **c.CLIENT))
        coord = stack.enter_context(idemlock.connect(t["url"], key_prefix=c.new_prefix()))
        fns = {"ours lock": subj.ours_lock_pairs(coord), "ours claim": subj.ours_claim_pairs(coord)}
        fns |= minimal("raw", r) | minimal("socket", r, socket_evalsha(t["ports"][0], stack))
        sync = c.interleave(fns, cfg.n, cfg.rounds)
        f = {"sync": sync, "sync lock": vs(sync, "ours lock", "raw lock")}
        f["sync claim"] = vs(sync, "ours claim", "raw claim")
        jobs = {"3 trips": subj.ours_job(coord), "2 trips": subj.ours_job_together(coord)}
        try:
            jobs["fencekit"] = fencekit_job(r, prefix=c.new_prefix("fkj"))
            jobs["fencekit"](1)
        except Exception as exc:  # not installed or broken: the rows say so
            why = f"not measured: fencekit could not run ({c._why(exc)}; pip install fencekit)"
            return f | {"job 3": why, "job 2": why}
        rates = c.interleave(jobs, cfg.job_n, cfg.rounds)
        return f | {f"job {n}": vs(rates, f"{n} trips", "fencekit") for n in (3, 2)}


async def measure_async(t: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """100 tasks: idemlock's acquire+release, and SET NX PX + DEL on each asyncio client."""
    async with contextlib.AsyncExitStack() as stack:
        coord = idemlock.aio.connect(t["url"], key_prefix=c.new_prefix())
        stack.push_async_callback(coord.close)
        makes, notes = {"idemlock": subj.aio_lock(coord)}, {}
        for label in ("redis.asyncio", "coredis", "valkey-glide"):
            try:
                name, make = await set_del(label, t["ports"][0], stack)
                await make(0, 2)
                makes[name] = make
            except Exception as exc:  # the row says why
                notes[label] = f"could not run: {c._why(exc)}"
        await makes["idemlock"](0, 1)
        fans = {k: c.fan_out(mk, 100) for k, mk in makes.items()}
        aio = await c.ainterleave(fans, cfg.n, cfg.rounds)
        return {"aio": aio, "aio notes": notes, "asyncio": vs(aio, "idemlock", "redis.asyncio")}


def measure_contention(cs: Contenders, benches: dict[str, Any], cfg: Config) -> dict[str, Any]:
    def run(store: str, kind: str) -> dict[str, float]:
        return cs.contend(benches[store], kind, cfg.seconds)

    def fifo(f: dict[str, float]) -> tuple[str, list[float]]:
        wait = f["worst_wait_ms"]
        return f"{wait:.1f} ms, hand-offs {f['handoff_share']:.0%}", [wait]

    redis_, lock = run("redis", c.OURS), run("redis", c.RPY)
    waiter = single_waiter(benches["redis"], cfg, cs)
    cluster, cluster_base = run("redis-cluster", c.OURS), run("redis-cluster", c.BASE)
    pg, advisory = run("postgres", c.OURS), run("postgres", c.BASE)
    gap = waiter["handoff_gap_median_ms"]
    return {
        "contention": cs_vs(redis_, lock, "Lock"),
        "waiter": (f"{gap:.2f} ms ({waiter['count']:.0f} acquisitions)", [gap]),
        "cluster": cs_vs(cluster, cluster_base),
        "pg contention": cs_vs(pg, advisory, "advisory"),
        "memory": fifo(run("memory", c.OURS)),
        "SQLite": fifo(run("sqlite", c.OURS)),
    }


def measure_sql(benches: dict[str, Any], cfg: Config) -> dict[str, Any]:
    f = {}
    for store, op in itertools.product(("postgres", "sqlite"), (c.CLAIM_OP, c.LOCK_OP)):
        bench = benches[store]
        with contextlib.ExitStack() as stack:
            fns = bench.sync_fns(op, bench.target(), stack, c.Results())
            rates = c.interleave({k: fns[k] for k in (c.BASE, c.OURS)}, cfg.n, cfg.rounds)
            f[f"{c.TITLE[store]} {op}"] = vs(rates, c.OURS, c.BASE)
    return f


def measure_import(cfg: Config) -> dict[str, Any]:
    """A fresh interpreter's ``import idemlock`` (ms), every module's bytecode cached in a
    private PYTHONPYCACHEPREFIX (as after pip install), then with idemlock's removed so it
    compiles from source: stale or missing __pycache__ directories decide neither."""
    code = "import time; t = time.perf_counter(); import idemlock; print(time.perf_counter() - t)"
    argv = [sys.executable, "-c", code]
    with tempfile.TemporaryDirectory(prefix="idemlock-pyc-") as cache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = cache

        run = partial(subprocess.run, argv, env=env, capture_output=True, check=True, text=True)

        def ms(runs: int) -> float:
            return statistics.median(float(run().stdout) for _ in range(runs)) * 1000

        ms(1)  # writes the cache; the timed runs below only read it
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        cached = ms(cfg.imports)
        shutil.rmtree(Path(cache, *Path(idemlock.__file__).parent.parts[1:]))
        cold = ms(cfg.imports)
    text = f"{cached:.0f} ms with bytecode cached (judged), {cold:.0f} ms compiling idemlock"
    return {"import": (text, [cached])}


# ---- the goals: figure, baseline, goal, at filing, measured -----------------------------

#: figure | baseline | goal | at filing | its measured figure (a key of a section's), in
#: the issue's order
GOALS = """
Redis acquire+release, sync | raw redis-py minimal-script pair | ≥ 1.0× | 0.73× | sync lock
Redis claim+complete, sync | raw redis-py minimal-script pair | ≥ 1.0× | 0.64× | sync claim
asyncio, 100 tasks: acquire+release | ASYNC_BASE | ≥ 3.0× | 0.67-0.72× | asyncio
crash-safe job: claim, fenced write, complete: 3 round trips | FK | ≥ 3.0× | 1.44× | job 3
crash-safe job: claim, complete(writes=...): 2 round trips | FK | ≥ 3.0× | — | job 2
contention, Redis, 4 processes, 1 ms holds: critical sections/s | redis-py's Lock \
| ≥ 1.0×, ≥ 90% hand-offs, ≤ 50 ms worst wait | 0.76× | contention
single waiter (Redis): median gap from release to acquire | — | ≤ 1 ms | 1.2 ms | waiter
PostgreSQL claim+complete, sync | PG | ≥ 0.9× | 0.70× | PostgreSQL claim+complete
PostgreSQL acquire+release, sync | PG | ≥ 0.9× | 0.76× | PostgreSQL acquire+release
SQLite claim+complete, sync | SQLITE | ≥ 0.9× | 0.54× | SQLite claim+complete
SQLite acquire+release, sync | SQLITE | ≥ 0.9× | 0.83× | SQLite acquire+release
`import idemlock`, fresh interpreter | — | ≤ 50 ms | 109 ms | import
contention, Redis Cluster: critical sections/s | SET NX PX retried every 1 ms | ≥ 0.8× \
| 0.30× | cluster
contention, PostgreSQL: hand-offs, worst wait | pg_advisory_lock \
| ≥ 90% hand-offs, ≤ 50 ms worst wait | 46%, 274 ms | pg contention
fairness, memory, 4 contenders: worst wait | FIFO | ≤ 100 ms | 5 s | memory
fairness, SQLite, 4 contenders: worst wait | FIFO | ≤ 100 ms | 5 s | SQLite
"""  # noqa: RUF001
NAMES = {
    "FK": "fencekit's job (guard, lock, fenced set, mark done, release)",
    "PG": "2 raw psycopg INSERT … ON CONFLICT",
    "SQLITE": "2 raw sqlite3 transactions",
    "ASYNC_BASE": "raw redis.asyncio SET NX PX + DEL pair",
}


@dataclass
class Row:
    figure: str
    baseline: str
    measured: str
    goal: str = "—"  # none: a reference row
    filed: str = "—"  # the figure when it was filed
    short: list[str] = field(default_factory=list)  # unmet parts of the goal
    reference: bool = False
    verdict: str = ""

    def __post_init__(self) -> None:
        self.reference = self.goal == "—"
        unmet = "SHORT of goal by " + "; ".join(self.short) if self.short else "MEETS"
        self.verdict = "reference" if self.reference else unmet


def shown(value: float, unit: str, other: float = 0.0) -> str:
    """``value`` with enough digits to tell it from ``other`` (0.996 is not 1.00)."""
    d = {c.X: 2, "%": 0}.get(unit, 1)
    while d < 6 and value != other and round(value, d) == round(other, d):
        d += 1
    return f"{value:.{d}f}{'' if unit in (c.X, '%') else ' '}{unit}"


def judge(line: str, f: dict[str, Any]) -> Row:
    """The row of one line of GOALS: measured, and each part of its goal checked."""
    figure, baseline, goal, filed, key = (NAMES.get(x, x) for x in line.split(" | "))
    if isinstance(f[key], str):
        return Row(figure, baseline, f[key], goal, filed, ["the whole goal (not measured)"])
    parts = [
        re.fullmatch(rf"([≥≤]) ([\d.]+) ?({c.X}|%|ms)(?: (.*))?", p).groups()
        for p in goal.split(", ")
    ]
    limits = [float(limit) for _, limit, _, _ in parts]
    text, values = f[key]
    short = [
        shown(abs(value - limit), unit) + (f" {what}" if what else "")
        # PostgreSQL's contention goal has no throughput part: the last values are judged
        for value, (op, _, unit, what), limit in zip(
            values[-len(parts) :], parts, limits, strict=True
        )
        if not (value >= limit if op == "≥" else value <= limit)  # NaN (none measured): short
    ]
    return Row(figure, baseline, text.format(shown(values[0], c.X, limits[0])), goal, filed, short)


def references(f: dict[str, Any]) -> list[Row]:
    sync, aio, notes = f["sync"], f["aio"], f["aio notes"]
    rows = []
    for name, op in (("lock", c.LOCK_OP), ("claim", c.CLAIM_OP)):
        ours, raw = (c.ratio(sync, f"{who} {name}", f"socket {name}") for who in ("ours", "raw"))
        limit = f"bare-socket EVALSHA loop ({rate(sync, f'socket {name}')})"
        text = f"idemlock {ours:.0%}, raw redis-py {raw:.0%}"
        rows.append(Row(f"Redis {op}, sync: share of the physical limit", limit, text))
    for name in [k for k in aio if k not in ("idemlock", "redis.asyncio")] + list(notes):
        text = notes.get(name) or (
            f"{c.ratio(aio, name, 'redis.asyncio'):.2f}{c.X} ({rate(aio, name)}); "
            f"idemlock / it: {c.ratio(aio, 'idemlock', name):.2f}{c.X}"
        )
        figure = f"asyncio, 100 tasks: SET NX PX + DEL on {name}"
        rows.append(Row(figure, NAMES["ASYNC_BASE"], text))
    return rows


# ---- output -----------------------------------------------------------------------------


def goal_table(rows: list[Row]) -> str:
    cells = [[r.figure, r.baseline, r.measured, r.goal, r.filed, r.verdict] for r in rows]
    met = sum(r.verdict == "MEETS" for r in rows)
    text = table("figure|baseline|measured|goal|at filing|verdict", cells)
    return f"{text}\n\n{met} of {sum(not r.reference for r in rows)} goals met"


def write_doc(path: Path, rows: list[Row], how: str) -> None:
    """Replace (or add, at the end) the goals section of ``path``."""
    section = (
        f"{c.GOALS_START}\n## Issue 13's goals\n\nGenerated by {how}. Each figure is a same-round "
        'ratio to the baseline it names (the median of per-round ratios); "at filing" is the '
        "issue's figure. Reference rows have no goal: the bare-socket limit (the minimal pair as "
        "pre-encoded EVALSHA on a plain socket) and the asyncio clients measured as "
        f"alternatives to redis.asyncio.\n\n{goal_table(rows)}.\n{c.GOALS_END}"
    )
    text = path.read_text() if path.exists() else ""
    old = goals_section(text)
    path.write_text(text.replace(old, section) if old else f"{text.rstrip()}\n\n{section}\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    configs = parser.add_mutually_exclusive_group()
    configs.add_argument("--quick", action="store_true", help="short configuration (CI)")
    configs.add_argument("--smoke", action="store_true", help="smallest configuration (tests)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument("--doc", type=Path, help="write the table into this file's goals section")
    args = parser.parse_args(argv)
    cfg = SMOKE if args.smoke else QUICK if args.quick else FULL
    mode = " --smoke" if args.smoke else " --quick" if args.quick else ""
    started, load = time.monotonic(), os.getloadavg()[0]
    print(f"idemlock goals: {cfg._asdict()}; load average {load:.2f}", flush=True)
    f: dict[str, Any] = {}
    with c.Servers("idemlock-goals-") as servers:
        benches = start_benches(servers, list(c.STORES))
        cs, rt = Contenders(), benches["redis"].target()
        servers.callback(cs.close)
        for title, section in (
            ("Redis, sync and the crash-safe job", lambda: measure_redis(rt, cfg)),
            ("asyncio", lambda: asyncio.run(measure_async(rt, cfg))),
            ("contention", lambda: measure_contention(cs, benches, cfg)),
            ("PostgreSQL and SQLite", lambda: measure_sql(benches, cfg)),
            ("import time", lambda: measure_import(cfg)),
        ):
            print(f"measuring: {title} ({time.monotonic() - started:.0f} s)", flush=True)
            f |= section()
    rows = [judge(line, f) for line in GOALS.replace(" \\\n", " ").strip().splitlines()]
    rows += references(f)
    took, load_end = time.monotonic() - started, os.getloadavg()[0]
    how = (
        f"`python benchmarks/goals.py{mode}` on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in {took:.0f} s ({cfg.rounds} "
        f"interleaved rounds of {cfg.n} pairs, contention runs of {cfg.seconds:g} s; load "
        f"average {load:.2f} at start, {load_end:.2f} at end, {os.cpu_count()} CPUs)"
    )
    print(f"\nmeasured {how}\n\n{goal_table(rows)}")
    if args.doc:
        write_doc(args.doc, rows, how)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
