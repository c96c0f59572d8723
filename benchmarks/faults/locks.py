"""The lock workload: its supervisor and the checker of its write history."""

from __future__ import annotations

import bisect
import contextlib
from collections import Counter
from typing import Any

from faults import GATED, KINDS, SLACK, Findings
from faults.effects import LOCK_SNAPSHOTS, FxError
from faults.run import Run, retried
from idemlock._faults.workers import Slot


class LockRun(Run):
    """Workers contend for ``--resources`` locks with ``hold()`` (ttl ``--lease``,
    renewed every ttl/3) and write fenced records under them while faults hit; then
    the history is checked (:func:`check_lock_history`)."""

    workload = "lock"

    def candidates(self) -> list[Slot]:
        """Live, running workers inside a ``hold()`` block (a fault on a waiting
        worker tests little)."""

        def holding(slot: Slot) -> bool:
            with contextlib.suppress(OSError):
                return (self.root / "stats" / f"{slot.worker}.state").read_bytes()[:1] == b"1"
            return False

        return [s for s in self.workers.live() if holding(s)] if self.workers else []

    def redeliver(self, worker: str) -> None:
        pass  # its lease runs out on its own: that is what is being tested

    def run(self) -> None:
        self.fx.create([])
        # late writes of paused holders, after the faults: fenced out
        self.drive(lambda coord: coord.locks(), lambda: True, 1.0 + self.opts.lease)

    def check(self) -> dict[str, Any]:
        snap = retried(lambda: self.fx.snapshot(LOCK_SNAPSHOTS), FxError)
        exact = self.store not in GATED or self.mode == "plain"
        found = check_lock_history(snap["holds"], snap["log"], exact=exact)
        judged = Findings(found.pop("violations"), found.pop("examples"))
        unfenced: dict[str, int] = {}
        if self.mode == "plain":
            # Without the fence these are what the run shows, not failures of it.
            for kind in ("stale_write_accepted", "writes_interleaved"):
                unfenced[kind] = judged.violations.pop(kind, 0)
            judged.examples = [e for e in judged.examples if e.split(":")[0] not in unfenced]
        late: list[float] = []  # told how long after the deadline, holder not paused
        paused_late: list[float] = []
        for path in (self.root / "stats").glob("*.lost"):
            worker = path.name.split(".txt")[0]
            for line in path.read_text().splitlines():
                deadline, told = map(float, line.split())
                paused = any(
                    w == worker and start < told and end > deadline for w, start, end in self.stops
                )
                (paused_late if paused else late).append(told - deadline)
        late.sort()
        paused_late.sort()
        fence = "set_if_fresh" if self.store.startswith("redis") else "check_and_advance"
        verdict = self.verdict(judged)
        return {
            "workload": "lock",
            "store": self.store,
            "mode": self.mode,
            "same_transaction": False,
            "seed": self.opts.seed,
            "workers": self.opts.workers,
            "resources": self.opts.resources,
            "seconds": round(self.seconds, 1),
            "ttl_s": self.opts.lease,
            "fence": "none" if self.mode == "plain" else "sql" if exact else fence,
            "unfenced_findings": unfenced,
            "faults": {k: self.faults[k] for k in KINDS},
            **found,
            "leases_lost": verdict["worker_events"].get("lock_lost", 0),
            "on_lost_calls": len(late) + len(paused_late),
            # How long after the lease's deadline (counted from the renewal's send; or
            # from when hold() returned a lease already past it) on_lost ran, for
            # holders not paused meanwhile (a SIGSTOPped holder is told only when it
            # runs again: those are apart).
            "on_lost_late_s": {
                "count": len(late),
                "median": round(late[len(late) // 2], 3) if late else None,
                "max": round(late[-1], 3) if late else None,
            },
            "on_lost_late_paused_s": {
                "count": len(paused_late),
                "max": round(paused_late[-1], 3) if paused_late else None,
            },
            **verdict,
        }


def check_lock_history(
    holds: list[tuple[Any, ...]], log: list[tuple[Any, ...]], exact: bool
) -> dict[str, Any]:
    """Check a lock workload's history from the data alone.

    ``holds``: (resource, holder, token, t_before, t_after) per ``hold()`` entered;
    ``log``: (id, resource, holder, token, seq, t_sent, t_done, accepted, lost,
    remaining) per write attempt. Times are CLOCK_MONOTONIC (one machine). With
    ``exact``, the ids of accepted writes are their order of acceptance (SQL fence and
    log row in one transaction); otherwise (the Redis gate, logged after its reply) an
    accepted write is only known to have taken effect within [t_sent, t_done], and
    only pairs whose order is certain are judged. Violations:

    * ``stale_write_accepted``: an accepted write's token is lower than one accepted
      before it for the resource;
    * ``writes_interleaved``: accepted writes of holders A and B went A, B, A;
    * ``token_not_increasing`` / ``token_reused``: a hold that began after another
      had been granted got a token that is not higher; two holders got one token;
    * ``lease_overlap``: a holder wrote while ``lease.remaining()`` said its lease
      was good, after another holder had been granted the lock (its ``hold()`` block
      had started): the lease's own promise, fence aside.
    """
    found = Findings()
    bad = found.bad
    t_zero = min([float(h[3]) for h in holds] + [float(r[5]) for r in log] or [0.0])

    def at(t: float) -> str:
        return f"+{t - t_zero:.3f}s"

    holds_by: dict[str, list[tuple[str, int, float, float]]] = {}
    hold_of: dict[str, tuple[str, int, float, float]] = {}
    for res, holder, token, before, after in holds:
        h = (str(holder), int(token), float(before), float(after))
        holds_by.setdefault(str(res), []).append(h)
        hold_of[h[0]] = h
    logs_by: dict[str, list[tuple[Any, ...]]] = {}
    counts: Counter[str] = Counter()
    for row in log:
        _id, res, holder, token, _seq, _sent, _done, accepted, lost, left = row
        logs_by.setdefault(str(res), []).append(row)
        outcome = "unknown" if accepted is None else "accepted" if accepted else "refused"
        counts[outcome] += 1
        if float(left) <= 0:
            counts["after_deadline"] += 1  # sent unprotected: only the fence stood guard
            if not lost:
                counts["lost_flag_late"] += 1  # remaining() was 0, lease.lost not yet
        h = hold_of.get(str(holder))
        if h is not None and h[1] != int(token):
            bad("token_changed", f"{res}: {holder} held token {h[1]}, wrote with {token}")

    # Tokens: strictly higher for every hold granted after another; never shared.
    for res, hs in holds_by.items():
        owner_of: dict[int, str] = {}
        for holder, token, _, _ in hs:
            other = owner_of.setdefault(token, holder)
            if other != holder:
                bad("token_reused", f"{res}: token {token} went to {other} and {holder}")
        by_after = sorted(hs, key=lambda h: h[3])
        afters = [h[3] for h in by_after]
        best: list[tuple[int, str]] = []
        for h in by_after:
            best.append(max(best[-1], (h[1], h[0])) if best else (h[1], h[0]))
        for holder, token, before, _after in hs:
            i = bisect.bisect_left(afters, before)
            if i and best[i - 1][0] >= token and best[i - 1][1] != holder:
                bad(
                    "token_not_increasing",
                    f"{res}: {holder} entered at {at(before)} and got token {token}, not "
                    f"above token {best[i - 1][0]} of {best[i - 1][1]} granted before",
                )

    # The lease's promise: no write "with time left" once someone else holds the lock.
    for res, hs in holds_by.items():
        by_before = sorted(hs, key=lambda h: h[2])
        befores = [h[2] for h in by_before]
        # suffix minimum of t_after over holds entered later
        first: list[tuple[float, str, int]] = [(float("inf"), "", 0)] * (len(by_before) + 1)
        for i in range(len(by_before) - 1, -1, -1):
            h = by_before[i]
            first[i] = min(first[i + 1], (h[3], h[0], h[1]))
        successor = {h[0]: first[bisect.bisect_right(befores, h[3])] for h in hs}
        for row in logs_by.get(res, []):
            _id, _res, holder, token, _seq, sent, _done, _acc, _lost, left = row
            nxt = successor.get(str(holder))
            if nxt is None or float(left) <= 0 or nxt[1] == holder:
                continue
            if float(sent) > nxt[0] + SLACK:
                bad(
                    "lease_overlap",
                    f"{res}: {holder} (token {token}) wrote at {at(float(sent))} with "
                    f"remaining()={float(left):.3f}s, but {nxt[1]} (token {nxt[2]}) held the "
                    f"lock from {at(nxt[0])}",
                )
                successor.pop(str(holder))  # once per holder

    for res, rows in logs_by.items():
        acc = [r for r in rows if r[7]]
        if exact:
            top: tuple[int, str] | None = None
            current: str | None = None
            finished: set[str] = set()
            for r in sorted(acc, key=lambda r: int(r[0])):
                holder, token = str(r[2]), int(r[3])
                if top is not None and token < top[0]:
                    bad(
                        "stale_write_accepted",
                        f"{res}: {holder} token {token} accepted (log id {r[0]}) after "
                        f"token {top[0]} of {top[1]}",
                    )
                if top is None or token > top[0]:
                    top = (token, holder)
                if holder != current:
                    if holder in finished:
                        bad(
                            "writes_interleaved",
                            f"{res}: {holder} (token {token}) wrote again (log id {r[0]}) "
                            f"after {current} had written",
                        )
                    if current is not None:
                        finished.add(current)
                    current = holder
        timed = [r for r in acc if r[6] is not None]
        if not timed:
            continue
        # Certain order only: Y before X when Y's reply came before X was sent.
        by_done = sorted(timed, key=lambda r: float(r[6]))
        dones = [float(r[6]) for r in by_done]
        high: list[tuple[int, str]] = []
        for r in by_done:
            high.append(max(high[-1], (int(r[3]), str(r[2]))) if high else (int(r[3]), str(r[2])))
        for r in timed:
            i = bisect.bisect_left(dones, float(r[5]))
            if i and high[i - 1][0] > int(r[3]):
                bad(
                    "stale_write_accepted",
                    f"{res}: {r[2]} token {r[3]} accepted (sent {at(float(r[5]))}) after token "
                    f"{high[i - 1][0]} of {high[i - 1][1]} had been",
                )
        by_sent = sorted(timed, key=lambda r: float(r[5]))
        sents = [float(r[5]) for r in by_sent]
        span: dict[str, list[float]] = {}
        for r in timed:
            s = span.setdefault(str(r[2]), [float("inf"), float("-inf")])
            s[0] = min(s[0], float(r[6]))  # its first write surely done
            s[1] = max(s[1], float(r[5]))  # its last write surely not yet sent
        for holder, (lo, hi) in span.items():
            if hi <= lo:
                continue
            for b in by_sent[bisect.bisect_right(sents, lo) : bisect.bisect_left(sents, hi)]:
                if str(b[2]) != holder and float(b[6]) < hi:
                    bad(
                        "writes_interleaved",
                        f"{res}: {b[2]} (token {b[3]}) wrote between {at(float(b[5]))} and "
                        f"{at(float(b[6]))}, after {holder}'s write done at {at(lo)} and "
                        f"before its write sent at {at(hi)}",
                    )
                    break

    return {
        "holds": len(holds),
        "writes": len(log),
        "writes_accepted": counts["accepted"],
        "stale_writes_refused": counts["refused"],
        "writes_unknown": counts["unknown"],
        "writes_after_deadline": counts["after_deadline"],
        "writes_lost_flag_late": counts["lost_flag_late"],
        "violations": found.violations,
        "examples": found.examples,
    }
