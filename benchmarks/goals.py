"""Issue 13's performance goals, measured in one command, each next to its baseline.

    python benchmarks/goals.py [--quick] [--json PATH]

Starts its own throwaway servers (Redis, a three-master Redis Cluster, PostgreSQL; SQLite
files in a temporary directory) and prints one Markdown table: every figure of the
issue's goal table as a same-round ratio (the median of per-round ratios of subjects
run interleaved), the baseline it names, the goal, and a verdict: MEETS, or SHORT of
goal by how much. Three baselines are the issue's own:

* the raw minimal-script pair: what a user writes by hand with redis-py - one EVALSHA
  of a short SET NX PX + INCR fence script, then one compare-and-delete (claim+complete:
  the same claim script, then one compare-and-set of the result);
* the bare-socket limit: the same pair as pre-encoded EVALSHA commands written to a
  plain socket, replies read raw - what fraction of it idemlock and redis-py reach;
* asyncio alternatives: coredis and valkey-glide doing the SET NX PX + DEL pair, next
  to redis.asyncio (each says when it cannot install or run).

Rows marked "reference" have no goal. ``--quick`` is a short configuration for CI
(tests/test_goals.py): its figures are noisy and only show the command works.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _path in (str(HERE.parent), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import redis  # noqa: E402
import redis.asyncio  # noqa: E402
from common import (  # noqa: E402
    BASE,
    CLAIM_OP,
    CLIENT,
    GOALS_END,
    GOALS_START,
    LOCK_OP,
    OURS,
    RESULT_BYTES,
    RPY,
    Rates,
    Results,
    X,
    _why,
    ainterleave,
    fan_out,
    interleave,
    new_prefix,
    version,
)
from common import ratio as ratios  # noqa: E402
from render import fmt_rate, goals_section  # noqa: E402
from scenarios import Contenders, contend_threads  # noqa: E402
from subjects.base import (  # noqa: E402
    aio_lock,
    ours_claim_pairs,
    ours_job,
    ours_job_together,
    ours_lock_pairs,
)
from subjects.peers import fencekit_job  # noqa: E402
from subjects.postgres import PgBench  # noqa: E402
from subjects.redis import RedisBench  # noqa: E402
from subjects.sqlite import SqliteBench  # noqa: E402

import idemlock  # noqa: E402
import idemlock.aio  # noqa: E402

#: SET NX PX the lock and INCR its fence counter: a user's smallest fenced acquire.
ACQUIRE_LUA = """\
-- KEYS[1]: the lock, KEYS[2]: its fence counter
-- ARGV[1]: the owner's token, ARGV[2]: the lease in ms
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return false
"""
#: delete only what we own
RELEASE_LUA = """\
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
#: replace the claim by the result only while we still hold it
COMPLETE_LUA = """\
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""


@dataclass(frozen=True)
class Config:
    n: int  # pairs per round
    rounds: int
    job_n: int
    seconds: float  # each contention run
    imports: int  # fresh interpreters timed


FULL = Config(n=1000, rounds=7, job_n=500, seconds=5.0, imports=15)
QUICK = Config(n=100, rounds=2, job_n=50, seconds=0.5, imports=2)


@dataclass
class Row:
    figure: str
    baseline: str
    measured: str
    goal: str
    filed: str  # the figure when it was filed
    short: list[str] = field(default_factory=list)  # unmet parts of the goal
    reference: bool = False

    @property
    def verdict(self) -> str:
        if self.reference:
            return "reference"
        return "MEETS" if not self.short else "SHORT of goal by " + "; ".join(self.short)


def at_least(value: float, goal: float, unit: str = X, what: str = "") -> list[str]:
    if value >= goal:
        return []
    gap = f"{goal - value:.2f}{unit}" if unit == X else f"{goal - value:.0f}{unit}"
    return [f"{gap}{' ' + what if what else ''}"]


def at_most(value: float, goal: float, unit: str, what: str = "") -> list[str]:
    if value <= goal:
        return []
    return [f"{value - goal:.1f} {unit}{' ' + what if what else ''}"]


def rate(v: float) -> str:
    return fmt_rate(v) + "/s"


def median(rates: Rates, name: str) -> float:
    return statistics.median(rates[name])


def versus(
    rates: Rates, ours: str, base: str, figure: str, baseline: str, goal: float, filed: str
) -> Row:
    """A goal row: the same-round ratio of ``ours`` to ``base``, at least ``goal``."""
    v = ratios(rates, ours, base)
    measured = f"{v:.2f}{X} ({rate(median(rates, ours))} vs {rate(median(rates, base))})"
    return Row(figure, baseline, measured, f"≥ {goal:.1f}{X}", filed, at_least(v, goal))


# ---- raw Redis subjects -----------------------------------------------------------------


class Minimal:
    """The hand-written redis-py pairs: EVALSHA of the short scripts above."""

    def __init__(self, r: Any) -> None:
        self.r, self.ns = r, "min" + uuid.uuid4().hex[:6]
        self.acq, self.rel, self.com = (r.script_load(s) for s in (ACQUIRE_LUA, RELEASE_LUA,
                                                                   COMPLETE_LUA))  # fmt: skip

    def lock_pairs(self, count: int) -> None:
        r, lock, fence, owner = self.r, f"{self.ns}:l", f"{self.ns}:f", uuid.uuid4().hex
        for _ in range(count):
            if r.evalsha(self.acq, 2, lock, fence, owner, 30_000) is None:
                raise RuntimeError("minimal baseline: lock not acquired")
            r.evalsha(self.rel, 1, lock, owner)

    def claim_pairs(self, count: int) -> None:
        r, tag = self.r, uuid.uuid4().hex[:6]
        for i in range(count):
            key, token = f"{self.ns}:c:{tag}-{i}", uuid.uuid4().hex
            if r.evalsha(self.acq, 2, key, key + ":f", token, 300_000) is None:
                raise RuntimeError("minimal baseline: key already claimed")
            r.evalsha(self.com, 1, key, token, RESULT_BYTES, 3_600_000)


def resp(*parts: str | bytes | int) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


class Socket:
    """The physical limit: the minimal pairs as EVALSHA written to a plain socket."""

    def __init__(self, port: int, m: Minimal) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.m = m

    def _call(self, cmd: bytes) -> bytes:
        self.sock.sendall(cmd)
        reply = self.sock.recv(4096)
        while not reply.endswith(b"\r\n"):  # integer and nil replies: one line
            reply += self.sock.recv(4096)
        return reply

    def lock_pairs(self, count: int) -> None:
        owner, ns = uuid.uuid4().hex, self.m.ns
        acq = resp("EVALSHA", self.m.acq, 2, f"{ns}:sl", f"{ns}:sf", owner, 30_000)
        rel = resp("EVALSHA", self.m.rel, 1, f"{ns}:sl", owner)
        for _ in range(count):
            if self._call(acq)[:1] != b":":
                raise RuntimeError("socket baseline: lock not acquired")
            self._call(rel)

    def claim_pairs(self, count: int) -> None:
        tag, m = uuid.uuid4().hex[:6], self.m
        for i in range(count):
            key, token = f"{m.ns}:sc:{tag}-{i}", uuid.uuid4().hex
            self._call(resp("EVALSHA", m.acq, 2, key, key + ":f", token, 300_000))
            self._call(resp("EVALSHA", m.com, 1, key, token, RESULT_BYTES, 3_600_000))

    def close(self) -> None:
        self.sock.close()


# ---- the sections -----------------------------------------------------------------------


def redis_sync(url: str, port: int, cfg: Config) -> list[Row]:
    with contextlib.ExitStack() as stack:
        r = redis.Redis(port=port, **CLIENT)
        stack.callback(r.close)
        coord = idemlock.connect(url, key_prefix=new_prefix())
        stack.callback(coord.close)
        m = Minimal(r)
        s = Socket(port, m)
        stack.callback(s.close)
        rates = interleave(
            {
                "raw lock": m.lock_pairs, "idemlock lock": ours_lock_pairs(coord),
                "socket lock": s.lock_pairs, "raw claim": m.claim_pairs,
                "idemlock claim": ours_claim_pairs(coord), "socket claim": s.claim_pairs,
            },
            cfg.n, cfg.rounds,
        )  # fmt: skip
    rows = []
    for op, name, filed in (("acquire+release", "lock", f"0.73{X}"),
                            ("claim+complete", "claim", f"0.64{X}")):  # fmt: skip
        rows.append(versus(rates, f"idemlock {name}", f"raw {name}", f"Redis {op}, sync",
                           "raw redis-py minimal-script pair", 1.0, filed))  # fmt: skip
    for op, name in (("acquire+release", "lock"), ("claim+complete", "claim")):
        ours, raw = ratios(rates, f"idemlock {name}", f"socket {name}"), ratios(
            rates, f"raw {name}", f"socket {name}")  # fmt: skip
        rows.append(Row(
            f"Redis {op}, sync: share of the physical limit",
            f"bare-socket EVALSHA loop ({rate(median(rates, f'socket {name}'))})",
            f"idemlock {ours:.0%}, raw redis-py {raw:.0%}", "—", "—", reference=True,
        ))  # fmt: skip
    return rows


async def _alt_clients(port: int, stack: contextlib.AsyncExitStack) -> dict[str, Any]:
    """name -> make(t, count) or the reason it cannot run."""
    out: dict[str, Any] = {}
    try:
        import coredis

        cr: Any = coredis.Redis(host="127.0.0.1", port=port)
        with contextlib.suppress(AttributeError, TypeError):
            await stack.enter_async_context(cr)  # coredis 5+: the client is a context

        async def coredis_pair(t: int, count: int) -> None:
            key = f"cd:{t}"
            for _ in range(count):
                ok = await cr.set(key, "x", condition=coredis.PureToken.NX, px=30_000)
                assert ok
                await cr.delete([key])

        await coredis_pair(0, 2)
        out["coredis " + coredis.__version__] = coredis_pair
    except Exception as exc:  # reported, not fatal: the row says why
        out["coredis"] = f"could not run: {_why(exc)}"
    try:
        from glide import (
            ConditionalChange,
            ExpirySet,
            ExpiryType,
            GlideClient,
            GlideClientConfiguration,
            NodeAddress,
        )

        gc = await GlideClient.create(GlideClientConfiguration([NodeAddress("127.0.0.1", port)]))
        stack.push_async_callback(gc.close)
        expiry = ExpirySet(ExpiryType.MILLSEC, 30_000)
        nx = ConditionalChange.ONLY_IF_DOES_NOT_EXIST

        async def glide_pair(t: int, count: int) -> None:
            key = f"vg:{t}"
            for _ in range(count):
                ok = await gc.set(key, "x", conditional_set=nx, expiry=expiry)
                assert ok
                await gc.delete([key])

        await glide_pair(0, 2)
        out["valkey-glide " + (version("valkey-glide") or "?")] = glide_pair
    except Exception as exc:
        out["valkey-glide"] = f"could not run: {_why(exc)}"
    return out


async def redis_async(url: str, port: int, cfg: Config) -> list[Row]:
    async with contextlib.AsyncExitStack() as stack:
        ar = redis.asyncio.Redis(port=port, **CLIENT)
        stack.push_async_callback(ar.aclose)
        coord = idemlock.aio.connect(url, key_prefix=new_prefix())
        stack.push_async_callback(coord.close)

        async def raw_pair(t: int, count: int) -> None:
            key = f"ra:{t}"
            for _ in range(count):
                assert await ar.set(key, "x", nx=True, px=30_000)
                await ar.delete(key)

        makes: dict[str, Callable[[int, int], Awaitable[None]]] = {
            "redis.asyncio": raw_pair,
            "idemlock": aio_lock(coord),
        }
        alts = await _alt_clients(port, stack)
        makes.update((k, v) for k, v in alts.items() if not isinstance(v, str))
        for make in makes.values():
            await make(0, 1)
        rates = await ainterleave(
            {k: fan_out(mk, 100) for k, mk in makes.items()}, cfg.n, cfg.rounds
        )
    rows = [versus(rates, "idemlock", "redis.asyncio", "asyncio, 100 tasks: acquire+release",
                   "raw redis.asyncio SET NX PX + DEL pair", 3.0, f"0.67-0.72{X}")]  # fmt: skip
    for name, alt in alts.items():
        if isinstance(alt, str):
            measured = alt
        else:
            a = ratios(rates, name, "redis.asyncio")
            measured = f"{a:.2f}{X} ({rate(median(rates, name))}); idemlock / it: " + (
                f"{ratios(rates, 'idemlock', name):.2f}{X}"
            )
        rows.append(Row(f"asyncio, 100 tasks: SET NX PX + DEL on {name}",
                        "raw redis.asyncio SET NX PX + DEL pair", measured, "—", "—",
                        reference=True))  # fmt: skip
    return rows


def redis_job(url: str, port: int, cfg: Config) -> list[Row]:
    with contextlib.ExitStack() as stack:
        r = redis.Redis(port=port, **CLIENT)
        stack.callback(r.close)
        coord = idemlock.connect(url, key_prefix=new_prefix())
        stack.callback(coord.close)
        fns = {"idemlock": ours_job(coord), "idemlock (write in complete)":
               ours_job_together(coord)}  # fmt: skip
        try:
            fns["fencekit"] = fencekit_job(r, prefix=new_prefix("fkj"))
            fns["fencekit"](1)
        except Exception as exc:  # not installed or broken: said in the row
            fns.pop("fencekit", None)
            why = _why(exc)
        rates = interleave(fns, cfg.job_n, cfg.rounds)
    if "fencekit" not in rates:
        return [Row("crash-safe job (claim, fenced write, complete)", "fencekit's job",
                    f"not measured: fencekit could not run ({why}; pip install fencekit)",
                    f"≥ 3.0{X}", f"1.44{X}", ["the whole goal (not measured)"])]  # fmt: skip
    rows = []
    for name, what in (("idemlock", "claim, fenced write, complete: 3 round trips"),
                       ("idemlock (write in complete)",
                        "claim, complete(writes=...): 2 round trips")):  # fmt: skip
        rows.append(versus(rates, name, "fencekit", f"crash-safe job: {what}",
                           "fencekit's job (guard, lock, fenced set, mark done, release)",
                           3.0, f"1.44{X}" if name == "idemlock" else "—"))  # fmt: skip
    return rows


def contention(cs: Contenders, targets: dict[str, dict[str, Any]], cfg: Config) -> list[Row]:
    def run(store: str, kind: str, **kw: Any) -> dict[str, float]:
        t = {**targets[store], "prefix": new_prefix("ct")}
        return cs.run(store, kind, t, cfg.seconds, **kw)

    rows = []
    ours, rpy = run("redis", OURS), run("redis", RPY)
    v = ours["cs_per_s"] / rpy["cs_per_s"]
    rows.append(Row(
        "contention, Redis, 4 processes, 1 ms holds: critical sections/s", "redis-py's Lock",
        f"{v:.2f}{X} ({ours['cs_per_s']:.0f} vs {rpy['cs_per_s']:.0f}/s), hand-offs "
        f"{ours['handoff_share']:.0%}, worst wait {ours['worst_wait_ms']:.1f} ms (Lock: "
        f"{rpy['handoff_share']:.0%}, {rpy['worst_wait_ms']:.0f} ms)",
        f"≥ 1.0{X}, ≥ 90% hand-offs, worst wait ≤ 50 ms", f"0.76{X}",
        at_least(v, 1.0) + at_least(ours["handoff_share"] * 100, 90, "%", "hand-offs")
        + at_most(ours["worst_wait_ms"], 50, "ms", "worst wait"),
    ))  # fmt: skip
    one = run("redis", OURS, hold=0.002, procs=2, pause=0.0005)
    gap = one["handoff_gap_median_ms"]
    rows.append(Row(
        "single waiter (Redis): median gap from release to acquire", "—",
        f"{gap:.2f} ms ({one['count']:.0f} acquisitions)", "≤ 1 ms", "1.2 ms",
        at_most(gap, 1.0, "ms"),
    ))  # fmt: skip
    ours, base = run("redis-cluster", OURS), run("redis-cluster", BASE)
    v = ours["cs_per_s"] / base["cs_per_s"]
    rows.append(Row(
        "contention, Redis Cluster: critical sections/s", "SET NX PX retried every 1 ms",
        f"{v:.2f}{X} ({ours['cs_per_s']:.0f} vs {base['cs_per_s']:.0f}/s)", f"≥ 0.8{X}",
        f"0.30{X}", at_least(v, 0.8),
    ))  # fmt: skip
    ours, adv = run("postgres", OURS), run("postgres", BASE)
    rows.append(Row(
        "contention, PostgreSQL: hand-offs, worst wait", "pg_advisory_lock",
        f"{ours['handoff_share']:.0%}, {ours['worst_wait_ms']:.1f} ms, "
        f"{ours['cs_per_s'] / adv['cs_per_s']:.2f}{X} (advisory: {adv['handoff_share']:.0%}, "
        f"{adv['worst_wait_ms']:.1f} ms)", "≥ 90% hand-offs, worst wait ≤ 50 ms",
        "46%, 274 ms", at_least(ours["handoff_share"] * 100, 90, "%", "hand-offs")
        + at_most(ours["worst_wait_ms"], 50, "ms", "worst wait"),
    ))  # fmt: skip
    for store, m in (("memory", contend_threads(OURS, cfg.seconds)),
                     ("SQLite", run("sqlite", OURS))):  # fmt: skip
        rows.append(Row(
            f"fairness, {store}, 4 contenders: worst wait", "FIFO",
            f"{m['worst_wait_ms']:.1f} ms, hand-offs {m['handoff_share']:.0%}",
            "≤ 100 ms", "5 s", at_most(m["worst_wait_ms"], 100, "ms"),
        ))  # fmt: skip
    return rows


#: the issue's figures at filing
SQL_FILED = {
    ("PostgreSQL", CLAIM_OP): 0.70,
    ("PostgreSQL", LOCK_OP): 0.76,
    ("SQLite", CLAIM_OP): 0.54,
    ("SQLite", LOCK_OP): 0.83,
}


def sql_stores(benches: dict[str, Any], cfg: Config) -> list[Row]:
    rows = []
    for title, bench, base in (
        ("PostgreSQL", benches["postgres"], "2 raw psycopg INSERT … ON CONFLICT"),
        ("SQLite", benches["sqlite"], "2 raw sqlite3 transactions"),
    ):
        for op in (CLAIM_OP, LOCK_OP):
            with contextlib.ExitStack() as stack:
                fns = bench.sync_fns(op, bench.target(), stack, Results())
                rates = interleave({k: fns[k] for k in (BASE, OURS)}, cfg.n, cfg.rounds)
            rows.append(versus(rates, OURS, BASE, f"{title} {op}, sync", base, 0.9,
                               f"{SQL_FILED[title, op]:.2f}{X}"))  # fmt: skip
    return rows


def import_time(cfg: Config) -> list[Row]:
    code = "import time; t = time.perf_counter(); import idemlock; print(time.perf_counter() - t)"
    times = []
    for _ in range(cfg.imports):
        env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
        )
        times.append(float(out.stdout) * 1000)
    ms = statistics.median(times)
    return [Row("`import idemlock`, fresh interpreter", "—",
                f"{ms:.0f} ms (median of {len(times)})", "≤ 50 ms", "109 ms",
                at_most(ms, 50, "ms"))]  # fmt: skip


# ---- output -----------------------------------------------------------------------------


def table(rows: list[Row]) -> str:
    lines = ["| figure | baseline | measured | goal | at filing | verdict |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r.figure} | {r.baseline} | {r.measured} | {r.goal} | {r.filed} | "
                     f"{r.verdict} |")  # fmt: skip
    return "\n".join(lines)


def write_doc(
    path: Path, rows: list[Row], cfg: Config, quick: bool, load: Any, load_end: Any, took: float
) -> None:
    """Replace (or add, at the end) the goals section of ``path``."""
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    section = "\n".join([
        GOALS_START,
        "## Issue 13's goals",
        "",
        f"Generated by `python benchmarks/goals.py{' --quick' if quick else ''}` on {when} "
        f"in {took:.0f} s ({cfg.rounds} interleaved rounds of {cfg.n} pairs, contention "
        f"runs of {cfg.seconds:g} s; load average {load[0]:.2f} at start, "
        f"{load_end[0]:.2f} at end, {os.cpu_count()} CPUs). Each figure is a same-round "
        "ratio to the baseline it names (the median of per-round ratios); \"at filing\" "
        "is the issue's figure. Reference rows have no goal: the bare-socket limit (the "
        "minimal pair as pre-encoded EVALSHA on a plain socket) and the asyncio clients "
        "measured as alternatives to redis.asyncio.",
        "",
        table(rows),
        "",
        f"{sum(r.verdict == 'MEETS' for r in rows)} of "
        f"{sum(not r.reference for r in rows)} goals met.",
        GOALS_END,
    ])  # fmt: skip
    text = path.read_text() if path.exists() else ""
    old = goals_section(text)
    text = text.replace(old, section) if old else text.rstrip("\n") + "\n\n" + section
    path.write_text(text.rstrip("\n") + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short configuration (CI)")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--doc", type=Path, help="put the table in this Markdown file's goals section"
    )
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    from tests.servers.postgres import start_postgres
    from tests.servers.redis import start_cluster, start_redis

    started, load = time.monotonic(), os.getloadavg()
    print(f"idemlock goals ({'quick' if args.quick else 'full'}): {asdict(cfg)}; "
          f"{os.cpu_count()} cpus, load average {load[0]:.2f}", flush=True)  # fmt: skip
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="idemlock-goals-") as tmp, \
            contextlib.ExitStack() as stack:  # fmt: skip
        server = start_redis(Path(tmp) / "redis")
        stack.callback(server.stop)
        cluster = start_cluster(Path(tmp) / "cluster")
        stack.callback(cluster.stop)
        pg = start_postgres()
        stack.callback(pg.destroy)
        cs = Contenders()
        stack.callback(cs.close)
        benches = {"sqlite": SqliteBench(tmp), "postgres": PgBench(pg.dsn, pg.port)}
        rb = RedisBench(server.url, [server.port], cluster=False)
        cb = RedisBench(cluster.url, cluster.ports, cluster=True)
        targets = {"redis": rb.target(), "redis-cluster": cb.target(),
                   "postgres": benches["postgres"].target(),
                   "sqlite": benches["sqlite"].contention_target()}  # fmt: skip
        for title, section in (
            ("Redis, sync", lambda: redis_sync(server.url, server.port, cfg)),
            ("asyncio", lambda: asyncio.run(redis_async(server.url, server.port, cfg))),
            ("crash-safe job", lambda: redis_job(server.url, server.port, cfg)),
            ("contention", lambda: contention(cs, targets, cfg)),
            ("PostgreSQL and SQLite", lambda: sql_stores(benches, cfg)),
            ("import time", lambda: import_time(cfg)),
        ):
            print(f"measuring: {title}", flush=True)
            got = section()
            for r in got:
                print(f"  {r.figure}: {r.measured} -> {r.verdict}", flush=True)
            rows += got
    load_end = os.getloadavg()
    print(f"\nmeasured in {time.monotonic() - started:.0f} s, load average {load[0]:.2f} at "
          f"start, {load_end[0]:.2f} at end\n")  # fmt: skip
    print(table(rows))
    met = sum(r.verdict == "MEETS" for r in rows)
    goals = sum(not r.reference for r in rows)
    print(f"\n{met} of {goals} goals met")
    if args.doc:
        write_doc(args.doc, rows, cfg, args.quick, load, load_end, time.monotonic() - started)
    if args.json:
        args.json.write_text(json.dumps(
            [{**asdict(r), "verdict": r.verdict} for r in rows], indent=1) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
