"""Cost of result handling: claim+complete per second with plain JSON results, with
sealing (AES-256-GCM + HMAC lookups) and with typed (dataclass) results, in one run.

    python benchmarks/bench_results.py [--n 20000] [--store memory|sqlite]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone

import idemlock
from idemlock import Claimed, IdempotencySpec, Keyring

RESULT = {"charge_id": "ch_" + "x" * 24, "amount": 1200, "currency": "eur", "ok": True}


@dataclass
class Charge:
    charge_id: str
    amount: int
    at: datetime


def run(coord: idemlock.Coordinator, spec: IdempotencySpec, n: int, tag: str) -> float:
    port = coord.idempotency(spec)
    start = time.perf_counter()
    for i in range(n):
        claim = port.claim(f"{tag}-{i}", payload={"i": i})
        assert isinstance(claim, Claimed)
        port.complete(claim.token, RESULT)
    return n / (time.perf_counter() - start)


def run_typed(coord: idemlock.Coordinator, n: int) -> float:
    at = datetime(2026, 1, 1, tzinfo=timezone.utc)

    @coord.idempotent("typed", key=lambda i: f"typed-{i}")
    def charge(i: int) -> Charge:
        return Charge("ch_" + "x" * 24, i, at)

    start = time.perf_counter()
    for i in range(n):
        charge(i)
    return n / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20000)
    parser.add_argument("--store", choices=["memory", "sqlite"], default="memory")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        url = "memory://" if args.store == "memory" else f"sqlite:///{tmp}/bench.db"
        ring = Keyring.generate()
        plain = idemlock.connect(url, key_prefix="plain")
        sealed = idemlock.connect(url, key_prefix="sealed", keyring=ring)
        rows: list[tuple[str, float]] = []
        run(plain, IdempotencySpec("warm"), min(args.n, 1000), "warm")
        rows.append(("plain JSON", run(plain, IdempotencySpec("p"), args.n, "p")))
        rows.append(("HMAC keys only", run(sealed, IdempotencySpec("h"), args.n, "h")))
        rows.append(
            (
                "sealed (AES-GCM + HMAC)",
                run(sealed, IdempotencySpec("s", encrypt_result=True), args.n, "s"),
            )
        )
        rows.append(("typed dataclass (wrap)", run_typed(plain, args.n)))
        plain.close()
        sealed.close()
    base = rows[0][1]
    print(f"store={args.store} n={args.n} (claim+complete per second)")
    print(f"{'variant':28} {'ops/s':>10} {'ratio':>7}")
    for name, rate in rows:
        print(f"{name:28} {rate:10.0f} {rate / base:7.2f}")


if __name__ == "__main__":
    main()
