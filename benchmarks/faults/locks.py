"""The checkers of the lease workloads' write histories: a lock's (and an election's:
a term is a lock's lease), a semaphore's permits."""

from __future__ import annotations

import bisect
from collections import Counter, namedtuple
from collections.abc import Callable
from itertools import accumulate
from typing import Any

from faults import SLACK, Findings

#: a ``lock_holds`` row (``before``/``after``: around ``hold()``'s entry), a ``lock_log`` one
Hold = namedtuple("Hold", "res holder token before after")
Write = namedtuple("Write", "id res holder token seq sent done accepted lost left")


def check_tokens(
    res: str, rh: list[Hold], bad: Callable[[str, str], None], at: Callable[[float], str]
) -> None:
    """Tokens of one resource's holds: strictly higher for every hold granted after
    another; never shared by two holders."""
    owner_of: dict[int, str] = {}
    for h in rh:
        if owner_of.setdefault(h.token, h.holder) != h.holder:
            bad(
                "token_reused",
                f"{res}: token {h.token} went to {owner_of[h.token]} and {h.holder}",
            )
    by_after = sorted(rh, key=lambda h: h.after)
    afters = [h.after for h in by_after]
    best = list(accumulate(((h.token, h.holder) for h in by_after), max))
    for h in rh:
        i = bisect.bisect_left(afters, h.before)
        if i and best[i - 1][0] >= h.token and best[i - 1][1] != h.holder:
            bad(
                "token_not_increasing",
                f"{res}: {h.holder} entered at {at(h.before)} and got token {h.token}, not "
                f"above token {best[i - 1][0]} of {best[i - 1][1]} granted before",
            )


def _read_history(
    holds: list[tuple[Any, ...]],
    log: list[tuple[Any, ...]],
    bad: Callable[[str, str], None],
    by_id: bool,
) -> tuple[list[Hold], list[Write], Callable[[float], str], Counter[str]]:
    """The holds and writes of a history (``by_id``: writes in their log ids' order), a
    formatter of times from its start, and the writes' counts; reports
    ``token_changed`` (a holder wrote with a token other than its hold's)."""
    hs = [Hold._make(row) for row in holds]
    ws = [Write._make(row) for row in log]
    if by_id:
        ws.sort(key=lambda w: w.id)
    t_zero = min([h.before for h in hs] + [w.sent for w in ws] or [0.0])

    def at(t: float) -> str:
        return f"+{t - t_zero:.3f}s"

    hold_of = {h.holder: h for h in hs}
    counts: Counter[str] = Counter()
    for w in ws:
        counts["unknown" if w.accepted is None else "accepted" if w.accepted else "refused"] += 1
        if w.left <= 0:
            counts["after_deadline"] += 1  # sent unprotected: only the fence stood guard
            counts["lost_flag_late"] += not w.lost  # remaining() was 0, lease.lost not yet
        h = hold_of.get(w.holder)
        if h is not None and h.token != w.token:
            bad("token_changed", f"{w.res}: {w.holder} held token {h.token}, wrote with {w.token}")
    return hs, ws, at, counts


def check_lock_history(
    holds: list[tuple[Any, ...]], log: list[tuple[Any, ...]], exact: bool
) -> dict[str, Any]:
    """Check a lock workload's history from the data alone.

    ``holds``: ``Hold`` rows, one per ``hold()`` entered; ``log``: ``Write`` rows, one
    per write attempt. Times are CLOCK_MONOTONIC (one machine). With ``exact``, the
    ids of accepted writes are their order of acceptance (SQL fence and log row in one
    transaction); otherwise (a store's gate, logged after its reply) an accepted write
    is only known to have taken effect within [sent, done], and only pairs whose order
    is certain are judged. Violations:

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
    hs, ws, at, counts = _read_history(holds, log, bad, by_id=False)

    for res in sorted({h.res for h in hs} | {w.res for w in ws}):
        rh = [h for h in hs if h.res == res]
        check_tokens(res, rh, bad, at)

        # The lease's promise: no write "with time left" once someone else holds the lock.
        by_before = sorted(rh, key=lambda h: h.before)
        befores = [h.before for h in by_before]
        # the first body started among the holds entered after each one
        first = [*accumulate(((h.after, h.holder, h.token) for h in reversed(by_before)), min)]
        first = [*reversed(first), (float("inf"), "", 0)]
        successor = {h.holder: first[bisect.bisect_right(befores, h.after)] for h in rh}
        rw = [w for w in ws if w.res == res]
        for w in rw:
            nxt = successor.get(w.holder)
            if nxt is not None and w.left > 0 and nxt[1] != w.holder and w.sent > nxt[0] + SLACK:
                bad(
                    "lease_overlap",
                    f"{res}: {w.holder} (token {w.token}) wrote at {at(w.sent)} with "
                    f"remaining()={w.left:.3f}s, but {nxt[1]} (token {nxt[2]}) held the "
                    f"lock from {at(nxt[0])}",
                )
                successor.pop(w.holder)  # once per holder

        # Accepted writes, each known to have taken effect within [lo, hi]: its log id
        # (exact), or [sent, done]; Y surely before X when Y's hi < X's lo.
        def span(w: Write) -> tuple[float, float]:
            return (w.id, w.id) if exact else (w.sent, w.done)  # type: ignore[return-value]

        def when(w: Write) -> str:
            return f"log id {w.id}" if exact else f"sent {at(w.sent)}"

        acc = [w for w in rw if w.accepted and (exact or w.done is not None)]
        by_hi = sorted(acc, key=lambda w: span(w)[1])
        his = [span(w)[1] for w in by_hi]
        high = list(accumulate(((w.token, w.holder) for w in by_hi), max))
        for w in acc:
            i = bisect.bisect_left(his, span(w)[0])
            if i and high[i - 1][0] > w.token:
                bad(
                    "stale_write_accepted",
                    f"{res}: {w.holder} token {w.token} accepted ({when(w)}) after token "
                    f"{high[i - 1][0]} of {high[i - 1][1]} had been",
                )
        by_lo = sorted(acc, key=lambda w: span(w)[0])
        los = [span(w)[0] for w in by_lo]
        first_done: dict[str, float] = {}  # each holder's first write surely done
        last_sent: dict[str, float] = {}  # and its last write surely not yet sent
        for w in acc:
            lo, hi = span(w)
            first_done[w.holder] = min(first_done.get(w.holder, hi), hi)
            last_sent[w.holder] = max(last_sent.get(w.holder, lo), lo)
        for holder, done in first_done.items():
            sent = last_sent[holder]
            between = by_lo[bisect.bisect_right(los, done) : bisect.bisect_left(los, sent)]
            b = next((b for b in between if b.holder != holder and span(b)[1] < sent), None)
            if b is not None:
                bad(
                    "writes_interleaved",
                    f"{res}: {b.holder} (token {b.token}) wrote ({when(b)}) between writes "
                    f"of {holder}",
                )

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


def check_permit_history(
    holds: list[tuple[Any, ...]], log: list[tuple[Any, ...]], limit: int
) -> dict[str, Any]:
    """Check a permits workload's history from the data alone: ``holds`` and ``log`` as
    ``check_lock_history``'s, the log ids being the order of acceptance (the counted
    fence commits with its log row, on every store). Violations:

    * ``token_reused`` / ``token_not_increasing`` / ``token_changed``: as a lock's (each
      permit has its own token, higher than every one granted before for the key);
    * ``too_many_holders``: more than ``limit`` holders' accepted writes interleaved: at
      a holder's first accepted write, more than ``limit`` holders (it included) had
      written by then and wrote again at or after it.

    (A lock's "stale write" has no counterpart: ``limit`` higher tokens may have written
    and gone while a lower one still holds its permit.)
    """
    found = Findings()
    bad = found.bad
    hs, ws, at, counts = _read_history(holds, log, bad, by_id=True)

    most = 0  # the most holders ever interleaved on one resource
    for res in sorted({h.res for h in hs} | {w.res for w in ws}):
        check_tokens(res, [h for h in hs if h.res == res], bad, at)
        span: dict[str, list[int]] = {}  # holder: [first, last] accepted write's id
        for w in ws:
            if w.res == res and w.accepted:
                span.setdefault(w.holder, [w.id, w.id])[1] = w.id
        for holder, (first, _) in sorted(span.items(), key=lambda item: item[1][0]):
            inside = sorted(g for g, (f, last) in span.items() if f <= first <= last)
            most = max(most, len(inside))
            if len(inside) > limit:
                bad(
                    "too_many_holders",
                    f"{res}: at {holder}'s first write (log id {first}), {len(inside)} "
                    f"holders' writes interleaved (limit {limit}): {', '.join(inside)}",
                )

    return {
        "holds": len(holds),
        "writes": len(log),
        "writes_accepted": counts["accepted"],
        "stale_writes_refused": counts["refused"],
        "writes_unknown": counts["unknown"],
        "writes_after_deadline": counts["after_deadline"],
        "writes_lost_flag_late": counts["lost_flag_late"],
        "most_holders_interleaved": most,
        "violations": found.violations,
        "examples": found.examples,
    }
