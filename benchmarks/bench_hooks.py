"""Cost of the event hook: claim+complete per second on the memory store, in one run.

    python benchmarks/bench_hooks.py [--n 3000] [--rounds 30]

Variants, each measured on a fresh memory store in every round, in a rotating order;
times are this process's CPU time (``time.process_time``), so other processes on a
busy machine disturb them less, and the figures are medians over the rounds. The
hook-check overhead is the median of the per-round ratios of two variants measured
back to back, which cancels the drift of a shared machine:

* ``store port, direct``: ``coord.store.claim`` / ``coord.store.complete`` with
  prepared arguments; the floor, without anything the coordinator adds.
* ``no hook check (build)``: the public port with the hook machinery taken out (no
  timing, no emit, no check): what the same calls would cost without hooks at all.
* ``zero hooks``: ``connect()`` with no hooks (the default); the goal is < 2% slower
  than the build above.
* ``hooks=[]``: an empty list passed explicitly (the same thing).
* ``OpenTelemetryHook (no SDK)``: the OTel hook with the API's no-op tracer.
* ``PrometheusHook``: counters and a histogram per event.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import idemlock
from idemlock import Claimed, IdempotencySpec
from idemlock._sync import IdempotencyPort

RESULT = {"charge_id": "ch_" + "x" * 24, "amount": 1200, "ok": True}
SPEC = IdempotencySpec("bench")


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


def via_port(port: IdempotencyPort, n: int, tag: str) -> float:
    claim_, complete = port.claim, port.complete
    gc.collect()
    start = time.process_time()
    for i in range(n):
        claim = claim_(f"{tag}-{i}")
        assert isinstance(claim, Claimed)
        complete(claim.token, RESULT)
    return n / (time.process_time() - start)


def check_cost(loops: int = 200_000) -> float:
    """CPU seconds the hook machinery adds to one claim+complete when nobody listens,
    measured in isolation: two ``_t0``, two ``_emit`` and the check in ``_interpret``."""
    port = idemlock.connect("memory://").idempotency(SPEC)
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
    return (time.process_time() - start - empty) / loops


def variants() -> dict[str, Callable[[int, str], float]]:
    from idemlock._tokens import new_token
    from idemlock.integrations.otel import OpenTelemetryHook
    from idemlock.integrations.prometheus import PrometheusHook

    def direct(n: int, tag: str) -> float:
        coord = idemlock.connect("memory://")
        store, port = coord.store, coord.idempotency(SPEC)
        ns, lease, ttl = port._ns, port._lease_ms, port._ttl_ms
        data = port._encode("k", RESULT)
        gc.collect()
        start = time.process_time()
        for i in range(n):
            key, token = f"{tag}-{i}", new_token()
            store.claim(ns, key, None, token, lease)
            store.complete(ns, key, token, data, ttl)
        return n / (time.process_time() - start)

    def build(n: int, tag: str) -> float:
        return via_port(NoCheckPort(idemlock.connect("memory://"), SPEC), n, tag)

    def hooked(hooks: Callable[[], Any]) -> Callable[[int, str], float]:
        def run(n: int, tag: str) -> float:
            coord = idemlock.connect("memory://", hooks=hooks())
            return via_port(coord.idempotency(SPEC), n, tag)

        return run

    from prometheus_client import CollectorRegistry

    return {
        "store port, direct": direct,
        "no hook check (build)": build,
        "zero hooks": hooked(lambda: None),
        "hooks=[]": hooked(list),
        "OpenTelemetryHook (no SDK)": hooked(lambda: [OpenTelemetryHook()]),
        "PrometheusHook": hooked(lambda: [PrometheusHook(registry=CollectorRegistry())]),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    runs = variants()
    names = list(runs)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for run in runs.values():  # warm up every path once
        run(min(args.n, 1000), "warm")
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            rates[name].append(runs[name](args.n, f"r{r}-{names.index(name)}"))
    med = {name: statistics.median(rs) for name, rs in rates.items()}
    base, direct = med["no hook check (build)"], med["store port, direct"]
    print(
        f"memory store, n={args.n} x {args.rounds} rounds, median claim+complete per "
        "second of CPU time"
    )
    print(f"{'variant':28} {'ops/s':>9} {'vs build':>9} {'vs direct':>10}")
    for name, rate in med.items():
        print(f"{name:28} {rate:9.0f} {rate / base:9.3f} {rate / direct:10.3f}")
    for name in ("zero hooks", "hooks=[]"):
        paired = statistics.median(
            b / z - 1 for b, z in zip(rates["no hook check (build)"], rates[name], strict=True)
        )
        print(f"{name}: hook check costs {paired * 100:+.2f}% time per claim+complete (goal < 2%)")
    cost = check_cost()
    print(
        f"the checks alone: {cost * 1e9:.0f} ns per claim+complete = "
        f"{cost * med['zero hooks'] * 100:.2f}% of one (goal < 2%)"
    )


if __name__ == "__main__":
    main()
