"""Every port method of the etcd store, written once as a generator.

An op yields :class:`Rpc` requests (a unary gRPC call and its request message) and
receives their replies; it never does I/O itself. The sync store drives it on a
``grpc.Channel``, the async store on ``grpc.aio``: only the call layer differs.

Each state change is one Txn whose compares guard it (a CAS on revisions or on the
value's owner/token prefix); leases are granted just before the Txn that uses them
and a lease that ends up unused is revoked in the background. A Txn whose reply was
lost (UNAVAILABLE, DEADLINE_EXCEEDED) is re-sent by the driver on another member;
each op reads its own earlier success from the re-sent Txn's answer
(``Rpc.retried``), so nothing is applied twice and a re-sent call is not reported
stale when its first attempt went through.
"""

from __future__ import annotations

import logging
import os
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Generator
from typing import Any, Literal, NamedTuple

from ..._core.port import (
    Acquired,
    Busy,
    Done,
    Granted,
    Held,
    LockRow,
    Mismatch,
    RecordRow,
    StepRow,
)
from . import _codec as K
from . import _rows as R
from ._pb.etcdserverpb import rpc_pb2 as _rpc_pb2

pb: Any = _rpc_pb2  # generated without type information

log = logging.getLogger("idemlock")

#: RPCs that change state: their outcome is unknown when the reply is lost
WRITES = frozenset({"Txn", "DeleteRange", "LeaseGrant", "LeaseRevoke", "Put"})

#: listing page size (keys per Range)
PAGE = 1000


class Rpc:
    """One unary call. ``background``: fire and forget (a cleanup that may fail).
    ``retried`` is set by the driver when it re-sent the request after an unknown
    outcome."""

    __slots__ = ("background", "method", "request", "retried")

    def __init__(self, method: str, request: Any, background: bool = False) -> None:
        self.method = method
        self.request = request
        self.background = background
        self.retried = False


Op = Generator[Rpc, Any, Any]

_BAD = (ValueError, struct.error, UnicodeDecodeError, IndexError)


def _revoke(lease: int) -> Rpc:
    return Rpc("LeaseRevoke", pb.LeaseRevokeRequest(ID=lease), background=True)


def _revoke_leases(kvs: Any) -> Generator[Rpc, Any, None]:
    """Revoke the leases of deleted keys (their ``prev_kvs``), in the background."""
    for prev in kvs:
        if prev.lease:
            yield _revoke(prev.lease)


def _read_one(name: bytes, parse: Callable[[Any], Any]) -> Op:
    """``parse(kv)`` of the key ``name``, None if there is none; a value that cannot be
    read raises StoreCorrupt."""
    resp = yield Rpc("Range", pb.RangeRequest(key=name))
    if not resp.kvs:
        return None
    try:
        return parse(resp.kvs[0])
    except _BAD as exc:
        raise K.corrupt(name, exc) from exc


def _grant(ms: int) -> Rpc:
    return Rpc("LeaseGrant", pb.LeaseGrantRequest(TTL=K.lease_seconds(ms)))


def _move_to_lease(rpc: Rpc, lease: int) -> Op:
    """Send a Txn that puts a key on a freshly granted ``lease``: True if it did. A
    refused Txn revokes the grant (unless re-sent: its first attempt may hold it); a
    done one revokes the key's previous lease."""
    resp = yield rpc
    if not resp.succeeded:
        if not rpc.retried:
            yield _revoke(lease)
        return False
    old = resp.responses[0].response_put.prev_kv.lease
    if old and old != lease:
        yield _revoke(old)
    return True


#: a waiting process keeps its place in a lock's queue this long after its last
#: attempt (seconds; it attempts at least once a second while it waits)
WAITER_S = 3
#: a waiter's next re-check when the lock is free but another process is ahead
QUEUED_MS = 1000


class Waiter:
    """This process's place in one lock's queue: a random id and the create_revision
    of its queue key (0: not queued)."""

    __slots__ = ("rev", "wid")

    def __init__(self) -> None:
        self.wid = os.urandom(8).hex().encode()
        self.rev = 0


#: a grant's attempts at most, each after a conflict (a permit granted meanwhile)
TRIES = 8
#: the re-check of a caller whose every attempt met a permit granted meanwhile
RACE_MS = 50


def _first(qp: bytes, queue_end: bytes, waiter: Waiter | None) -> Any:
    """No other process waits longer for the key (queue keys, ordered by their
    create_revision): this process is the oldest there, or nobody queues."""
    if waiter is not None and waiter.rev:
        return pb.Compare(
            key=qp,
            range_end=queue_end,
            target=pb.Compare.CREATE,
            result=pb.Compare.GREATER,
            create_revision=waiter.rev - 1,
        )
    return pb.Compare(
        key=qp, range_end=queue_end, target=pb.Compare.VERSION, result=pb.Compare.EQUAL
    )


class _Try(NamedTuple):
    """One alternative of a chain of nested Txns: if ``compares`` hold, ``op``."""

    compares: list[Any]
    op: Any


def _chain(tries: list[_Try], last: list[Any]) -> Any:
    """One Txn trying each alternative in turn (each in the failure branch of the one
    before); ``last`` runs if none applies."""
    req = K.txn(tries[-1].compares, [tries[-1].op], last)
    for t in reversed(tries[:-1]):
        req = K.txn(t.compares, [t.op], [K.nested(req)])
    return req


def _which(resp: Any, tries: list[_Try]) -> tuple[_Try | None, Any]:
    """The alternative of a :func:`_chain` that applied, and its TxnResponse; (None,
    the innermost TxnResponse, answering ``last``) if none did."""
    for i, t in enumerate(tries):
        if resp.succeeded:
            return t, resp
        if i + 1 < len(tries):
            resp = resp.responses[0].response_txn
    return None, resp


def _moved(put: Any, lease: int) -> Generator[Rpc, Any, int]:
    """After a put that moved a permit to ``lease``: revoke its previous lease; its
    token."""
    prev = put.prev_kv
    if prev.lease and prev.lease != lease:
        yield _revoke(prev.lease)
    return int(prev.create_revision)


def _rewrite(
    kv: Any,
    owner: str,
    ttl_ms: int,
    lease_s: int,
    written: int,
    lease: int,
    value: bytes | None,
    also: list[Any],
) -> Generator[Rpc, Any, tuple[int, bool]]:
    """Write ``owner``'s permit ``kv`` (as read) again on ``lease``, with new times and
    ``value`` (None: the one it has, which a Txn cannot copy), and do ``also``, if
    nothing changed the permit since the read: (its token, 0 if something did; whether
    the Txn was re-sent)."""
    if value is None:
        try:
            value = K.parse_lock(kv.value).value
        except _BAD as exc:
            raise K.corrupt(kv.key, exc) from exc
    val = K.lock_value(owner, ttl_ms, lease_s, written, value)
    rpc = Rpc(
        "Txn",
        K.txn(
            [K.cmp_mod(kv.key, int(kv.mod_revision))],
            [K.put(kv.key, val, lease, prev=True), *also],
            [],
        ),
    )
    done = yield rpc
    if not done.succeeded:
        return 0, rpc.retried
    yield from _moved(done.responses[0].response_put, lease)
    return int(kv.create_revision), rpc.retried


def _held(holders: Any, now: int) -> Held:
    """Held until the earliest holder's expiry; ``ttl_ms`` (when the caller looks
    again, unless a watch wakes it first) no later than etcd may keep that permit,
    nor than its ttl from now."""
    times = []
    for kv in holders:
        try:
            times.append(K.parse_lock(kv.value).times)
        except _BAD as exc:
            raise K.corrupt(kv.key, exc) from exc
    first = min(times, key=lambda t: t.expires_ms)
    return Held(first.expires_ms, max(1, min(first.left_ms(now), first.ttl_ms)))


def _live_steps(n: K.ClaimNames, kvs: Any, now: int) -> tuple[StepRow, ...]:
    """The steps of one claim key, from a range over ``[n.steps, n.steps_end)`` (its
    steps end first, then its steps by name): none once their end has passed on this
    process's clock (as a completed record's expiry is judged), nor without an end
    (steps whose end was dropped, left for purge or the next step to delete)."""
    if not kvs or kvs[0].key != n.steps:
        return ()
    try:
        end = K.parse_steps_end(kvs[0].value)
    except _BAD as exc:
        raise K.corrupt(n.steps, exc) from exc
    if end <= now:
        return ()
    rows = []
    for kv in kvs[1:]:
        try:
            if kv.key[: len(n.steps) + 1] != n.steps + b"/":
                raise ValueError("not a step's key")
            fence, result = K.parse_step(kv.value)
            name = kv.key[len(n.steps) + 1 :].decode("utf-8", "surrogatepass")
        except _BAD as exc:
            raise K.corrupt(kv.key, exc) from exc
        rows.append(StepRow(name, fence, result))
    return tuple(rows)


class Ops:
    """The op generators over one key root. Keeps, per claim this process was granted,
    its fence and fingerprint, so ``complete`` needs no read first."""

    def __init__(self, root: bytes) -> None:
        self.root = root
        self._wlease: tuple[int, float] = (0, 0.0)
        self._claims: OrderedDict[tuple[str, str, str], tuple[int, str | None]] = OrderedDict()
        #: (ns, key, owner, token) -> the etcd key of a permit this process was granted,
        #: so release and renew send a Txn on that key alone (else on both it may be at)
        self._permits_at: OrderedDict[tuple[str, str, str, int], bytes] = OrderedDict()

    def _remember(self, ns: str, key: str, token: str, fence: int, fp: str | None) -> None:
        self._claims[(ns, key, token)] = (fence, fp)
        if len(self._claims) > 10_000:
            self._claims.popitem(last=False)

    def _granted(self, ns: str, key: str, owner: str, token: int, at: bytes) -> None:
        self._permits_at[(ns, key, owner, token)] = at
        if len(self._permits_at) > 10_000:
            self._permits_at.popitem(last=False)

    def _keys(self, ns: str, key: str, owner: str, token: int, forget: bool) -> tuple[bytes, ...]:
        """Where ``owner``'s permit with ``token`` may be: the key it was granted at if
        this process was, else both."""
        ident = (ns, key, owner, token)
        at = self._permits_at.pop(ident, None) if forget else self._permits_at.get(ident)
        if at is not None:
            return (at,)
        name = K.lock_name(self.root, ns, key)
        return (name, K.holder_name(name, owner))

    # ---- idempotency records ---------------------------------------------------------

    def claim(self, ns: str, key: str, fp: str | None, token: str, lease_ms: int) -> Op:
        # Rows claim.new (absent, or lapsed: the lease marker is gone), claim.resend,
        # claim.mismatch, claim.busy, claim.replay. Every branch also reads the key's
        # steps (one range, empty for a key without steps), so a grant carries them.
        n = K.claim_names(self.root, ns, key)
        g = yield _grant(lease_ms)
        written = K.now_ms()
        steps = K.get(n.steps, n.steps_end)
        take = [
            K.put(n.record, K.inflight_value(token, fp)),
            K.put(n.marker, K.marker_value(lease_ms, int(g.TTL), written), g.ID),
            steps,
        ]
        # absent -> claim; in flight with its lease marker gone (lease over) -> take over
        # (a new fence: the Txn's revision); else read both and decide.
        takeover = K.txn(
            [*K.cmp_range(n.record, b"I", b"J"), K.cmp_create(n.marker, 0)],
            take,
            [K.get(n.record), K.get(n.marker), steps],
        )
        rpc = Rpc("Txn", K.txn([K.cmp_create(n.record, 0)], take, [K.nested(takeover)]))
        resp = yield rpc
        inner = resp.responses[0].response_txn
        if resp.succeeded or inner.succeeded:
            fence = int(resp.header.revision)
            self._remember(ns, key, token, fence, fp)
            read = K.kvs((resp if resp.succeeded else inner).responses[2])
            return Granted(
                token, fence, written + lease_ms, lease_ms, _live_steps(n, read, K.now_ms())
            )
        if not rpc.retried:  # else its first attempt may hold this lease
            yield _revoke(g.ID)
        rec_kvs, marker_kvs = K.kvs(inner.responses[0]), K.kvs(inner.responses[1])
        if not rec_kvs:
            raise K.corrupt(n.record, ValueError("the record vanished inside one Txn"))
        rec = rec_kvs[0]
        try:
            val = K.parse_record(rec.value)
            marker = K.parse_marker(marker_kvs[0].value) if marker_kvs else None
        except _BAD as exc:
            raise K.corrupt(rec.key, exc) from exc
        now = K.now_ms()
        if isinstance(val, K.InFlightVal):
            if marker is None:
                raise K.corrupt(n.record, ValueError("an expired claim was not taken over"))
            if val.token == token:  # a re-sent claim: the same attempt, the same fence
                self._remember(ns, key, token, int(rec.mod_revision), fp)
                return Granted(
                    token,
                    int(rec.mod_revision),
                    marker.expires_ms,
                    marker.expires_ms - now,
                    _live_steps(n, K.kvs(inner.responses[2]), now),
                )
            if val.fp != fp:
                return Mismatch("in_flight")
            return Busy(marker.expires_ms, marker.left_ms(now))
        if val.fp != fp:
            return Mismatch("completed")
        return Done(val.result, val.times.expires_ms)

    def complete(self, ns: str, key: str, token: str, result: bytes, ttl_ms: int) -> Op:
        # Rows complete.ok, complete.late (the record outlives its lease marker),
        # complete.resend, complete.stale.
        n = K.claim_names(self.root, ns, key)
        known = self._claims.get((ns, key, token))
        if known is None:
            resp = yield Rpc("Range", pb.RangeRequest(key=n.record))
            if not resp.kvs:
                return False
            try:
                val = K.parse_record(resp.kvs[0].value)
            except _BAD as exc:
                raise K.corrupt(n.record, exc) from exc
            if isinstance(val, K.DoneVal):
                # Row complete.resend: completed by this attempt with this result (a
                # lost reply re-sent) -> nothing changes, and the call succeeds.
                return (
                    val.token == token
                    and val.result == bytes(result)
                    and val.times.expires_ms > K.now_ms()
                )
            if val.token != token:
                return False  # row complete.stale: another attempt took the key over
            known = (int(resp.kvs[0].mod_revision), val.fp)
        fence, fp = known
        g = yield _grant(ttl_ms)
        written = K.now_ms()
        value = K.done_value(token, fence, fp, bytes(result), ttl_ms, int(g.TTL), written)
        # The key's steps, if live, end with the completed record (in the same Txn; a
        # compare on a missing key for a claim without steps).
        until = K.steps_end_value(written + ttl_ms)
        steps = K.txn(
            [K.cmp_value(n.steps, pb.Compare.GREATER, K.steps_end_value(written))],
            [K.put(n.steps, until)],
            [],
        )
        rpc, resp = yield from self._end_claim(
            ns,
            key,
            token,
            [K.cmp_mod(n.record, fence), *K.cmp_starts(n.record, K.token_prefix(token))],
            K.put(n.record, value, g.ID),
            [K.nested(steps)],
        )
        if resp.succeeded:
            return True
        if not rpc.retried:  # else its first attempt may hold this lease
            yield _revoke(g.ID)
        kv = K.kvs(resp.responses[0])
        # Re-sent after a lost reply, and completed with our token: the first attempt.
        return rpc.retried and bool(kv) and kv[0].value.startswith(K.done_prefix(token) + b"\0")

    def abandon(self, ns: str, key: str, token: str) -> Op:
        # Rows abandon.ok, abandon.late, abandon.stale.
        n = K.claim_names(self.root, ns, key)
        rpc, resp = yield from self._end_claim(
            ns, key, token, K.cmp_starts(n.record, K.token_prefix(token)), K.delete(n.record)
        )
        if resp.succeeded:
            return True
        # Re-sent after a lost reply and now absent: the first attempt deleted it.
        return rpc.retried and not K.kvs(resp.responses[0])

    def _end_claim(
        self,
        ns: str,
        key: str,
        token: str,
        compares: list[Any],
        write: Any,
        also: list[Any] | None = None,
    ) -> Generator[Rpc, Any, tuple[Rpc, Any]]:
        """The one Txn that ends a claim (complete, abandon): if ``compares`` hold,
        ``write`` the record, delete its lease marker (whose lease is then revoked) and
        do ``also``. The Rpc (``retried`` tells a re-send) and its reply."""
        n = K.claim_names(self.root, ns, key)
        ops = [write, K.delete(n.marker, prev=True), *(also or [])]
        rpc = Rpc("Txn", K.txn(compares, ops, [K.get(n.record)]))
        resp = yield rpc
        self._claims.pop((ns, key, token), None)
        if resp.succeeded:
            yield from _revoke_leases(resp.responses[1].response_delete_range.prev_kvs)
        return rpc, resp

    def extend(self, ns: str, key: str, token: str, lease_ms: int) -> Op:
        # Rows extend.ok (the marker still exists), extend.stale.
        n = K.claim_names(self.root, ns, key)
        g = yield _grant(lease_ms)
        written = K.now_ms()
        rpc = Rpc(
            "Txn",
            K.txn(
                [
                    *K.cmp_starts(n.record, K.token_prefix(token)),
                    K.cmp_create(n.marker, 0, pb.Compare.NOT_EQUAL),
                ],
                [K.put(n.marker, K.marker_value(lease_ms, int(g.TTL), written), g.ID, prev=True)],
                [],
            ),
        )
        if not (yield from _move_to_lease(rpc, g.ID)):
            return None
        return written + lease_ms

    def step(
        self,
        ns: str,
        key: str,
        token: str,
        name: str,
        result: bytes | None,
        lease_ms: int,
        ttl_ms: int,
    ) -> Op:
        # Rows step.record, step.stale. The Txn of extend (the claim's token, fence and
        # lease marker; the marker renewed) with, nested, the step and its end:
        #   live (end > now): put the step; the end to now + ttl if that is later;
        #   else none at all (no end, no step): put the step and the end;
        #   else (their end passed): delete them and send the Txn again, which then
        #   finds none (etcd refuses a Txn that deletes a range and puts into it).
        n = K.claim_names(self.root, ns, key)
        fence = yield from self._fence(ns, key, token)
        if fence is None:
            return None
        at = n.step(name)
        value = K.step_value(fence, None if result is None else bytes(result))
        for _ in range(3):
            g = yield _grant(lease_ms)
            written = K.now_ms()
            until = K.steps_end_value(written + ttl_ms)
            later = K.txn(
                [K.cmp_value(n.steps, pb.Compare.LESS, until)], [K.put(n.steps, until)], []
            )
            none = K.txn(
                [K.cmp_no_key(n.steps, n.steps_end)],
                [K.put(at, value), K.put(n.steps, until)],
                [K.delete(n.steps, end=n.steps_end)],
            )
            live = K.txn(
                [K.cmp_value(n.steps, pb.Compare.GREATER, K.steps_end_value(written))],
                [K.put(at, value), K.nested(later)],
                [K.nested(none)],
            )
            resp = yield from self._renewed(n, token, fence, lease_ms, g, written, K.nested(live))
            if resp is None:
                return None
            nested = resp.responses[1].response_txn
            if nested.succeeded or nested.responses[0].response_txn.succeeded:
                return written + lease_ms
            # The steps' end had passed: they are gone now; again, with a new lease.
        raise K.corrupt(n.steps, ValueError("the steps of a key could not be renewed"))

    def drop_step(self, ns: str, key: str, token: str, name: str, lease_ms: int) -> Op:
        # Rows step.drop, step.drop.stale: the Txn of extend, and the step deleted.
        n = K.claim_names(self.root, ns, key)
        fence = yield from self._fence(ns, key, token)
        if fence is None:
            return None
        g = yield _grant(lease_ms)
        written = K.now_ms()
        resp = yield from self._renewed(
            n, token, fence, lease_ms, g, written, K.delete(n.step(name))
        )
        return None if resp is None else written + lease_ms

    def steps(self, ns: str, key: str) -> Op:
        n = K.claim_names(self.root, ns, key)
        resp = yield Rpc("Range", pb.RangeRequest(key=n.steps, range_end=n.steps_end))
        return list(_live_steps(n, resp.kvs, K.now_ms()))

    def _fence(self, ns: str, key: str, token: str) -> Generator[Rpc, Any, int | None]:
        """The fence of the claim with ``token``: known if this process claimed it, else
        read (None: the key is not claimed with that token)."""
        known = self._claims.get((ns, key, token))
        if known is not None:
            return known[0]
        n = K.claim_names(self.root, ns, key)
        resp = yield Rpc("Range", pb.RangeRequest(key=n.record))
        if not resp.kvs:
            return None
        try:
            val = K.parse_record(resp.kvs[0].value)
        except _BAD as exc:
            raise K.corrupt(n.record, exc) from exc
        if not isinstance(val, K.InFlightVal) or val.token != token:
            return None
        return int(resp.kvs[0].mod_revision)

    def _renewed(
        self, n: K.ClaimNames, token: str, fence: int, lease_ms: int, g: Any, written: int, op: Any
    ) -> Generator[Rpc, Any, Any]:
        """One Txn as extend's (the claim in flight with ``token`` and ``fence``, its
        lease marker still there: the marker moved to the fresh lease ``g``) that also
        does ``op``: its reply, or None if the claim is not this attempt's any more."""
        marker = K.marker_value(lease_ms, int(g.TTL), written)
        rpc = Rpc(
            "Txn",
            K.txn(
                [
                    K.cmp_mod(n.record, fence),
                    *K.cmp_starts(n.record, K.token_prefix(token)),
                    K.cmp_create(n.marker, 0, pb.Compare.NOT_EQUAL),
                ],
                [K.put(n.marker, marker, g.ID, prev=True), op],
                [],
            ),
        )
        resp = yield rpc
        if not resp.succeeded:
            if not rpc.retried:  # else its first attempt may hold this lease
                yield _revoke(g.ID)
            return None
        old = resp.responses[0].response_put.prev_kv.lease
        if old and old != g.ID:
            yield _revoke(old)
        return resp

    def record(self, ns: str, key: str) -> Op:
        n = K.claim_names(self.root, ns, key)
        resp = yield Rpc("Txn", K.txn([], [K.get(n.record), K.get(n.marker)], []))
        rec, marker = K.kvs(resp.responses[0]), K.kvs(resp.responses[1])
        if not rec:
            return None
        try:
            return R.record_row(ns, key, rec[0], marker[0] if marker else None)
        except _BAD as exc:
            raise K.corrupt(n.record, exc) from exc

    def forget(self, ns: str, key: str) -> Op:
        # Rows forget.live, forget.dead.
        n = K.claim_names(self.root, ns, key)
        resp = yield Rpc(
            "Txn",
            K.txn(
                [],
                [
                    K.delete(n.record, prev=True),
                    K.delete(n.marker, prev=True),
                    K.delete(n.steps, end=n.steps_end),
                ],
                [],
            ),
        )
        rec = resp.responses[0].response_delete_range.prev_kvs
        marker = resp.responses[1].response_delete_range.prev_kvs
        yield from _revoke_leases((*rec, *marker))
        if not rec:
            return False
        try:
            return R.record_row(ns, key, rec[0], marker[0] if marker else None) is not None
        except _BAD:
            return True  # a corrupt value was there, and now is not

    def records(self, ns_prefix: str) -> Op:
        rows: list[RecordRow] = []
        pending: dict[tuple[str, str], list[Any]] = {}
        for ns, key, suffix, kv in (yield from self._listing("c", ns_prefix, rows)):
            if suffix[:1] == b"e":
                continue  # the key's steps
            if suffix not in (b"r", b"t"):
                rows.append(R.corrupt("c", kv.key, "an unknown key name"))
                continue
            pair = pending.setdefault((ns, key), [None, None])
            pair[0 if suffix == b"r" else 1] = kv
        for (ns, key), (rec, marker) in pending.items():
            if rec is None:
                continue  # a lease marker alone: its record is being written or deleted
            try:
                row = R.record_row(ns, key, rec, marker)
            except _BAD as exc:
                rows.append(R.corrupt("c", rec.key, str(exc), ns, key))
                continue
            if row is not None:
                rows.append(row)
        return rows

    # ---- locks and permits -----------------------------------------------------------
    #
    # A lock is the limit=1 case of a key's permits (rows lock.*). Each permit is an etcd
    # key of its own on an etcd lease of its own (holders expire one by one, on etcd's
    # clock); its token is the key's create_revision, so tokens strictly increase per
    # key over every permit ever granted (revisions never repeat). A permit granted
    # with limit=1 is the lock name itself, byte for byte the lock of the previous
    # releases: a process of the previous release and one of this release keep
    # excluding each other while a deployment upgrades. A permit granted with a higher
    # limit is ``name + NUL + owner``. An owner has one permit at most: every op looks
    # for it at both. ``[name, lock_end(name))`` holds exactly the key's permits.
    #
    # Counting, in one Txn, under races. An etcd compare cannot count keys, but it can
    # hold for every key of a range. A grant is conditioned on what a read saw: "no key
    # of the range was created after revision R" (``cmp_created_by``) means the holders
    # now are some of those read at R (others may have expired or been freed since),
    # so fewer than the caller's limit at R is fewer now: never an over-grant, whatever
    # limits concurrent callers pass, since every caller counts every holder of the
    # range. The read is the refused Txn's own failure branch, not a Range of its own:
    # an acquire first tries "nobody holds the key" (the only grant a lock can get: one
    # Txn, as before), and a key with holders and room costs a second Txn, conditioned
    # on the first one's read. A conflict (a permit created meanwhile: another caller
    # got it, so the callers as a whole progress) reads again in the same refused Txn,
    # at most TRIES times; then the caller is answered Held for RACE_MS.
    #
    # Slot keys 0..limit-1 taken in nested Txns were the other way; they cannot serve
    # mixed limits without a count either: a limit-2 caller finding slot 0 free must
    # still count the slots >= 2 a limit-3 caller took.
    #
    # Hand-off: the waiters' queue as before. A grant also needs that no other process
    # waits longer (its queue key), so a permit freed while processes wait goes to the
    # oldest one; a refused Txn reads the queue's head to know whether it is this one.

    def acquire(
        self,
        ns: str,
        key: str,
        owner: str,
        ttl_ms: int,
        limit: int = 1,
        value: bytes | None = None,
        waiter: Waiter | None = None,
    ) -> Op:
        """``waiter``: this process has callers waiting for the key; they queue up."""
        # Rows lock.acquire, lock.reacquire, lock.busy; the waiters' queue is etcd's
        # hand-off (lock.handoff, lock.handoff.take: a permit freed while another
        # process waited longer is its turn).
        name = K.lock_name(self.root, ns, key)
        end = K.lock_end(name)
        qp = K.queue_prefix(self.root, ns, key)
        queue_end = K.prefix_end(qp)
        g = yield _grant(ttl_ms)
        wlease = 0
        if waiter is not None:
            wlease = yield from self._waiter_lease()
        written = K.now_ms()
        lease_s = int(g.TTL)
        val = K.lock_value(owner, ttl_ms, lease_s, written, value)
        at = name if limit <= 1 else K.holder_name(name, owner)
        take = [K.put(at, val, g.ID)]
        refused = [K.get(name, end), K.oldest(qp, queue_end)]
        leave: list[Any] = []
        if waiter is not None:
            leave = [K.delete(qp + waiter.wid)]
            take.extend(leave)
            refused.insert(0, K.put(qp + waiter.wid, b"", wlease, prev=True))
        held = K.held_prefix(owner)
        seen: int | None = None  # the revision of a read that found room
        resent = False
        reply: Acquired | Held | None = None
        for _ in range(TRIES):
            if seen is None:
                # First: nobody holds the key (a limit below 1 never has room).
                room = K.cmp_no_key(name, end) if limit >= 1 else K.cmp_created_by(name, end, -1)
            else:
                room = K.cmp_created_by(name, end, seen)
            rpc = Rpc("Txn", K.txn([room, _first(qp, queue_end, waiter)], take, refused))
            resp = yield rpc
            resent = resent or rpc.retried
            if resp.succeeded:
                if waiter is not None:
                    waiter.rev = 0
                self._granted(ns, key, owner, int(resp.header.revision), at)
                return Acquired(int(resp.header.revision), written + ttl_ms, ttl_ms)
            reads = list(resp.responses)
            if waiter is not None:
                prev = reads.pop(0).response_put
                waiter.rev = (
                    int(prev.prev_kv.create_revision)
                    if prev.HasField("prev_kv")
                    else int(resp.header.revision)
                )
            holders, head = K.kvs(reads[0]), K.kvs(reads[1])
            kv = next((kv for kv in holders if kv.value.startswith(held)), None)
            if kv is not None:
                # Row lock.reacquire: the owner's own permit (a re-sent acquire; rare,
                # so not in the Txn above): same token, new lease and expiry.
                args = (owner, ttl_ms, lease_s, written, g.ID, value, leave)
                token, again = yield from _rewrite(kv, *args)
                resent = resent or again
                if token:
                    if waiter is not None:
                        waiter.rev = 0
                    self._granted(ns, key, owner, token, bytes(kv.key))
                    return Acquired(token, written + ttl_ms, ttl_ms)
                continue  # it changed since the read: look again
            ours = not head or (waiter is not None and head[0].key == qp + waiter.wid)
            if len(holders) < limit and ours:
                seen = int(resp.header.revision)  # room at this read: take it if unchanged
                continue
            now = K.now_ms()
            # Full for the caller's limit; else room, but another process's turn.
            full = holders and len(holders) >= limit
            reply = _held(holders, now) if full else Held(now + QUEUED_MS, QUEUED_MS)
            break
        if reply is None:  # every try met a permit granted meanwhile
            reply = Held(K.now_ms() + RACE_MS, RACE_MS)
        if not resent:  # else a first attempt may hold this lease
            yield _revoke(g.ID)
        return reply

    def _waiter_lease(self) -> Generator[Rpc, Any, int]:
        """The lease this store's queue keys live on: granted for WAITER_S, replaced
        once it is a second old, so a queue key outlives its last attempt by at least
        WAITER_S - 1 s and a process that stopped waiting leaves the queue soon."""
        lease, at = self._wlease
        if lease and time.monotonic() - at < 1.0:
            return lease
        g = yield Rpc("LeaseGrant", pb.LeaseGrantRequest(TTL=WAITER_S))
        self._wlease = (int(g.ID), time.monotonic())
        return int(g.ID)

    def leave_queue(self, ns: str, key: str, waiter: Waiter) -> Op:
        """This process stopped waiting for the key: give up its place."""
        qp = K.queue_prefix(self.root, ns, key)
        yield Rpc("DeleteRange", pb.DeleteRangeRequest(key=qp + waiter.wid))
        waiter.rev = 0

    def release(self, ns: str, key: str, owner: str, token: int) -> Op:
        # Rows lock.release, lock.release.stale.
        name = K.lock_name(self.root, ns, key)
        held = K.held_prefix(owner)
        tries = [
            _Try([K.cmp_create(k, token), *K.cmp_prefix(k, held)], K.delete(k, True))
            for k in self._keys(ns, key, owner, token, forget=True)
        ]
        rpc = Rpc("Txn", _chain(tries, []))
        resp = yield rpc
        hit, inner = _which(resp, tries)
        if hit is not None:
            yield from _revoke_leases(inner.responses[0].response_delete_range.prev_kvs)
            return True
        if not rpc.retried:
            return False
        # Re-sent after a lost reply, and the permit is gone: the first attempt freed it.
        found = yield Rpc(
            "Range", pb.RangeRequest(key=name, range_end=K.lock_end(name), keys_only=True)
        )
        return not any(int(kv.create_revision) == token for kv in found.kvs)

    def break_lock(self, ns: str, key: str, token: int | None = None) -> Op:
        """State table row ``lock.break``: every permit freed (``token`` None, in one
        DeleteRange), or the permit with ``token`` (a read finds its key, then a Txn
        deletes it if it still has that token). Later acquires create keys at later
        revisions (higher tokens); the old holders' compares on their create revisions
        fail. A re-sent call whose first attempt went through finds nothing and answers
        False."""
        name = K.lock_name(self.root, ns, key)
        end = K.lock_end(name)
        if token is None:
            resp = yield Rpc(
                "DeleteRange", pb.DeleteRangeRequest(key=name, range_end=end, prev_kv=True)
            )
            yield from _revoke_leases(resp.prev_kvs)
            return bool(resp.deleted)
        found = yield Rpc("Range", pb.RangeRequest(key=name, range_end=end, keys_only=True))
        for kv in found.kvs:
            if int(kv.create_revision) == token:
                resp = yield Rpc(
                    "Txn",
                    K.txn([K.cmp_create(kv.key, token)], [K.delete(kv.key, prev=True)], []),
                )
                if not resp.succeeded:
                    return False
                yield from _revoke_leases(resp.responses[0].response_delete_range.prev_kvs)
                return True
        return False

    def release_owner(self, ns: str, key: str, owner: str, waiter: Waiter | None = None) -> Op:
        """Free ``owner``'s permit if it has one (undo of an acquire whose reply is
        lost), and give up ``waiter``'s place in the key's queue."""
        name = K.lock_name(self.root, ns, key)
        tries = [
            _Try(K.cmp_prefix(k, K.held_prefix(owner)), K.delete(k, True))
            for k in (name, K.holder_name(name, owner))
        ]
        resp = yield Rpc("Txn", _chain(tries, []))
        hit, inner = _which(resp, tries)
        if hit is not None:
            yield from _revoke_leases(inner.responses[0].response_delete_range.prev_kvs)
        if waiter is not None:
            yield from self.leave_queue(ns, key, waiter)
        return hit is not None

    def renew(
        self, ns: str, key: str, owner: str, token: int, ttl_ms: int, value: bytes | None = None
    ) -> Op:
        # Rows lock.renew, lock.renew.stale.
        keys = self._keys(ns, key, owner, token, forget=False)
        g = yield _grant(ttl_ms)
        written = K.now_ms()
        lease_s = int(g.TTL)
        val = K.lock_value(owner, ttl_ms, lease_s, written, value)
        # Without a new value, a permit that published one keeps it: a Txn cannot copy
        # it, so only a permit without one is written here (a lock: one Txn), and one
        # with a value read and written back by _rewrite.
        ours = K.held_prefix(owner) if value is not None else K.plain_prefix(owner)
        tries = [
            _Try([K.cmp_create(k, token), *K.cmp_prefix(k, ours)], K.put(k, val, g.ID, prev=True))
            for k in keys
        ]
        valued = K.valued_prefix(owner)
        resent = False
        for _ in range(TRIES):
            rpc = Rpc("Txn", _chain(tries, [K.get(k) for k in keys]))
            resp = yield rpc
            resent = resent or rpc.retried
            hit, inner = _which(resp, tries)
            if hit is not None:
                yield from _moved(inner.responses[0].response_put, g.ID)
                return written + ttl_ms
            kv = next(
                (
                    kv
                    for r in inner.responses
                    for kv in K.kvs(r)
                    if int(kv.create_revision) == token and kv.value.startswith(valued)
                ),
                None,
            )
            if kv is None or value is not None:
                break
            kept, again = yield from _rewrite(kv, owner, ttl_ms, lease_s, written, g.ID, None, [])
            resent = resent or again
            if kept:
                return written + ttl_ms
        if not resent:  # else a first attempt may hold this lease
            yield _revoke(g.ID)
        return None

    def _permits(self, ns: str, key: str) -> Generator[Rpc, Any, list[LockRow]]:
        """Every permit of a key, lowest token first."""
        name = K.lock_name(self.root, ns, key)
        resp = yield Rpc("Range", pb.RangeRequest(key=name, range_end=K.lock_end(name)))
        rows = []
        for kv in resp.kvs:
            try:
                rows.append(R.lock_row(ns, key, kv))
            except _BAD as exc:
                raise K.corrupt(kv.key, exc) from exc
        return sorted(rows, key=lambda r: r.token)

    def lock(self, ns: str, key: str) -> Op:
        rows = yield from self._permits(ns, key)
        return rows[0] if rows else None

    def holders(self, ns: str, key: str) -> Op:
        return (yield from self._permits(ns, key))

    def locks(self, ns_prefix: str) -> Op:
        rows: list[LockRow] = []
        for ns, key, _, kv in (yield from self._listing("l", ns_prefix, rows)):
            try:
                rows.append(R.lock_row(ns, key, kv))
            except _BAD as exc:
                rows.append(R.corrupt("l", kv.key, str(exc), ns, key))
        return sorted(rows, key=lambda r: (r.ns, r.key, r.token))

    # ---- fences ----------------------------------------------------------------------

    def fence_advance(self, ns: str, resource: str, token: int) -> Op:
        # Rows fence.advance, fence.stale.
        gate = K.gate_name(self.root, ns, resource)
        mine = K.gate_value(token)
        # A higher token is on the gate -> refuse (and read it); else (lower, equal or
        # no gate: etcd fails a value compare on a missing key) -> write ours.
        resp = yield Rpc(
            "Txn",
            K.txn(
                [K.cmp_value(gate, pb.Compare.GREATER, mine)], [K.get(gate)], [K.put(gate, mine)]
            ),
        )
        if not resp.succeeded:
            return True, token
        kv = K.kvs(resp.responses[0])
        try:
            return False, K.parse_gate(kv[0].value)
        except _BAD as exc:
            raise K.corrupt(gate, exc) from exc

    def fence_current(self, ns: str, resource: str) -> Op:
        gate = K.gate_name(self.root, ns, resource)
        return (yield from _read_one(gate, lambda kv: K.parse_gate(kv.value)))

    def purge(self, dry_run: bool = False) -> Op:
        """Delete in-flight records whose lease ended (locks and completed records go
        with their etcd leases by themselves); with ``dry_run``, only count them. Steps
        whose end passed go too (not counted)."""
        kvs = yield from self._scan(self.root + b"c/")
        rev = int(kvs[0].mod_revision) if kvs else 0
        records: dict[bytes, Any] = {}
        markers: set[bytes] = set()
        ends: dict[bytes, Any] = {}  # base -> its steps end (None: steps without one)
        for kv in kvs:
            rev = max(rev, int(kv.mod_revision))
            parsed = K.parse_name(self.root, "c", kv.key)
            if parsed is None:
                continue
            suffix = parsed[2]
            base = kv.key[: len(kv.key) - len(suffix)]
            if suffix == b"r" and kv.value[:1] == b"I":
                records[base] = kv
            elif suffix == b"t":
                markers.add(base)
            elif suffix == b"e":
                ends[base] = kv
            elif suffix[:2] == b"e/":
                ends.setdefault(base, None)
        if not dry_run:
            yield from self._purge_steps(ends, rev)
        removed = 0
        for base, kv in records.items():
            if base in markers:
                continue
            if dry_run:
                removed += 1
                continue
            resp = yield Rpc(
                "Txn",
                K.txn(
                    [K.cmp_mod(kv.key, int(kv.mod_revision)), K.cmp_create(base + b"t", 0)],
                    [K.delete(kv.key)],
                    [],
                ),
            )
            removed += bool(resp.succeeded)
        return removed

    def _purge_steps(self, ends: dict[bytes, Any], rev: int) -> Op:
        """Delete the steps of each claim key whose end passed (or that have none),
        each in a Txn that holds if nothing changed them since the scan (at ``rev``)."""
        now = K.now_ms()
        for base, end in ends.items():
            if end is not None:
                try:
                    if K.parse_steps_end(end.value) > now:
                        continue
                except _BAD:
                    continue  # reported by whoever reads them; not purge's to delete
            first, last = base + b"e", base + b"f"
            same = (
                K.cmp_mod(first, int(end.mod_revision))
                if end is not None
                else K.cmp_create(first, 0)
            )
            unchanged = pb.Compare(
                key=first,
                range_end=last,
                target=pb.Compare.MOD,
                result=pb.Compare.LESS,
                mod_revision=rev + 1,
            )
            yield Rpc("Txn", K.txn([same, unchanged], [K.delete(first, end=last)], []))

    # ---- helpers ---------------------------------------------------------------------

    def _listing(
        self, kind: Literal["c", "l"], ns_prefix: str, rows: list[Any]
    ) -> Generator[Rpc, Any, list[tuple[str, str, bytes, Any]]]:
        """``(ns, key, suffix, kv)`` of every key of ``kind`` ("c" claims, "l" locks)
        under ``ns_prefix``; a key whose name cannot be read goes to ``rows`` as a
        corrupt row."""
        found = []
        for kv in (yield from self._scan(K.listing_prefix(self.root, kind, ns_prefix))):
            parsed = K.parse_name(self.root, kind, kv.key)
            if parsed is None:
                rows.append(R.corrupt(kind, kv.key, "an unknown key name"))
            elif parsed[0].startswith(ns_prefix):
                found.append((*parsed, kv))
        return found

    def _scan(self, prefix: bytes) -> Generator[Rpc, Any, list[Any]]:
        """Every key under ``prefix``, in pages, all read at one revision."""
        out: list[Any] = []
        start, end, rev = prefix, K.prefix_end(prefix), 0
        while True:
            resp = yield Rpc(
                "Range", pb.RangeRequest(key=start, range_end=end, limit=PAGE, revision=rev)
            )
            out.extend(resp.kvs)
            rev = rev or int(resp.header.revision)
            if not resp.more or not resp.kvs:
                return out
            start = resp.kvs[-1].key + b"\0"
