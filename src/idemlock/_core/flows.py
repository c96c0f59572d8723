"""Multi-step flows written once, as generators, for a sync and an async driver.

A flow yields requests (:class:`Call`, :class:`Subscribe`, :class:`Wait`,
:class:`Sleep`, :class:`Now`) and receives their results; it never blocks, awaits or
reads a clock itself. The drivers in :mod:`idemlock._drive` are the only code that
does. An exception raised by a request is thrown into the flow at the ``yield``, so a
flow may handle it. What several threads share (:class:`RenewState`) is guarded by a
lock its maker gives it: this module holds no lock and starts no thread.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Generator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from .port import Acquired, Busy, Channel, ClaimReply, Held
from .types import Lease, from_ms


@dataclass(frozen=True, slots=True)
class Call:
    """Call ``store.<method>(*args)``."""

    method: str
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Subscribe:
    """Start listening on a channel; the driver closes it when the flow ends."""

    channel: Channel


@dataclass(frozen=True, slots=True)
class Wait:
    """Wait on a subscription for at most ``timeout`` seconds; result: notified or not."""

    sub: Any
    timeout: float


@dataclass(frozen=True, slots=True)
class Sleep:
    """Sleep ``seconds``; result: True if the driver's stop signal ended it early."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Now:
    """The time, in monotonic seconds: on the driver's clock (it judges leases; a
    ``ManualClock`` in tests), or with ``real`` on the machine's (a wait takes real time
    whatever the clock)."""

    real: bool = False


NOW = Now()
REAL_NOW = Now(real=True)

Request = Call | Subscribe | Wait | Sleep | Now
Flow = Generator[Request, Any, Any]

#: Longest single wait between re-checks: bounds the cost of a lost notification
#: (a dropped connection, a store without cross-process notification).
MAX_WAIT_CHUNK = 1.0


def _backoff(attempt: int, cap: float) -> float:
    # Short, jittered, growing: 1 ms, 2 ms, 4 ms ... up to ``cap``.
    base: float = min(cap, 0.001 * (2**attempt))
    return base * (0.5 + random.random() / 2)


def wait_chunk(deadline: float, now: float, holder_ttl_ms: int, poll_cap: float | None) -> float:
    """How long to wait before the next attempt: until the deadline, the holder's
    expiry or the chunk cap, whichever is first."""
    chunk = min(deadline - now, holder_ttl_ms / 1000 + 0.001, MAX_WAIT_CHUNK)
    if poll_cap is not None:
        chunk = min(chunk, poll_cap)
    return max(0.0, chunk)


class _Waiting:
    """A caller waiting for a key another holds, between its attempts."""

    __slots__ = ("attempt", "channel", "deadline", "poll_cap", "sub")

    def __init__(self, channel: Channel, deadline: float, poll_cap: float | None) -> None:
        self.channel = channel
        #: on the machine's clock (REAL_NOW): an injected clock judges leases only
        self.deadline = deadline
        self.poll_cap = poll_cap
        self.sub: Any = None
        self.attempt = 0

    def turn(self, holder_ttl_ms: int) -> Generator[Request, Any, bool]:
        """After a refused attempt: False once the wait is over, else True when the
        caller may try again (after subscribing, or after a wait for a notification)."""
        now = yield REAL_NOW
        if now >= self.deadline:
            return False
        if self.sub is None:
            # Subscribe, then try once more: a release between our failed attempt and
            # the subscription would otherwise go unnoticed until the next chunk.
            self.sub = yield Subscribe(self.channel)
            return True
        cap = self.poll_cap if self.poll_cap is None else _backoff(self.attempt, self.poll_cap)
        self.attempt += 1
        yield Wait(self.sub, wait_chunk(self.deadline, now, holder_ttl_ms, cap))
        return True


def acquire_flow(
    ns: str,
    key: str,
    owner: str,
    ttl_ms: int,
    wait: float | None,
    poll_cap: float | None = None,
    limit: int = 1,
    value: bytes | None = None,
    on_wait: Callable[[], None] | None = None,
) -> Generator[Request, Any, tuple[Acquired | Held, float, int]]:
    """Acquire, waiting up to ``wait`` seconds. Returns (last reply, the clock's time the
    last request was sent, number of attempts); ``limit``: how many holders the key
    may have (1: a lock); ``value``: published with the lease. ``poll_cap`` bounds
    each wait for stores whose notification does not cross processes. ``on_wait`` is
    called once, when the first attempt was refused and the caller goes on waiting."""
    deadline = (yield REAL_NOW) + (wait or 0.0)
    waiting = _Waiting(Channel("lock", ns, key), deadline, poll_cap)
    tries = 0
    while True:
        sent = yield NOW
        reply = yield Call("acquire", (ns, key, owner, ttl_ms, limit, value))
        tries += 1
        if isinstance(reply, Acquired) or not (yield from waiting.turn(reply.ttl_ms)):
            return reply, sent, tries
        if tries == 1 and on_wait is not None:
            on_wait()


def claim_flow(
    ns: str,
    key: str,
    fp: str | None,
    token: str,
    lease_ms: int,
    wait: float | None,
    poll_cap: float | None = None,
    sent: list[float] | None = None,
) -> Generator[Request, Any, ClaimReply]:
    """Claim, and while the key is in flight wait up to ``wait`` seconds for it to be
    completed (replay) or freed (then this caller claims it and runs). ``sent``, if
    given, receives the clock's time of the last claim request (a heartbeat counts
    the claim's local deadline from it)."""
    deadline = (yield REAL_NOW) + (wait or 0.0)
    waiting = _Waiting(Channel("claim", ns, key), deadline, poll_cap)
    while True:
        if sent is not None:
            sent[:] = [(yield NOW)]
        reply: ClaimReply = yield Call("claim", (ns, key, fp, token, lease_ms))
        if not isinstance(reply, Busy) or not (yield from waiting.turn(reply.ttl_ms)):
            return reply


@dataclass
class RenewState:
    """What the renew loop, the watchdog and the holder share about one held lease.

    The lease is lost at its local deadline (``sent + ttl``, on the client's clock)
    unless a renewal confirmed before then moved it: whoever finds it lost first (the
    renew loop, the watchdog, or the holder leaving the block) marks it, and the one
    that marks it calls ``notify`` once, while the block still runs. ``guard`` (a
    ``threading.Lock`` from the port that makes it) orders those three."""

    expires_ms: int
    sent: float
    ttl_ms: int = 0
    lost: bool = False
    reason: str = ""
    #: the holder's lease, kept current so ``remaining()`` reflects each renewal
    lease: Lease | None = None
    #: the claim token of a heartbeat-renewed claim (its ``lost`` flag is set on loss)
    claim: Any = None
    #: told (outcome, seconds the attempt took, error type or None) after each renewal
    report: Callable[[str, float, str | None], None] | None = None
    #: reports the loss (event, ``on_lost``, cancelling the body)
    notify: Callable[[], None] | None = None
    #: told the new local deadline after each confirmed renewal (moves the watchdog)
    moved: Callable[[float], None] | None = None
    #: why renewal stopped on purpose (``max_hold``): the reason once the lease runs out
    stopped: str = ""
    #: the block is leaving: nothing is adopted or reported any more
    ended: bool = False
    guard: AbstractContextManager[Any] = field(kw_only=True, repr=False)

    def tell(self, outcome: str, seconds: float, error: str | None = None) -> None:
        if self.report is not None:
            self.report(outcome, seconds, error)

    def deadline(self) -> float:
        return self.sent + self.ttl_ms / 1000

    def mark_lost(self, reason: str) -> bool:
        """Mark the lease lost; True for the first caller while the block runs, who
        must then call :meth:`report_lost`."""
        with self.guard:
            if self.lost or self.ended:
                return False
            self.lost, self.reason = True, reason
            self._flag()
            return True

    def _flag(self) -> None:
        if self.lease is not None:
            self.lease.lost = True
        if self.claim is not None:
            # ClaimToken is frozen; ``lost`` is outside its equality and hash.
            object.__setattr__(self.claim, "lost", True)

    def report_lost(self) -> None:
        if self.notify is not None:
            self.notify()

    def lose(self, reason: str) -> None:
        if self.mark_lost(reason):
            self.report_lost()

    def expired_reason(self) -> str:
        return self.stopped or (
            f"its {self.ttl_ms / 1000:g}s lease ran out before a renewal was confirmed "
            "(the store did not answer in time)"
        )

    def adopt(self, sent: float, new_exp: int, now: float) -> bool:
        """Take a confirmed renewal, unless the lease was lost first or the reply came
        after the old deadline (what ran after it was unprotected: report, not hide)."""
        with self.guard:
            if self.lost or self.ended:
                return False
            if now >= self.deadline():
                late = True
            else:
                late = False
                self.sent, self.expires_ms = sent, int(new_exp)
                if self.lease is not None:
                    self.lease._sent, self.lease.expires_at = sent, from_ms(int(new_exp))
        if late:
            self.lose("renewal came after the lease had run out")
            return False
        if self.moved is not None:
            self.moved(self.deadline())
        return True

    def end(self, now: float) -> bool:
        """The block is leaving: report a deadline that passed unnoticed, stop every
        later report, and return whether the lease was lost."""
        late = False
        with self.guard:
            if not self.lost and not self.ended and now >= self.deadline():
                late = True
                self.lost, self.reason = True, self.expired_reason()
                self._flag()
            self.ended = True
            lost = self.lost
        if late:
            self.report_lost()
        return lost


@dataclass(eq=False)
class Renewal:
    """One claim or lease a coordinator's renewer keeps alive.

    ``args`` are the store arguments before the duration: ``(ns, key, token)`` for a
    claim (``extend``), ``(ns, key, owner, token)`` for a lock (``renew``)."""

    kind: str
    args: tuple[Any, ...]
    lease_ms: int
    every: float
    state: RenewState
    #: when the next renewal is due (monotonic seconds on the coordinator's clock)
    next_at: float
    #: stop renewing at this time (``max_run`` / ``max_hold``); None: never
    until: float | None = None
    #: why renewal stops at ``until`` (the reason given once the lease runs out)
    until_reason: str = ""
    #: transient failures in a row (backoff)
    attempt: int = 0
    #: removed from the renewer (the block ended or the lease was lost)
    done: bool = False

    def store_call(self) -> tuple[str, tuple[Any, ...]]:
        method = "extend" if self.kind == "claim" else "renew"
        return method, (*self.args, self.lease_ms)

    def batch_item(self) -> tuple[Any, ...]:
        return (self.kind, *self.args, self.lease_ms)


#: renewals due within this many seconds of the first one go in the same batch, so a
#: thousand claims taken over a few milliseconds share round trips instead of each
#: waking the renewer on its own
GATHER = 0.05

#: where the store renews in batches (``renew_many``), a batch also renews every renewal
#: due within this fraction of its own interval: renewing early only extends a lease and
#: adds no round trip, and the renewals it pulls forward are due at the same time
#: afterwards. Claims that arrive steadily then converge on a few phases instead of each
#: keeping its own: two batches are at least ``EARLY * every`` apart, so a renewer sends
#: at most about ``1 / EARLY + 1`` batches per interval, however many it renews and
#: however their start times were spread. The price: a renewal pulled forward is renewed
#: again after ``every`` from then (at most ``1 / (1 - EARLY)`` times as many items per
#: second while the phases converge, none once they have).
EARLY = 0.5


def gather_horizon(longest_every: float, batched: bool) -> float:
    """How far past ``now`` a batch looks for renewals to take (the renewer pops its
    heap up to ``now`` plus this), given the longest interval among its renewals."""
    return max(GATHER, EARLY * longest_every) if batched else GATHER


def joins_batch(r: Renewal, now: float, batched: bool) -> bool:
    """Whether a batch sent at ``now`` renews ``r`` (live, due at ``r.next_at``): when it
    is due within :data:`GATHER`; where the store renews in batches, also when it is due
    within :data:`EARLY` of its interval, unless renewal stops (``max_run``,
    ``max_hold``) before it is due: pulling that one forward would extend the lease past
    what the limit leaves it. Without ``renew_many`` each renewal is a call of its own,
    so none is pulled forward: it would only add calls."""
    ahead = r.next_at - now
    if ahead <= GATHER:
        return True
    if not batched or ahead > EARLY * r.every:
        return False
    return r.until is None or r.until > r.next_at


def _renew_failed(r: Renewal, exc: Exception, sent: float, now: float) -> None:
    r.state.tell("error", now - sent, type(exc).__name__)
    left = r.state.deadline() - now
    if left <= 0:
        r.state.lose(f"renewal failed: {exc}")
        r.done = True
        return
    r.attempt += 1
    r.next_at = now + min(_backoff(r.attempt, 0.25), left)


def _renew_answered(r: Renewal, sent: float, new_exp: int | None, now: float) -> None:
    r.attempt = 0
    r.state.tell("failed" if new_exp is None else "ok", now - sent)
    if new_exp is None:
        what = "claim" if r.kind == "claim" else "lease"
        r.state.lose(f"the store no longer holds this {what} (it expired or was taken over)")
        r.done = True
        return
    if not r.state.adopt(sent, int(new_exp), now):
        r.done = True
        return
    r.next_at = sent + r.every


def renew_batch_flow(batch: list[Renewal], batched: bool) -> Generator[Request, Any, None]:
    """Renew every item of ``batch`` (all due now): one ``renew_many`` call when the
    store has a batched renewal, else one ``extend``/``renew`` call each. Each item's
    state adopts its confirmed renewal, or is lost when the store says it is gone; a
    transient failure is retried with backoff while the item's lease has time. The
    watchdog, not this flow, decides a loss by time."""
    from .._errors import StoreUnavailable

    if batched:
        sent = yield NOW
        try:
            replies = yield Call("renew_many", ([r.batch_item() for r in batch],))
        except StoreUnavailable as exc:
            now = yield NOW
            for r in batch:
                _renew_failed(r, exc, sent, now)
            return
        now = yield NOW
        for r, reply in zip(batch, replies, strict=True):
            _renew_answered(r, sent, reply, now)
        return
    for r in batch:
        if r.state.lost or r.done:
            continue
        sent = yield NOW
        method, args = r.store_call()
        try:
            reply = yield Call(method, args)
        except StoreUnavailable as exc:
            _renew_failed(r, exc, sent, (yield NOW))
            continue
        _renew_answered(r, sent, reply, (yield NOW))
