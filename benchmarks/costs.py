"""What one feature costs, each against its own baseline in the same run.

    python benchmarks/costs.py etcd [--n 500] [--rounds 5] [--members 1]
    python benchmarks/costs.py heartbeats [--claims 1000] [--seconds 6] [--lease 3]
                                          [--rounds 2] [--stores redis,sqlite]
    python benchmarks/costs.py hooks [--n 3000] [--rounds 30]
    python benchmarks/costs.py results [--n 20000] [--rounds 3] [--store memory|sqlite]

* ``etcd``: acquire+release and claim+complete per second on a throwaway etcd
  (tests/servers/etcd.py), sync and asyncio (1 and 50 tasks), against raw gRPC calls on
  the same generated stubs sending the same requests idemlock sends, the same round trips
  (a lease grant and a Txn per transition; lease revokes in the background, as idemlock).
* ``heartbeats`` (issue 11): ``--claims`` live claims kept alive by one coordinator's
  renewer (``port.run()``, renewing everything due in one ``renew_many``) against as many
  independent renew loops (a task or thread per claim sleeping lease/3 and calling
  ``port.extend``), asyncio and threads, on Redis and SQLite: client round trips/s, Redis
  commands/s (``INFO stats``), client CPU (process time per wall second) and claims lost.
* ``hooks``: claim+complete per second of CPU time on fresh memory stores: the store port
  alone, the port without the hook machinery (a build with it taken out), no hooks,
  ``hooks=[]``, the OpenTelemetry hook (no SDK) and the Prometheus hook; the hook check's
  cost is the median of per-round ratios measured back to back (goal < 2%).
* ``results``: claim+complete per second with plain JSON results, HMAC keys, sealing
  (AES-256-GCM + HMAC) and typed (dataclass) results.

Rounds are interleaved (A, B, A, B, ...) and medians reported, so a noisy machine moves
every side alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
for _path in (str(HERE.parent), str(HERE)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from common import Rates, ainterleave, fan_out, interleave  # noqa: E402

import idemlock  # noqa: E402
import idemlock.aio  # noqa: E402
from idemlock import Claimed, IdempotencySpec, LockSpec, StaleClaim, StoreUnavailable  # noqa: E402

RESULT = {"charge_id": "ch_" + "x" * 24, "amount": 1200, "ok": True}


def medians(rates: Rates) -> dict[str, float]:
    return {k: statistics.median(v) for k, v in rates.items()}


# ---- etcd -------------------------------------------------------------------------------------


def etcd(args: argparse.Namespace) -> None:
    import grpc
    from tests.servers.etcd import start_etcd

    from idemlock.stores.etcd import _codec as K
    from idemlock.stores.etcd._pb.etcdserverpb import rpc_pb2 as pb
    from idemlock.stores.etcd._pb.etcdserverpb import rpc_pb2_grpc as stubs

    lock_spec = LockSpec("bench", ttl=timedelta(seconds=30))
    spec = IdempotencySpec("bench", ttl=timedelta(hours=1), lease=timedelta(seconds=30))
    cluster = start_etcd(args.members)
    try:
        channel = grpc.insecure_channel(cluster.endpoints[0])
        kv, leases = stubs.KVStub(channel), stubs.LeaseStub(channel)
        pending: list[Any] = []

        def revoke_later(lease: int) -> None:  # as idemlock: in the background
            pending.append(leases.LeaseRevoke.future(pb.LeaseRevokeRequest(ID=lease)))

        def drain() -> None:  # the previous round's revokes, long done
            for f in pending:
                f.result()
            pending.clear()

        def raw_lock(n: int) -> None:
            drain()
            for i in range(n):
                key = b"rawbench/l/" + str(i).encode()
                g = leases.LeaseGrant(pb.LeaseGrantRequest(TTL=30), timeout=5)
                value = K.lock_value("owner", 30_000, 30, K.now_ms())
                put = K.txn([K.cmp_create(key, 0)], [K.put(key, value, g.ID)], [K.get(key)])
                token = kv.Txn(put, timeout=5).header.revision
                mine = [K.cmp_create(key, token), *K.cmp_starts(key, K.owner_prefix("owner"))]
                kv.Txn(K.txn(mine, [K.delete(key, prev=True)], []), timeout=5)
                revoke_later(g.ID)

        def raw_job(n: int) -> None:
            drain()
            for _ in range(n):
                base = b"rawbench/c/" + uuid.uuid4().hex.encode() + b"\0"
                rec, marker = base + b"r", base + b"t"
                g = leases.LeaseGrant(pb.LeaseGrantRequest(TTL=30), timeout=5)
                puts = [K.put(rec, K.inflight_value("tok", "fp")),
                        K.put(marker, K.marker_value(30_000, 30, K.now_ms()), g.ID)]  # fmt: skip
                got = kv.Txn(K.txn([K.cmp_create(rec, 0)], puts, [K.get(rec), K.get(marker)]),
                             timeout=5)  # fmt: skip
                fence = got.header.revision
                g2 = leases.LeaseGrant(pb.LeaseGrantRequest(TTL=3600), timeout=5)
                done = K.done_value("tok", fence, "fp", b'{"ok":1}', 3_600_000, 3600, K.now_ms())
                mine = [K.cmp_mod(rec, fence), *K.cmp_starts(rec, K.token_prefix("tok"))]
                ops = [K.put(rec, done, g2.ID), K.delete(marker, prev=True)]
                kv.Txn(K.txn(mine, ops, [K.get(rec)]), timeout=5)
                revoke_later(g.ID)

        coord = idemlock.connect(cluster.url, key_prefix="bench")
        locks, port = coord.lock(lock_spec), coord.idempotency(spec)

        def ours_lock(n: int) -> None:
            for i in range(n):
                lease = locks.acquire(f"l{i}")
                assert lease is not None
                locks.release(lease)

        def ours_job(n: int) -> None:
            for _ in range(n):
                claim = port.claim(uuid.uuid4().hex)
                assert isinstance(claim, Claimed)
                port.complete(claim.token, {"ok": 1})

        fns = {
            "acquire+release idemlock sync": ours_lock,
            "acquire+release raw gRPC sync": raw_lock,
            "claim+complete idemlock sync": ours_job,
            "claim+complete raw gRPC sync": raw_job,
        }
        med = medians(interleave(fns, args.n, args.rounds))
        drain()
        coord.close()

        async def amain() -> Rates:
            acoord = idemlock.aio.connect(cluster.url, key_prefix="abench")
            alocks, aport = acoord.lock(lock_spec), acoord.idempotency(spec)

            async def a_lock(t: int, n: int) -> None:
                for _ in range(n):
                    lease = await alocks.acquire(f"al{t}-{uuid.uuid4().hex[:6]}")
                    assert lease is not None
                    await alocks.release(lease)

            async def a_job(t: int, n: int) -> None:
                for _ in range(n):
                    claim = await aport.claim(uuid.uuid4().hex)
                    assert isinstance(claim, Claimed)
                    await aport.complete(claim.token, {"ok": 1})

            afns: dict[str, Callable[[int], Awaitable[None]]] = {
                f"{name} idemlock asyncio x{tasks}": fan_out(make, tasks)
                for tasks in (1, 50)
                for name, make in (("acquire+release", a_lock), ("claim+complete", a_job))
            }
            try:
                return await ainterleave(afns, args.n, args.rounds)
            finally:
                await acoord.close()

        med |= medians(asyncio.run(amain()))
        print(f"etcd {args.members} member(s), n={args.n}, median of {args.rounds} rounds")
        for k, v in med.items():
            print(f"  {k:<44} {v:8.0f} /s")
        for op in ("acquire+release", "claim+complete"):
            ratio = med[f"{op} idemlock sync"] / med[f"{op} raw gRPC sync"]
            print(f"  {op}: idemlock / raw gRPC (same round trips) = {ratio:.2f}")
    finally:
        cluster.destroy()


# ---- heartbeats -------------------------------------------------------------------------------


@dataclass
class Sample:
    trips: float  # client round trips per second
    server: float  # server commands per second (Redis only, else 0)
    cpu: float  # client CPU seconds per wall second
    lost: int = 0  # claims whose renewal failed or was refused (their key was at risk)


def hb_spec(lease: float) -> IdempotencySpec:
    return IdempotencySpec("bench-hb", ttl=timedelta(minutes=5), lease=timedelta(seconds=lease))


async def hb_async(url: str, n: int, secs: float, lease: float, loops: bool) -> tuple[int, int]:
    """(round trips, claims lost) of ``n`` claims held ``secs``: the renewer's batches,
    or one task per claim renewing every lease/3."""
    coord = idemlock.aio.connect(url, key_prefix="hb" + uuid.uuid4().hex[:8])
    port = coord.idempotency(hb_spec(lease))
    trips = lost = 0

    async def renewed(i: int) -> None:
        nonlocal lost
        async with port.run(f"k{i}", payload={}, cancel_on_lost=False) as attempt:
            await asyncio.sleep(secs)
            lost += attempt.lost
            attempt.result = i

    async def loop(i: int) -> None:
        nonlocal trips, lost
        claim = await port.claim(f"k{i}", payload={})
        assert isinstance(claim, Claimed)
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

    try:
        body = loop if loops else renewed
        await asyncio.gather(*(body(i) for i in range(n)), return_exceptions=not loops)
        # claims and completes are the same on both sides: count renewals only
        return (trips if loops else coord._renewer.round_trips), lost
    finally:
        await coord.close()


def hb_threads(url: str, n: int, secs: float, lease: float, loops: bool) -> tuple[int, int]:
    coord = idemlock.connect(url, key_prefix="hb" + uuid.uuid4().hex[:8])
    port = coord.idempotency(hb_spec(lease))
    try:
        if not loops:
            with ExitStack() as stack:
                attempts = [stack.enter_context(port.run(f"k{i}", payload={})) for i in range(n)]
                time.sleep(secs)
                for i, attempt in enumerate(attempts):
                    attempt.result = i
                return coord._renewer.round_trips, sum(a.lost for a in attempts)
        tokens = []
        for i in range(n):
            claim = port.claim(f"k{i}", payload={})
            assert isinstance(claim, Claimed)
            tokens.append(claim.token)
        end, stop = time.monotonic() + secs, threading.Event()
        trips, lost = [0] * n, [0] * n

        def renew(i: int) -> None:
            while not stop.wait(min(lease / 3, max(0.0, end - time.monotonic()))):
                if time.monotonic() >= end:
                    break
                trips[i] += 1
                try:
                    tokens[i] = port.extend(tokens[i])
                except StoreUnavailable:
                    continue  # (the pool ran out of connections) retried next interval
                except StaleClaim:
                    lost[i] = 1
                    break

        threads = [threading.Thread(target=renew, args=(i,), daemon=True) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for i, token in enumerate(tokens):
            with contextlib.suppress(StaleClaim, StoreUnavailable):
                port.complete(token, i)
        return sum(trips), sum(lost)
    finally:
        coord.close()


def heartbeats(args: argparse.Namespace) -> None:
    import redis
    from tests.servers.redis import start_redis

    n, secs, lease = args.claims, args.seconds, args.lease
    faces: dict[str, Callable[..., tuple[int, int]]] = {
        "asyncio": lambda *a: asyncio.run(hb_async(*a)),
        "threads": hb_threads,
    }
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        urls, stores = {}, args.stores.split(",")
        if "redis" in stores:
            server = start_redis(Path(tmp) / "redis")
            stack.callback(server.stop)
            urls["redis"] = server.url
        if "sqlite" in stores:
            urls["sqlite"] = f"sqlite:///{Path(tmp) / 'hb.db'}"
        if "memory" in stores:
            urls["memory"] = "memory://"
        print(f"{n} live claims, lease {lease:g}s (renewed every {lease / 3:g}s), held "
              f"{secs:g}s, median of {args.rounds} interleaved rounds")  # fmt: skip
        print(f"{'store':8} {'face':8} {'side':9} {'trips/s':>10} {'server cmd/s':>13} "
              f"{'client CPU':>11} {'lost':>5}")  # fmt: skip
        for name, url in urls.items():
            client = redis.Redis.from_url(url) if name == "redis" else None
            for face, run in faces.items():
                got: dict[str, list[Sample]] = {"renewer": [], "loops": []}
                for _ in range(args.rounds):
                    for side in got:
                        c0, t0, p0 = commands(client), time.monotonic(), time.process_time()
                        trips, lost = run(url, n, secs, lease, side == "loops")
                        wall = time.monotonic() - t0
                        cpu = (time.process_time() - p0) / wall
                        cmds = (commands(client) - c0) / wall
                        got[side].append(Sample(trips / wall, cmds, cpu, lost))
                med = {side: median_sample(samples) for side, samples in got.items()}
                for side, s in med.items():
                    print(f"{name:8} {face:8} {side:9} {s.trips:10.1f} {s.server:13.1f} "
                          f"{s.cpu:10.2f} {s.lost:5d}")  # fmt: skip
                r, b = med["renewer"], med["loops"]
                ratios = [f"{x / y:8.1f}x" if y else "       -" for x, y in (
                    (b.trips, r.trips), (b.server, r.server), (b.cpu, r.cpu))]  # fmt: skip
                print(f"{name:8} {face:8} {'loops/ours':9} {ratios[0]:>10} {ratios[1]:>13} "
                      f"{ratios[2]:>11}")  # fmt: skip


def commands(client: Any) -> int:
    """Commands the Redis server has processed (0 for other stores)."""
    return 0 if client is None else int(client.info("stats")["total_commands_processed"])


def median_sample(samples: list[Sample]) -> Sample:
    def mid(field: str) -> float:
        return statistics.median(getattr(s, field) for s in samples)

    return Sample(mid("trips"), mid("server"), mid("cpu"), max(s.lost for s in samples))


# ---- hooks ------------------------------------------------------------------------------------


def hooks(args: argparse.Namespace) -> None:
    from prometheus_client import CollectorRegistry

    from idemlock._sync import IdempotencyPort
    from idemlock._tokens import new_token
    from idemlock.integrations.otel import OpenTelemetryHook
    from idemlock.integrations.prometheus import PrometheusHook

    spec = IdempotencySpec("bench")

    class NoCheckPort(IdempotencyPort):
        """The port with every trace of the hook machinery removed."""

        def _t0(self) -> float:
            return 0.0

        def _emit(self, name: str, outcome: str, t0: float) -> None:
            return None

        def _interpret(
            self, key: str, reply: Any, load: Any = None, t0: float = 0.0, *rest: Any
        ) -> Any:
            return self._interpret_reply(key, reply, load, *rest)

    def timed(body: Callable[[int], None], n: int) -> float:
        gc.collect()
        start = time.process_time()
        body(n)
        return n / (time.process_time() - start)

    def via_port(port: IdempotencyPort, n: int, tag: str) -> float:
        claim_, complete = port.claim, port.complete

        def body(n: int) -> None:
            for i in range(n):
                claim = claim_(f"{tag}-{i}")
                assert isinstance(claim, Claimed)
                complete(claim.token, RESULT)

        return timed(body, n)

    def direct(n: int, tag: str) -> float:
        coord = idemlock.connect("memory://")
        store, port = coord.store, coord.idempotency(spec)
        ns, lease, ttl, data = port._ns, port._lease_ms, port._ttl_ms, port._encode("k", RESULT)

        def body(n: int) -> None:
            for i in range(n):
                key, token = f"{tag}-{i}", new_token()
                store.claim(ns, key, None, token, lease)
                store.complete(ns, key, token, data, ttl)

        return timed(body, n)

    def hooked(make: Callable[[], Any]) -> Callable[[int, str], float]:
        return lambda n, tag: via_port(
            idemlock.connect("memory://", hooks=make()).idempotency(spec), n, tag
        )

    runs: dict[str, Callable[[int, str], float]] = {
        "store port, direct": direct,
        "no hook check (build)": lambda n, tag: via_port(
            NoCheckPort(idemlock.connect("memory://"), spec), n, tag
        ),
        "zero hooks": hooked(lambda: None),
        "hooks=[]": hooked(list),
        "OpenTelemetryHook (no SDK)": hooked(lambda: [OpenTelemetryHook()]),
        "PrometheusHook": hooked(lambda: [PrometheusHook(registry=CollectorRegistry())]),
    }
    names = list(runs)
    rates: Rates = {name: [] for name in names}
    for run in runs.values():  # warm up every path once
        run(min(args.n, 1000), "warm")
    for r in range(args.rounds):  # each variant on a fresh store, in a rotating order
        for name in names[r % len(names) :] + names[: r % len(names)]:
            rates[name].append(runs[name](args.n, f"r{r}-{names.index(name)}"))
    med = medians(rates)
    base, floor = med["no hook check (build)"], med["store port, direct"]
    print(f"memory store, n={args.n} x {args.rounds} rounds, median claim+complete per "
          "second of CPU time")  # fmt: skip
    print(f"{'variant':28} {'ops/s':>9} {'vs build':>9} {'vs direct':>10}")
    for name, rate in med.items():
        print(f"{name:28} {rate:9.0f} {rate / base:9.3f} {rate / floor:10.3f}")
    for name in ("zero hooks", "hooks=[]"):
        paired = statistics.median(
            b / z - 1 for b, z in zip(rates["no hook check (build)"], rates[name], strict=True)
        )
        print(f"{name}: hook check costs {paired * 100:+.2f}% time per claim+complete (goal < 2%)")
    # The checks alone, in isolation: two _t0, two _emit and the check in _interpret.
    port, loops = idemlock.connect("memory://").idempotency(spec), 200_000
    t0, emit, coord = port._t0, port._emit, port._coord
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
    print(f"the checks alone: {cost * 1e9:.0f} ns per claim+complete = "
          f"{cost * med['zero hooks'] * 100:.2f}% of one (goal < 2%)")  # fmt: skip


# ---- results ----------------------------------------------------------------------------------


@dataclass
class Charge:
    charge_id: str
    amount: int
    at: datetime


def results(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        url = "memory://" if args.store == "memory" else f"sqlite:///{tmp}/bench.db"
        plain = stack.enter_context(idemlock.connect(url, key_prefix="plain"))
        sealed = stack.enter_context(
            idemlock.connect(url, key_prefix="sealed", keyring=idemlock.Keyring.generate())
        )

        def pairs(coord: idemlock.Coordinator, spec: IdempotencySpec) -> Callable[[int], None]:
            port = coord.idempotency(spec)

            def run(n: int) -> None:
                tag = uuid.uuid4().hex[:8]
                for i in range(n):
                    claim = port.claim(f"{tag}-{i}", payload={"i": i})
                    assert isinstance(claim, Claimed)
                    port.complete(claim.token, RESULT)

            return run

        at = datetime(2026, 1, 1, tzinfo=timezone.utc)

        @plain.idempotent("typed", key=lambda tag, i: f"{tag}-{i}")
        def charge(tag: str, i: int) -> Charge:
            return Charge("ch_" + "x" * 24, i, at)

        def typed(n: int) -> None:
            tag = uuid.uuid4().hex[:8]
            for i in range(n):
                charge(tag, i)

        fns = {
            "plain JSON": pairs(plain, IdempotencySpec("p")),
            "HMAC keys only": pairs(sealed, IdempotencySpec("h")),
            "sealed (AES-GCM + HMAC)": pairs(sealed, IdempotencySpec("s", encrypt_result=True)),
            "typed dataclass (wrap)": typed,
        }
        med = medians(interleave(fns, args.n, args.rounds))
    base = med["plain JSON"]
    print(f"store={args.store} n={args.n} x {args.rounds} rounds (median claim+complete/s)")
    print(f"{'variant':28} {'ops/s':>10} {'ratio':>7}")
    for name, rate in med.items():
        print(f"{name:28} {rate:10.0f} {rate / base:7.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    for name, options in {
        "etcd": (("n", int, 500), ("rounds", int, 5), ("members", int, 1)),
        "heartbeats": (("claims", int, 1000), ("seconds", float, 6.0), ("lease", float, 3.0),
                       ("rounds", int, 2), ("stores", str, "redis,sqlite")),
        "hooks": (("n", int, 3000), ("rounds", int, 30)),
        "results": (("n", int, 20000), ("rounds", int, 3), ("store", str, "memory")),
    }.items():  # fmt: skip
        p = sub.add_parser(name)
        for opt, kind, default in options:
            p.add_argument(f"--{opt}", type=kind, default=default)
    args = parser.parse_args(argv)
    {"etcd": etcd, "heartbeats": heartbeats, "hooks": hooks, "results": results}[args.what](args)


if __name__ == "__main__":
    main()
