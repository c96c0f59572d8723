"""What one feature costs, each against its own baseline in the same run.

    python benchmarks/costs.py etcd|heartbeats|hooks|results|steps [--OPTION VALUE ...]

(each command's options and their defaults: COMMANDS below, or ``<command> --help``)

* ``etcd``: acquire+release and claim+complete/s on a throwaway etcd, sync and asyncio (1
  and 50 tasks), against raw gRPC sending the same requests on the same generated stubs.
* ``heartbeats`` (issue 11): live claims kept alive by one coordinator's renewer against
  as many renew loops (a task or thread per claim, ``port.extend`` every lease/3): round
  trips/s, Redis commands/s (``INFO stats``), client CPU and claims lost.
* ``hooks``: claim+complete per CPU second on memory stores: the store port alone, a port
  built without the hook machinery, no hooks, ``hooks=[]``, OpenTelemetry and Prometheus.
* ``results``: claim+complete/s with plain JSON, HMAC keys, sealed and typed results.
* ``steps`` (issue 25): µs per ``attempt.step()`` recording a small and a 4 KiB JSON
  value inside a claim, against a hand-written fenced upsert of the same bytes, on
  memory, SQLite, Redis, PostgreSQL and etcd (step_costs.py says what each side does).

Rounds are interleaved (A, B, A, B, ...) and medians reported.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]  # the tests' servers, then common and subjects

import common as c  # noqa: E402
import step_costs  # noqa: E402
from subjects import base as subj  # noqa: E402

import idemlock.aio  # noqa: E402
from idemlock import IdempotencySpec, StaleClaim, StoreUnavailable  # noqa: E402


def medians(rates: c.Rates) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in rates.items()}


# ---- etcd -------------------------------------------------------------------------------------


def etcd(args: argparse.Namespace) -> None:
    import grpc

    from idemlock.stores.etcd import _codec as K
    from idemlock.stores.etcd._pb.etcdserverpb import rpc_pb2 as pb
    from idemlock.stores.etcd._pb.etcdserverpb import rpc_pb2_grpc as stubs

    with c.Servers() as servers:
        cluster = servers.start("etcd", args.members)
        channel = grpc.insecure_channel(cluster.endpoints[0])
        kv, leases = stubs.KVStub(channel), stubs.LeaseStub(channel)
        pending: list[Any] = []

        def grant(ttl: int) -> int:
            return leases.LeaseGrant(pb.LeaseGrantRequest(TTL=ttl), timeout=5).ID

        def txn(*parts: Any) -> Any:
            return kv.Txn(K.txn(*parts), timeout=5)

        def drain() -> None:  # the previous round's revokes, long done
            for f in pending:
                f.result()
            pending.clear()

        def raw(step: Callable[[int], int]) -> Callable[[int], None]:
            """``step(i)``'s requests ``n`` times; it returns a lease that idemlock would
            revoke in the background: revoked so, and waited for at the next round."""

            def run(n: int) -> None:
                drain()
                for i in range(n):
                    lease = pb.LeaseRevokeRequest(ID=step(i))
                    pending.append(leases.LeaseRevoke.future(lease))

            return run

        def lock(i: int) -> int:
            key, lease = b"rawbench/l/%d" % i, grant(30)
            value = K.lock_value("owner", 30_000, 30, K.now_ms())
            put = [K.put(key, value, lease)]
            rev = txn([K.cmp_create(key, 0)], put, [K.get(key)]).header.revision
            mine = [K.cmp_create(key, rev), *K.cmp_starts(key, K.owner_prefix("owner"))]
            txn(mine, [K.delete(key, prev=True)], [])
            return lease

        def job(i: int) -> int:
            base = b"rawbench/c/" + uuid.uuid4().hex.encode() + b"\0"
            rec, marker, lease = base + b"r", base + b"t", grant(30)
            puts = [
                K.put(rec, K.inflight_value("tok", "fp")),
                K.put(marker, K.marker_value(30_000, 30, K.now_ms()), lease),
            ]
            fence = txn([K.cmp_create(rec, 0)], puts, [K.get(rec), K.get(marker)]).header.revision
            done = K.done_value("tok", fence, "fp", b'{"ok":1}', 3_600_000, 3600, K.now_ms())
            mine = [K.cmp_mod(rec, fence), *K.cmp_starts(rec, K.token_prefix("tok"))]
            txn(mine, [K.put(rec, done, grant(3600)), K.delete(marker, prev=True)], [K.get(rec)])
            return lease

        with idemlock.connect(cluster.url, key_prefix="bench") as coord:
            fns = {
                "acquire+release idemlock sync": subj.ours_lock_pairs(coord),
                "acquire+release raw gRPC sync": raw(lock),
                "claim+complete idemlock sync": subj.ours_claim_pairs(coord),
                "claim+complete raw gRPC sync": raw(job),
            }
            med = medians(c.interleave(fns, args.n, args.rounds))
            drain()

        async def amain() -> c.Rates:
            async with idemlock.aio.connect(cluster.url, key_prefix="abench") as acoord:
                afns = {
                    f"{op} idemlock asyncio x{tasks}": c.fan_out(subj.aio_pairs(acoord, op), tasks)
                    for tasks in (1, 50)
                    for op in (c.LOCK_OP, c.CLAIM_OP)
                }
                return await c.ainterleave(afns, args.n, args.rounds)

        med |= medians(asyncio.run(amain()))
        print(f"etcd {args.members} member(s), n={args.n}, median of {args.rounds} rounds")
        for k, v in med.items():
            print(f"  {k:<44} {v:8.0f} /s")
        for op in (c.LOCK_OP, c.CLAIM_OP):
            ratio = med[f"{op} idemlock sync"] / med[f"{op} raw gRPC sync"]
            print(f"  {op}: idemlock / raw gRPC (same round trips) = {ratio:.2f}")


# ---- heartbeats -------------------------------------------------------------------------------


def hb_port(coord: Any, lease: float) -> Any:
    return coord.idempotency(
        IdempotencySpec("bench-hb", ttl=timedelta(minutes=5), lease=timedelta(seconds=lease))
    )


async def hb_async(url: str, n: int, secs: float, lease: float, loops: bool) -> tuple[int, int]:
    """(renewal round trips, claims lost) of ``n`` claims held ``secs``: the renewer's
    batches, or one task per claim renewing every lease/3."""
    async with idemlock.aio.connect(url, key_prefix=c.new_prefix("hb")) as coord:
        port, trips, lost = hb_port(coord, lease), 0, 0

        async def renewed(i: int) -> None:
            nonlocal lost
            async with port.run(f"k{i}", payload={}, cancel_on_lost=False) as attempt:
                await asyncio.sleep(secs)
                lost += attempt.lost
                attempt.result = i

        async def loop(i: int) -> None:
            nonlocal trips, lost
            claim = await port.claim(f"k{i}", payload={})
            token, end = claim.token, time.monotonic() + secs
            while (left := end - time.monotonic()) > 0:
                await asyncio.sleep(min(lease / 3, left))
                if time.monotonic() < end:
                    trips += 1
                    try:
                        token = await port.extend(token)
                    except StoreUnavailable:
                        continue  # retried at the next interval
                    except StaleClaim:
                        lost += 1
                        return
            with contextlib.suppress(StaleClaim, StoreUnavailable):
                await port.complete(token, i)

        body = loop if loops else renewed
        await asyncio.gather(*(body(i) for i in range(n)), return_exceptions=not loops)
        # claims and completes are the same on both sides: count renewals only
        return (trips if loops else coord._renewer.round_trips), lost


def hb_threads(url: str, n: int, secs: float, lease: float, loops: bool) -> tuple[int, int]:
    with idemlock.connect(url, key_prefix=c.new_prefix("hb")) as coord, ExitStack() as stack:
        port = hb_port(coord, lease)
        if not loops:
            attempts = [stack.enter_context(port.run(f"k{i}", payload={})) for i in range(n)]
            time.sleep(secs)
            for i, attempt in enumerate(attempts):
                attempt.result = i
            return coord._renewer.round_trips, sum(a.lost for a in attempts)
        tokens = [port.claim(f"k{i}", payload={}).token for i in range(n)]
        end = time.monotonic() + secs

        def renew(i: int) -> tuple[int, int]:  # (round trips, lost)
            trips = 0
            while (left := end - time.monotonic()) > 0:
                time.sleep(min(lease / 3, left))
                if time.monotonic() >= end:
                    break
                trips += 1
                try:
                    tokens[i] = port.extend(tokens[i])
                except StoreUnavailable:
                    continue  # (the pool ran out of connections) retried next interval
                except StaleClaim:
                    return trips, 1
            return trips, 0

        with ThreadPoolExecutor(max_workers=n) as pool:  # a thread per claim
            trips, lost = map(sum, zip(*pool.map(renew, range(n)), strict=True))
        for i, token in enumerate(tokens):
            with contextlib.suppress(StaleClaim, StoreUnavailable):
                port.complete(token, i)
        return trips, lost


def sample(run: Callable[..., tuple[int, int]], client: Any, *args: Any) -> tuple[float, ...]:
    """One side's run: round trips/s, Redis commands/s (``INFO stats``; 0 for other stores),
    client CPU and claims lost."""

    def commands() -> int:
        return int(client.info("stats")["total_commands_processed"]) if client else 0

    c0, t0, p0 = commands(), time.monotonic(), time.process_time()
    trips, lost = run(*args)
    wall, cpu = time.monotonic() - t0, time.process_time() - p0
    return trips / wall, (commands() - c0) / wall, cpu / wall, lost


def heartbeats(args: argparse.Namespace) -> None:
    import redis

    n, secs, lease, stores = args.claims, args.seconds, args.lease, args.stores.split(",")
    faces = {"asyncio": lambda *a: asyncio.run(hb_async(*a)), "threads": hb_threads}
    with c.Servers() as servers:
        urls = {"sqlite": f"sqlite:///{servers.tmp / 'hb.db'}", "memory": "memory://"}
        if "redis" in stores:
            urls["redis"] = servers.start("redis").url
        print(f"{n} live claims, lease {lease:g}s (renewed every {lease / 3:g}s), held {secs:g}s, "
              f"median of {args.rounds} interleaved rounds\n{'store':8} {'face':8} {'side':9} "
              f"{'trips/s':>10} {'server cmd/s':>13} {'client CPU':>11} {'lost':>5}")  # fmt: skip
        for name, (face, run) in itertools.product(stores, faces.items()):
            client = redis.Redis.from_url(urls[name]) if name == "redis" else None
            rounds = [
                [sample(run, client, urls[name], n, secs, lease, loops) for loops in (False, True)]
                for _ in range(args.rounds)
            ]
            med = []
            for side, samples in zip(("renewer", "loops"), zip(*rounds, strict=True), strict=True):
                cols = list(zip(*samples, strict=True))
                med.append([*map(statistics.median, cols[:3]), max(cols[3])])
                t, cmds, u, lost = med[-1]
                print(f"{name:8} {face:8} {side:9} {t:10.1f} {cmds:13.1f} {u:10.2f} {lost:5d}")
            cells = [f"{b / r:8.1f}x" if r else "       -" for r, b in zip(*med, strict=True)][:3]
            print(
                f"{name:8} {face:8} {'loops/ours':9} {cells[0]:>10} {cells[1]:>13} {cells[2]:>11}"
            )


# ---- hooks ------------------------------------------------------------------------------------


def hooks(args: argparse.Namespace) -> None:
    from prometheus_client import CollectorRegistry

    from idemlock._base.events import Events
    from idemlock._base.idempotency import ClaimReplies
    from idemlock._sync import IdempotencyPort
    from idemlock.integrations.otel import OpenTelemetryHook
    from idemlock.integrations.prometheus import PrometheusHook

    spec = IdempotencySpec("bench")

    class NoEvents(Events):
        """Events with every trace of the hook machinery removed."""

        __slots__ = ()

        def t0(self) -> float:
            return 0.0

        def emit(self, name: str, outcome: str, t0: float) -> None:
            return None

    class NoCheckReplies(ClaimReplies):
        """Replies interpreted without the hook check."""

        __slots__ = ()

        def interpret(
            self, key: str, reply: Any, load: Any = None, t0: float = 0.0, *rest: Any
        ) -> Any:
            return self._reply(key, reply, load, *rest)

    class NoCheckPort(IdempotencyPort):
        """The port with every trace of the hook machinery removed."""

        def __init__(self, coord: Any, spec: IdempotencySpec) -> None:
            super().__init__(coord, spec)
            self._events = NoEvents(coord, self._kind, spec.name)
            self._replies = NoCheckReplies(coord, self._events, self._records)

    def hooked(make: Callable[[], Any]) -> Callable[[], c.SyncFn]:
        return lambda: subj.ours_claim_pairs(idemlock.connect("memory://", hooks=make()), spec)

    def timed(make: Callable[[], c.SyncFn], n: int) -> float:
        """claim+complete per CPU second of ``n`` pairs on a fresh store"""
        pairs = make()
        gc.collect()
        start = time.process_time()
        pairs(n)
        return n / (time.process_time() - start)

    def nocheck() -> Any:  # a fresh store whose ports have no hook machinery
        return SimpleNamespace(idempotency=partial(NoCheckPort, idemlock.connect("memory://")))

    runs: dict[str, Callable[[], c.SyncFn]] = {
        "store port, direct": lambda: subj.port_pairs(idemlock.connect("memory://"), c.CLAIM_OP),
        "no hook check (build)": lambda: subj.ours_claim_pairs(nocheck(), spec),
        "zero hooks": hooked(lambda: None),
        "hooks=[]": hooked(list),
        "OpenTelemetryHook (no SDK)": hooked(lambda: [OpenTelemetryHook()]),
        "PrometheusHook": hooked(lambda: [PrometheusHook(registry=CollectorRegistry())]),
    }
    names = list(runs)
    rates: c.Rates = {name: [] for name in names}
    for make in runs.values():  # warm up every path once
        timed(make, min(args.n, 1000))
    for r in range(args.rounds):  # each variant on a fresh store, in a rotating order
        for name in names[r % len(names) :] + names[: r % len(names)]:
            rates[name].append(timed(runs[name], args.n))
    med = medians(rates)
    build, floor = med["no hook check (build)"], med["store port, direct"]
    print(
        f"memory store, n={args.n} x {args.rounds} rounds, median claim+complete per "
        "second of CPU time"
    )
    print(f"{'variant':28} {'ops/s':>9} {'vs build':>9} {'vs direct':>10}")
    for name, rate in med.items():
        print(f"{name:28} {rate:9.0f} {rate / build:9.3f} {rate / floor:10.3f}")
    for name in ("zero hooks", "hooks=[]"):
        paired = statistics.median(
            b / z - 1 for b, z in zip(rates["no hook check (build)"], rates[name], strict=True)
        )
        print(f"{name}: hook check costs {paired * 100:+.2f}% time per claim+complete (goal < 2%)")
    # The checks alone, in isolation: two _t0, two _emit and the check in _interpret.
    port, loops = idemlock.connect("memory://").idempotency(spec), 200_000
    t0, emit, coord = port._events.t0, port._events.emit, port._coord
    start = time.process_time()
    for _ in range(loops):
        pass
    empty = time.process_time() - start
    start = time.process_time()
    for _ in range(loops):
        a, b = t0(), t0()
        emit("claim", "claimed", a)
        emit("complete", "ok", b)
        if coord._hooks:
            raise AssertionError("no hook was registered")
    cost = (time.process_time() - start - empty) / loops
    print(
        f"the checks alone: {cost * 1e9:.0f} ns per claim+complete = "
        f"{cost * med['zero hooks'] * 100:.2f}% of one (goal < 2%)"
    )


# ---- results ----------------------------------------------------------------------------------


@dataclass
class Charge:
    charge_id: str
    amount: int
    at: datetime


def results(args: argparse.Namespace) -> None:
    with c.Servers() as servers:
        url = "memory://" if args.store == "memory" else f"sqlite:///{servers.tmp}/bench.db"
        plain = servers.enter_context(idemlock.connect(url, key_prefix="plain"))
        keyring = idemlock.Keyring.generate()
        sealed = servers.enter_context(idemlock.connect(url, key_prefix="sealed", keyring=keyring))
        at = datetime(2026, 1, 1, tzinfo=timezone.utc)

        @plain.idempotent("typed", key=lambda tag, i: f"{tag}-{i}")
        def charge(tag: str, i: int) -> Charge:
            return Charge("ch_" + "x" * 24, i, at)

        def typed(n: int) -> None:
            tag = uuid.uuid4().hex[:8]
            for i in range(n):
                charge(tag, i)

        pairs = subj.ours_claim_pairs  # through each coordinator's own port
        fns = {
            "plain JSON": pairs(plain, IdempotencySpec("p")),
            "HMAC keys only": pairs(sealed, IdempotencySpec("h")),
            "sealed (AES-GCM + HMAC)": pairs(sealed, IdempotencySpec("s", encrypt_result=True)),
            "typed dataclass (wrap)": typed,
        }
        med = medians(c.interleave(fns, args.n, args.rounds))
    print(f"store={args.store} n={args.n} x {args.rounds} rounds (median claim+complete/s)")
    print(f"{'variant':28} {'ops/s':>10} {'ratio':>7}")
    for name, rate in med.items():
        print(f"{name:28} {rate:10.0f} {rate / med['plain JSON']:7.2f}")


#: each command's options and their defaults (which give their types)
COMMANDS = {
    "etcd": dict(n=500, rounds=5, members=1),
    "heartbeats": dict(claims=1000, seconds=6.0, lease=3.0, rounds=2, stores="redis,sqlite"),
    "hooks": dict(n=3000, rounds=30),
    "results": dict(n=20000, rounds=3, store="memory"),
    # n: steps per round on Redis and PostgreSQL (step_costs.SCALE for the others);
    # json: also write the figures there ("": not); deep: also time each step of claims
    # of that many steps (0: not), deep_claims of them
    "steps": dict(
        n=4000,
        rounds=9,
        per_claim=10,
        stores=",".join(step_costs.STORES),
        json="",
        deep=0,
        deep_claims=3,
    ),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    for name, options in COMMANDS.items():
        p = sub.add_parser(name)
        for opt, default in options.items():
            p.add_argument(f"--{opt}", type=type(default), default=default, help=f"{default}")
    args = parser.parse_args(argv)
    run = {"etcd": etcd, "heartbeats": heartbeats, "hooks": hooks, "results": results}
    (run | {"steps": step_costs.steps})[args.what](args)


if __name__ == "__main__":
    main()
