"""What a recorded step costs (issue 25): ``attempt.step(name, fn)`` inside a claim
taken by ``port.run()``, against a hand-written fenced upsert of the same bytes on the
same kind of connection, on each store, in the same run:

    python benchmarks/costs.py steps [--n 4000] [--rounds 9] [--per_claim 10]
                                     [--stores memory,sqlite,redis,postgres,etcd] [--json PATH]
                                     [--deep 0] [--deep_claims 3]

Each side runs ``n`` steps a round (times ``SCALE``: more on the in-process stores, fewer
on etcd), ``per_claim`` of them in each claim (rounded up to whole claims); only the steps
are timed (taking and completing the claims, and the hand-written side's setup of its
fence, are not). The sides alternate round after round in a turning order, and the
ratio is the median of the per-round ratios of time per step, ours over hand-written:
1.00x is the same cost, above it ours costs more. Both sides call the same ``fn`` and
write the same bytes (idemlock's JSON frame, ``j{"v":...}``; the hand-written side
serializes the value itself with ``json.dumps`` on every step).

The hand-written fenced upsert is the smallest write that refuses an older fence:

* memory: a dict under a threading.Lock; the key's fence checked, then the row set.
* SQLite: one ``INSERT ... ON CONFLICT (key, name) DO UPDATE ... WHERE fence <=
  excluded.fence`` in autocommit (a transaction of its own), WAL, synchronous=NORMAL.
* Redis: EVALSHA of a 3-line Lua script (HGET the fence, compare, HSET fence and step)
  through redis-py.
* PostgreSQL: the same upsert as SQLite's, one prepared statement, psycopg autocommit.
* etcd: one Txn through the generated gRPC stubs: the fence key's value compared,
  the step put.

idemlock's step does more, in the same single write: it checks that the claim is still
this attempt's (its token, not only a fence), renews the claim's lease, and keeps the
key's steps alive as long as the claim (their end moved on each write).

``--deep N`` (0: not) also records N steps of 4 KiB in each of ``deep_claims`` claims,
timing every step, and reports the median µs of the first 20 steps of a claim and of
its last 20: whether a step costs more the more steps its key already has.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import threading
import time
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import common as c

import idemlock
from idemlock import FencedOut, IdempotencySpec

#: the values recorded: a small JSON object, and one of about 4 KiB
VALUES: dict[str, Any] = {
    "small": {"charge": "ch_" + "x" * 24, "amount": 1200, "currency": "eur"},
    "4 KiB": {"blob": "x" * 4080},
}
STORES = ("memory", "sqlite", "redis", "postgres", "etcd")
#: steps per round, as a multiple of --n: in-process stores take microseconds a step,
#: etcd milliseconds (every write is a Raft commit and an fsync)
SCALE = {"memory": 5, "sqlite": 2, "redis": 1, "postgres": 1, "etcd": 0.2}
SPEC = IdempotencySpec("steps")
HAND = {
    "memory": "dict under a threading.Lock: fence check, set",
    "sqlite": "INSERT ... ON CONFLICT DO UPDATE ... WHERE fence <= excluded.fence (autocommit)",
    "redis": "EVALSHA: HGET fence, compare, HSET fence + step (redis-py)",
    "postgres": "INSERT ... ON CONFLICT DO UPDATE ... WHERE fence <= excluded.fence (prepared)",
    "etcd": "Txn: compare the fence key's value, put the step (raw gRPC)",
}
#: what a side does for ``claims`` claims: (wall seconds, CPU seconds) spent in the steps
Side = Callable[[int], tuple[float, float]]
#: the hand-written write: (key, step name, fence, bytes)
Write = Callable[[str, str, int, bytes], None]
#: the hand-written side's untimed part of a claim: (key, fence)
Begin = Callable[[str, int], None]


def frame(value: Any) -> bytes:
    """The bytes a hand-written step stores: idemlock's own JSON frame of ``value``."""
    return b"j" + json.dumps({"v": value}, separators=(",", ":"), ensure_ascii=False).encode()


def ours(coord: idemlock.Coordinator, value: Any, per_claim: int, forget: bool) -> Side:
    """``per_claim`` steps in each claim of ``port.run()``; only the steps timed
    (``forget``: each key forgotten after, untimed, so an in-process store stays small)."""
    port, names = coord.idempotency(SPEC), [f"step-{i}" for i in range(per_claim)]

    def fn() -> Any:
        return value

    def run(claims: int) -> tuple[float, float]:
        tag, wall, cpu = uuid.uuid4().hex[:8], 0.0, 0.0
        for j in range(claims):
            with port.run(f"{tag}-{j}") as attempt:
                t0, p0 = time.perf_counter(), time.process_time()
                for name in names:
                    attempt.step(name, fn)
                wall += time.perf_counter() - t0
                cpu += time.process_time() - p0
                attempt.result = j
            if forget:
                port.forget(f"{tag}-{j}")
        return wall, cpu

    return run


def hand(write: Write, value: Any, per_claim: int, begin: Begin) -> Side:
    """The same steps as ``write``s of the framed value; ``begin(key, fence)``, untimed,
    stands for the claim (it sets up what the fence is checked against, if anything)."""
    names, fences = [f"step-{i}" for i in range(per_claim)], itertools.count(1)

    def fn() -> Any:
        return value

    def run(claims: int) -> tuple[float, float]:
        tag, wall, cpu = uuid.uuid4().hex[:8], 0.0, 0.0
        for j in range(claims):
            key, fence = f"{tag}-{j}", next(fences)
            begin(key, fence)
            t0, p0 = time.perf_counter(), time.process_time()
            for name in names:
                write(key, name, fence, frame(fn()))
            wall += time.perf_counter() - t0
            cpu += time.process_time() - p0
        return wall, cpu

    return run


# ---- the hand-written writes, one per store ---------------------------------------------


class MemoryHand:
    def __init__(self) -> None:
        self.mu = threading.Lock()
        self.fences: dict[str, int] = {}
        self.rows: dict[tuple[str, str], bytes] = {}

    def write(self, key: str, name: str, fence: int, data: bytes) -> None:
        with self.mu:
            cur = self.fences.get(key)
            if cur is not None and cur > fence:
                raise FencedOut(key, fence, cur)
            self.fences[key] = fence
            self.rows[key, name] = data

    def begin(self, key: str, fence: int) -> None:
        """The previous claim's rows dropped (untimed), as ours forgets its keys."""
        self.fences.clear()
        self.rows.clear()


SQ_TABLE = (
    "CREATE TABLE IF NOT EXISTS hand_steps (key TEXT NOT NULL, name TEXT NOT NULL, "
    "fence INTEGER NOT NULL, value BLOB NOT NULL, PRIMARY KEY (key, name))"
)
SQ_UPSERT = (
    "INSERT INTO hand_steps (key, name, fence, value) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (key, name) DO UPDATE SET fence = excluded.fence, value = excluded.value "
    "WHERE hand_steps.fence <= excluded.fence"
)


def sqlite_hand(path: str, stack: ExitStack) -> Write:
    import sqlite3

    conn = sqlite3.connect(path, isolation_level=None)
    stack.callback(conn.close)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute(SQ_TABLE)
    cur = conn.cursor()

    def write(key: str, name: str, fence: int, data: bytes) -> None:
        if cur.execute(SQ_UPSERT, (key, name, fence, data)).rowcount != 1:
            raise FencedOut(key, fence, None)

    return write


PG_TABLE = (
    'CREATE TABLE IF NOT EXISTS hand_steps (key text COLLATE "C" NOT NULL, '
    'name text COLLATE "C" NOT NULL, fence bigint NOT NULL, value bytea NOT NULL, '
    "PRIMARY KEY (key, name))"
)
PG_UPSERT = (
    b"INSERT INTO hand_steps AS t (key, name, fence, value) VALUES (%s, %s, %s, %s) "
    b"ON CONFLICT (key, name) DO UPDATE SET fence = excluded.fence, value = excluded.value "
    b"WHERE t.fence <= excluded.fence RETURNING 1"
)


def postgres_hand(dsn: str, stack: ExitStack) -> Write:
    import psycopg

    conn = psycopg.connect(dsn, autocommit=True)
    stack.callback(conn.close)
    conn.execute(PG_TABLE.encode())

    def write(key: str, name: str, fence: int, data: bytes) -> None:
        if conn.execute(PG_UPSERT, (key, name, fence, data), prepare=True).fetchone() is None:
            raise FencedOut(key, fence, None)

    return write


REDIS_STEP = """
local f = redis.call('HGET', KEYS[1], '')
if f and tonumber(f) > tonumber(ARGV[1]) then return 0 end
return redis.call('HSET', KEYS[1], '', ARGV[1], ARGV[2], ARGV[3]) + 1
"""


def redis_hand(url: str, stack: ExitStack) -> Write:
    import redis

    r = redis.Redis.from_url(url, **c.CLIENT)
    stack.callback(r.close)
    sha = r.script_load(REDIS_STEP)

    def write(key: str, name: str, fence: int, data: bytes) -> None:
        if not r.evalsha(sha, 1, f"hand:{key}", fence, name, data):
            raise FencedOut(key, fence, None)

    return write


def etcd_hand(endpoint: str, stack: ExitStack) -> tuple[Write, Begin]:
    """The Txn, and ``begin``: the claim's fence put where the Txn compares it."""
    import grpc

    from idemlock.stores.etcd import _codec as K
    from idemlock.stores.etcd._pb.etcdserverpb import rpc_pb2 as pb
    from idemlock.stores.etcd._pb.etcdserverpb import rpc_pb2_grpc as stubs

    channel = grpc.insecure_channel(endpoint)
    stack.callback(channel.close)
    kv = stubs.KVStub(channel)

    def begin(key: str, fence: int) -> None:
        kv.Put(pb.PutRequest(key=b"hand/f/" + key.encode(), value=b"%d" % fence), timeout=5)

    def write(key: str, name: str, fence: int, data: bytes) -> None:
        k = key.encode()
        same = K.cmp_value(b"hand/f/" + k, pb.Compare.EQUAL, b"%d" % fence)
        put = K.put(b"hand/s/" + k + b"\0" + name.encode(), data)
        if not kv.Txn(K.txn([same], [put], []), timeout=5).succeeded:
            raise FencedOut(key, fence, None)

    return write, begin


# ---- the run ----------------------------------------------------------------------------


def start(servers: c.Servers, store: str) -> dict[str, str]:
    """The store's idemlock URL and what its hand-written side connects to, its server
    started on ``servers`` (and stopped with them) as the other benchmarks do."""
    if store == "memory":
        return {"url": "memory://"}
    if store == "sqlite":
        return {"url": f"sqlite:///{servers.tmp / 'ours.db'}", "path": str(servers.tmp / "hand.db")}
    if store in ("redis", "postgres"):
        server = servers.start(store)
        return {"url": server.url if store == "redis" else server.dsn}
    if store == "etcd":
        cluster = servers.start("etcd", 1)
        return {"url": cluster.url, "endpoint": cluster.endpoints[0]}
    raise SystemExit(f"unknown store {store!r}: choose among {', '.join(STORES)}")


def nothing(key: str, fence: int) -> None:
    return None


def hand_write(store: str, t: dict[str, str], stack: ExitStack) -> tuple[Write, Begin]:
    """The store's hand-written write, and its ``begin`` (the claim's untimed part)."""
    if store == "memory":
        m = MemoryHand()
        return m.write, m.begin
    if store == "etcd":
        return etcd_hand(t["endpoint"], stack)
    if store == "sqlite":
        return sqlite_hand(t["path"], stack), nothing
    return (redis_hand if store == "redis" else postgres_hand)(t["url"], stack), nothing


def measure(
    store: str, ours_side: Side, hand_side: Side, claims: int, rounds: int
) -> dict[str, Any]:
    """Both sides, warmed up, then ``rounds`` rounds of ``claims`` claims each, the order
    turning every round: the median µs per step of each (wall and CPU), the median of the
    per-round ratios."""
    sides = {"ours": ours_side, "hand": hand_side}
    for side in sides.values():  # connections, prepared statements, scripts
        side(max(1, claims // 10))
    wall: dict[str, list[float]] = {k: [] for k in sides}
    cpu: dict[str, list[float]] = {k: [] for k in sides}
    order = list(sides)
    for r in range(rounds):
        for name in order[r % 2 :] + order[: r % 2]:
            w, u = sides[name](claims)
            wall[name].append(w)
            cpu[name].append(u)
    ratios = [o / h for o, h in zip(wall["ours"], wall["hand"], strict=True)]
    return {
        "store": store,
        "ours_us": statistics.median(wall["ours"]),
        "hand_us": statistics.median(wall["hand"]),
        "ours_cpu_us": statistics.median(cpu["ours"]),
        "hand_cpu_us": statistics.median(cpu["hand"]),
        "ratio": statistics.median(ratios),
        "ratios": ratios,
    }


def store_rows(store: str, t: dict[str, str], args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per value of ``VALUES`` on ``store`` (opened as ``t`` says)."""
    per_claim, rows = args.per_claim, []
    claims = max(1, math.ceil(args.n * SCALE[store] / per_claim))
    with ExitStack() as stack:
        coord = idemlock.connect(t["url"], key_prefix=c.new_prefix("st"))
        stack.callback(coord.close)
        write, begin = hand_write(store, t, stack)
        for size, value in VALUES.items():
            data = frame(value)
            recorded = coord.idempotency(SPEC)._records.encode("k", value)
            assert recorded == data, (recorded[:40], data[:40])  # the same bytes
            mine = ours(coord, value, per_claim, forget=store == "memory")
            row = measure(store, mine, hand(write, value, per_claim, begin), claims, args.rounds)
            for k in ("ours_us", "hand_us", "ours_cpu_us", "hand_cpu_us"):
                row[k] = row[k] / (claims * per_claim) * 1e6
            row.update(value=size, bytes=len(data), steps=claims * per_claim, rounds=args.rounds)
            rows.append(row)
            us = f"ours {row['ours_us']:.1f} µs, hand-written {row['hand_us']:.1f} µs"
            print(f"  {title(store)}, {size}: {us}, {row['ratio']:.2f}{c.X}", flush=True)
    return rows


def deep_row(store: str, t: dict[str, str], deep: int, claims: int) -> dict[str, Any]:
    """``claims`` claims of ``deep`` steps of 4 KiB each on ``store``, every step timed:
    the median µs of steps 1-20 and of the last 20 (a first claim warms up, untimed)."""
    value, edge = VALUES["4 KiB"], min(20, deep)
    first: list[float] = []
    last: list[float] = []
    with ExitStack() as stack:
        coord = idemlock.connect(t["url"], key_prefix=c.new_prefix("sd"))
        stack.callback(coord.close)
        port, names = coord.idempotency(SPEC), [f"step-{i:05d}" for i in range(deep)]

        def fn() -> Any:
            return value

        tag = uuid.uuid4().hex[:8]
        for j in range(claims + 1):
            times = []
            with port.run(f"{tag}-{j}") as attempt:
                for name in names:
                    t0 = time.perf_counter()
                    attempt.step(name, fn)
                    times.append(time.perf_counter() - t0)
                attempt.result = j
            port.forget(f"{tag}-{j}")
            if j:  # the first claim warms connections and statements up
                first += times[:edge]
                last += times[-edge:]
    row = {"store": store, "deep": deep, "claims": claims, "edge": edge}
    row |= {"first_us": statistics.median(first) * 1e6, "last_us": statistics.median(last) * 1e6}
    print(
        f"  {title(store)}, {deep} steps a claim: steps 1-{edge} {row['first_us']:.1f} µs, "
        f"steps {deep - edge + 1}-{deep} {row['last_us']:.1f} µs",
        flush=True,
    )
    return row


def deep_table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of the ``--deep`` rows: one per store."""
    lines = [
        "| store | steps a claim | µs/step, steps 1-20 | µs/step, last 20 | last ÷ first |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {title(r['store'])} | {r['deep']} | {r['first_us']:.1f} | {r['last_us']:.1f} "
            f"| {r['last_us'] / r['first_us']:.2f}{c.X} |"
        )
    return "\n".join(lines)


def steps(args: argparse.Namespace) -> None:
    """``costs.py steps``: every store's rows, printed as a table (and as JSON)."""
    report, deep, started, load = [], [], time.monotonic(), os.getloadavg()[0]
    with c.Servers("idemlock-steps-") as servers:
        for store in [s for s in args.stores.split(",") if s]:
            t = start(servers, store)
            report += store_rows(store, t, args)
            if args.deep > 0:
                deep.append(deep_row(store, t, args.deep, args.deep_claims))
    took, load_end = time.monotonic() - started, os.getloadavg()[0]
    print(
        f"\nsteps: {args.per_claim} per claim, {args.rounds} interleaved rounds, median µs per "
        f"step (wall; CPU of this process); {took:.0f} s, load average {load:.2f} -> "
        f"{load_end:.2f}\n{table(report)}"
    )
    if deep:
        print(f"\nsteps by their place in a claim ({args.deep_claims} claims)\n{deep_table(deep)}")
    if args.json:
        meta = {"per_claim": args.per_claim, "rounds": args.rounds, "n": args.n}
        meta |= {"seconds": took, "load_average": [load, load_end], "hand_written": HAND}
        body = {"meta": meta, "rows": report} | ({"deep": deep} if deep else {})
        Path(args.json).write_text(json.dumps(body, indent=1) + "\n")


def title(store: str) -> str:
    return c.TITLE.get(store, store)


def table(rows: list[dict[str, Any]]) -> str:
    """The Markdown table of ``rows``: one per store and value."""
    lines = [
        "| store | value | ours µs/step | hand-written µs/step | ours ÷ hand-written "
        "| CPU µs/step, ours / hand | hand-written |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {title(r['store'])} | {r['value']} ({r['bytes']} B) "
            f"| {r['ours_us']:.1f} | {r['hand_us']:.1f} | {r['ratio']:.2f}{c.X} "
            f"| {r['ours_cpu_us']:.1f} / {r['hand_cpu_us']:.1f} | {HAND[r['store']]} |"
        )
    return "\n".join(lines)
