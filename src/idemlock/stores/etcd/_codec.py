"""What the sync and async etcd stores share: key names, value encoding, request
building and reply parsing. Nothing here does I/O.

Keys (``R`` = root, ``esc`` escapes ``%``, ``/`` and NUL so the first ``/`` after the
kind ends the namespace, and escaping keeps prefixes)::

    R c/<esc ns>/<key> \\0 r     claim record (no lease: it outlives its claim's lease)
    R c/<esc ns>/<key> \\0 t     claim lease marker, on the claim's etcd lease
    R c/<esc ns>/<key> \\0 e     the end of the key's steps (no lease)
    R c/<esc ns>/<key> \\0 e/<name>  one step recorded inside the claim (no lease)
    R l/<esc ns>/<key>           a lock, or a permit granted with limit=1, on its lease
    R l/<esc ns>/<key> \\0 <owner>  a permit granted with a higher limit, on its lease
    R q/<esc ns>/<key> \\0 <id>    a process waiting for that lock (fair hand-off)
    R f/<esc ns>/<resource>      fence gate (no lease: a gate that forgot would accept
                                 a stale writer)

The record and its marker share the prefix ``... \\0`` so one watch covers both;
the steps live under the same prefix (forget drops them with one DeleteRange), but
outside the watched range ``[... \\0 r, ... \\0 t \\0)``: a step written or dropped
wakes nobody waiting for the claim (:func:`claim_watch_range`).
User keys hold no control characters (validated), so ``\\0`` cannot occur in them: the
range ``[R l/<esc ns>/<key>, R l/<esc ns>/<key> \\x01)`` holds exactly one key's permits
(:func:`lock_end`), and one watch of it sees each of them freed.

Values are binary and start with a kind byte; the owner or token follows right after,
length-prefixed and then a NUL, so a Txn can test "the value starts with this
owner/token" with two byte comparisons (``value > P`` and ``value < P + b"\\x01"``,
where ``P`` = kind + length + owner).
"""

from __future__ import annotations

import math
import struct
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from ..._errors import StoreCorrupt
from ._pb.etcdserverpb import rpc_pb2 as _rpc_pb2

pb: Any = _rpc_pb2  # generated without type information

ROOT = b"idemlock/"

#: etcd's largest lease TTL (seconds); MAX_TTL (100 years) is below it
MAX_LEASE_S = 9_000_000_000


def now_ms() -> int:
    return int(time.time() * 1000)


def lease_seconds(ms: int) -> int:
    """etcd leases count whole seconds: round up, at least 1 (the server may raise it
    further to its minimum, about 1.5 x the election timeout)."""
    return min(MAX_LEASE_S, max(1, math.ceil(ms / 1000)))


# ---- names ----------------------------------------------------------------------------


#: what a namespace's text escapes in a key name ("%" first, so it is undone last)
_ESCAPES = (("%", "%25"), ("/", "%2F"), ("\0", "%00"))


def _esc(ns: str) -> bytes:
    for char, escaped in _ESCAPES:
        ns = ns.replace(char, escaped)
    return ns.encode("utf-8", "surrogatepass")


def _unesc(raw: bytes) -> str:
    text = raw.decode("utf-8", "surrogatepass")
    for char, escaped in reversed(_ESCAPES):
        text = text.replace(escaped, char)
    return text


def prefix_end(key: bytes) -> bytes:
    """The range_end that makes a range cover every key starting with ``key``."""
    b = bytearray(key)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"


@dataclass(frozen=True, slots=True)
class ClaimNames:
    base: bytes  # the prefix of record, marker and steps
    record: bytes
    marker: bytes
    #: the end of the key's steps; the steps are ``steps + b"/" + name``
    steps: bytes
    #: the range_end of ``[steps, steps_end)``: the end key and every step
    steps_end: bytes

    def step(self, name: str) -> bytes:
        return self.steps + b"/" + name.encode("utf-8", "surrogatepass")


@lru_cache(maxsize=8192)
def claim_names(root: bytes, ns: str, key: str) -> ClaimNames:
    base = root + b"c/" + _esc(ns) + b"/" + key.encode("utf-8", "surrogatepass") + b"\0"
    return ClaimNames(base, base + b"r", base + b"t", base + b"e", base + b"f")


def claim_watch_range(names: ClaimNames) -> tuple[bytes, bytes]:
    """What a waiter for a claim watches: its record and its lease marker, not its
    steps (which sort before the record)."""
    return names.record, names.marker + b"\0"


@lru_cache(maxsize=8192)
def lock_name(root: bytes, ns: str, key: str) -> bytes:
    return root + b"l/" + _esc(ns) + b"/" + key.encode("utf-8", "surrogatepass")


def lock_end(name: bytes) -> bytes:
    """The range_end of a lock key's permits: the name itself (a lock, a permit granted
    with limit=1, and every previous release's lock) and ``name + NUL + owner``."""
    return name + b"\x01"


def holder_name(name: bytes, owner: str) -> bytes:
    """Where a permit of ``owner`` granted with a limit above 1 lives."""
    return name + b"\0" + owner.encode("utf-8", "surrogatepass")


def queue_prefix(root: bytes, ns: str, key: str) -> bytes:
    """Where the processes waiting for a lock queue up (one key each, ``+ waiter id``)."""
    return root + b"q/" + _esc(ns) + b"/" + key.encode("utf-8", "surrogatepass") + b"\0"


def gate_name(root: bytes, ns: str, resource: str) -> bytes:
    return root + b"f/" + _esc(ns) + b"/" + resource.encode("utf-8", "surrogatepass")


def listing_prefix(root: bytes, kind: Literal["c", "l"], ns_prefix: str) -> bytes:
    return root + kind.encode() + b"/" + _esc(ns_prefix)


def parse_name(root: bytes, kind: Literal["c", "l"], raw: bytes) -> tuple[str, str, bytes] | None:
    """(ns, key, suffix) of a record/marker (suffix b"r"/b"t") or permit (suffix b"" for
    the lock key itself, else the owner's name of a ``name + NUL + owner`` permit)."""
    head = root + kind.encode() + b"/"
    if not raw.startswith(head):
        return None
    rest = raw[len(head) :]
    ns_raw, sep, tail = rest.partition(b"/")
    if not sep:
        return None
    suffix = b""
    if kind == "c":
        # User keys hold no NUL: the first one ends the key; b"r", b"t", or a steps
        # key's b"e" or b"e/" + step name follows.
        tail, sep, suffix = tail.partition(b"\0")
        if not sep or not suffix:
            return None
    else:
        tail, _, suffix = tail.partition(b"\0")
    try:
        return _unesc(ns_raw), tail.decode("utf-8", "surrogatepass"), suffix
    except UnicodeDecodeError:
        return None


# ---- values ---------------------------------------------------------------------------
#
# lock      L u16 len owner \0 u64 written_ms u64 ttl_ms u64 lease_s
#           (a permit with a published value: L u16 len owner \0 \x01 u32 len value
#           u64 written_ms u64 ttl_ms u64 lease_s. Without one, a permit is byte for byte
#           the lock of the previous releases, whose written_ms starts with \x00 until
#           the year 2 million: a Txn tells the two apart by prefix, see plain_prefix)
# in flight I u16 len token \0 fp
# marker    T u64 written_ms u64 lease_ms u64 lease_s
# completed C u16 len token \0 u64 fence u64 written_ms u64 ttl_ms u64 lease_s fp result
# gate      u64 big-endian token (bytes order = number order)
# steps end E u64 end_ms (big-endian: a Txn compares it with a time as bytes)
# step      S u64 fence, then \0 (a "started" marker) or \1 + result
#
# fp: u16 length + UTF-8, or 0xFFFF for None. written_ms is the writer's wall clock,
# used only to *report* expiry times (etcd's lease, on the server, decides expiry).

_Q = struct.Struct(">QQQ")
_NONE = 0xFFFF


def _id(kind: bytes, ident: str) -> bytes:
    raw = ident.encode("utf-8", "surrogatepass")
    return kind + struct.pack(">H", len(raw)) + raw


def _fp(fp: str | None) -> bytes:
    if fp is None:
        return struct.pack(">H", _NONE)
    raw = fp.encode("utf-8", "surrogatepass")
    return struct.pack(">H", len(raw)) + raw


def _read_id(raw: bytes, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from(">H", raw, pos)
    pos += 2
    if len(raw) < pos + n:
        raise ValueError("truncated")
    return raw[pos : pos + n].decode("utf-8", "surrogatepass"), pos + n


def _read_fp(raw: bytes, pos: int) -> tuple[str | None, int]:
    (n,) = struct.unpack_from(">H", raw, pos)
    if n == _NONE:
        return None, pos + 2
    return _read_id(raw, pos)


def owner_prefix(owner: str) -> bytes:
    return _id(b"L", owner)


def held_prefix(owner: str) -> bytes:
    """What every permit value of ``owner`` starts with (see :func:`cmp_prefix`)."""
    return _id(b"L", owner) + b"\0"


def plain_prefix(owner: str) -> bytes:
    """What a permit value of ``owner`` without a published value starts with."""
    return _id(b"L", owner) + b"\0\0"


def valued_prefix(owner: str) -> bytes:
    """What a permit value of ``owner`` with a published value starts with."""
    return _id(b"L", owner) + b"\0\x01"


def token_prefix(token: str) -> bytes:
    return _id(b"I", token)


def done_prefix(token: str) -> bytes:
    return _id(b"C", token)


def lock_value(
    owner: str, ttl_ms: int, lease_s: int, written: int, value: bytes | None = None
) -> bytes:
    times = _Q.pack(written, ttl_ms, lease_s)
    if value is None:
        return owner_prefix(owner) + b"\0" + times
    return valued_prefix(owner) + struct.pack(">I", len(value)) + bytes(value) + times


def inflight_value(token: str, fp: str | None) -> bytes:
    return token_prefix(token) + b"\0" + _fp(fp)


def marker_value(lease_ms: int, lease_s: int, written: int) -> bytes:
    return b"T" + _Q.pack(written, lease_ms, lease_s)


def done_value(
    token: str, fence: int, fp: str | None, result: bytes, ttl_ms: int, lease_s: int, written: int
) -> bytes:
    return (
        done_prefix(token)
        + b"\0"
        + struct.pack(">Q", fence)
        + _Q.pack(written, ttl_ms, lease_s)
        + _fp(fp)
        + result
    )


def steps_end_value(end_ms: int) -> bytes:
    return b"E" + struct.pack(">Q", max(0, end_ms))


def step_value(fence: int, result: bytes | None) -> bytes:
    head = b"S" + struct.pack(">Q", fence)
    return head + b"\0" if result is None else head + b"\1" + bytes(result)


def gate_value(token: int) -> bytes:
    return struct.pack(">Q", token)


@dataclass(frozen=True, slots=True)
class Times:
    """When a value's etcd lease was (re)granted, on the writer's clock, for how long
    the caller asked (``ttl_ms``) and what etcd counts (``lease_s``, whole seconds)."""

    written: int
    ttl_ms: int
    lease_s: int

    @property
    def expires_ms(self) -> int:
        """What the caller asked for: the expiry idemlock reports."""
        return self.written + self.ttl_ms

    def left_ms(self, now: int) -> int:
        """How long the key may still exist in etcd (its lease is at least this long,
        plus etcd's expiry check interval of 500 ms): a waiter's next re-check."""
        return max(100, self.written + max(self.ttl_ms, self.lease_s * 1000) + 500 - now)


@dataclass(frozen=True, slots=True)
class LockVal:
    owner: str
    times: Times
    #: what the holder published (an election's leader), or None
    value: bytes | None = None


@dataclass(frozen=True, slots=True)
class InFlightVal:
    token: str
    fp: str | None


@dataclass(frozen=True, slots=True)
class DoneVal:
    token: str
    fence: int
    times: Times
    fp: str | None
    result: bytes


def parse_lock(raw: bytes) -> LockVal:
    if raw[:1] != b"L":
        raise ValueError("not a lock")
    owner, pos = _read_id(raw, 1)
    if raw[pos : pos + 1] != b"\0":
        raise ValueError("bad lock value")
    pos += 1
    if len(raw) == pos + _Q.size:
        return LockVal(owner, Times(*_Q.unpack_from(raw, pos)))
    if raw[pos : pos + 1] != b"\x01":
        raise ValueError("bad lock value")
    (n,) = struct.unpack_from(">I", raw, pos + 1)
    pos += 5
    if len(raw) != pos + n + _Q.size:
        raise ValueError("bad lock value")
    return LockVal(owner, Times(*_Q.unpack_from(raw, pos + n)), raw[pos : pos + n])


def parse_marker(raw: bytes) -> Times:
    if raw[:1] != b"T" or len(raw) != 1 + _Q.size:
        raise ValueError("bad claim marker")
    return Times(*_Q.unpack_from(raw, 1))


def parse_record(raw: bytes) -> InFlightVal | DoneVal:
    kind = raw[:1]
    if kind not in (b"I", b"C"):
        raise ValueError("not a claim record")
    token, pos = _read_id(raw, 1)
    if raw[pos : pos + 1] != b"\0":
        raise ValueError("bad claim record")
    pos += 1
    if kind == b"I":
        fp, end = _read_fp(raw, pos)
        if end != len(raw):
            raise ValueError("bad claim record")
        return InFlightVal(token, fp)
    (fence,) = struct.unpack_from(">Q", raw, pos)
    times = Times(*_Q.unpack_from(raw, pos + 8))
    fp, end = _read_fp(raw, pos + 8 + _Q.size)
    return DoneVal(token, fence, times, fp, raw[end:])


def parse_steps_end(raw: bytes) -> int:
    if raw[:1] != b"E" or len(raw) != 9:
        raise ValueError("bad steps end")
    return int(struct.unpack_from(">Q", raw, 1)[0])


def parse_step(raw: bytes) -> tuple[int, bytes | None]:
    """(fence, result or None) of a step value."""
    if raw[:1] != b"S" or len(raw) < 10 or raw[9:10] not in (b"\0", b"\1"):
        raise ValueError("bad step")
    (fence,) = struct.unpack_from(">Q", raw, 1)
    if raw[9:10] == b"\0":
        if len(raw) != 10:
            raise ValueError("bad step")
        return int(fence), None
    return int(fence), raw[10:]


def parse_gate(raw: bytes) -> int:
    if len(raw) != 8:
        raise ValueError("bad fence gate")
    return int(struct.unpack(">Q", raw)[0])


def corrupt(key: bytes, exc: Exception) -> StoreCorrupt:
    return StoreCorrupt(
        f"etcd key {key!r} holds data idemlock did not write ({exc}); delete it or use "
        "another key prefix"
    )


# ---- requests -------------------------------------------------------------------------

C = pb.Compare


def cmp_create(key: bytes, rev: int, result: Any = C.EQUAL) -> Any:
    return C(key=key, target=C.CREATE, result=result, create_revision=rev)


def cmp_mod(key: bytes, rev: int) -> Any:
    return C(key=key, target=C.MOD, result=C.EQUAL, mod_revision=rev)


def cmp_starts(key: bytes, prefix: bytes) -> list[Any]:
    """The value of ``key`` starts with ``prefix + b"\\0"`` (two byte comparisons; a
    missing key fails both, as etcd fails every value comparison on a missing key)."""
    return [
        C(key=key, target=C.VALUE, result=C.GREATER, value=prefix),
        C(key=key, target=C.VALUE, result=C.LESS, value=prefix + b"\x01"),
    ]


def cmp_prefix(key: bytes, prefix: bytes) -> list[Any]:
    """The value of ``key`` starts with ``prefix`` and is longer (a missing key fails)."""
    return [
        C(key=key, target=C.VALUE, result=C.GREATER, value=prefix),
        C(key=key, target=C.VALUE, result=C.LESS, value=prefix_end(prefix)),
    ]


def cmp_no_key(key: bytes, end: bytes) -> Any:
    """No key in ``[key, end)`` (etcd compares an empty range as one missing key)."""
    return C(key=key, range_end=end, target=C.VERSION, result=C.EQUAL, version=0)


def cmp_created_by(key: bytes, end: bytes, rev: int) -> Any:
    """Every key in ``[key, end)`` was created at revision ``rev`` or before: none was
    created since a read at ``rev``."""
    return C(key=key, range_end=end, target=C.CREATE, result=C.LESS, create_revision=rev + 1)


def cmp_range(key: bytes, low: bytes, high: bytes) -> list[Any]:
    """``low < value < high`` (bytewise)."""
    return [
        C(key=key, target=C.VALUE, result=C.GREATER, value=low),
        C(key=key, target=C.VALUE, result=C.LESS, value=high),
    ]


def cmp_value(key: bytes, result: Any, value: bytes) -> Any:
    return C(key=key, target=C.VALUE, result=result, value=value)


def put(key: bytes, value: bytes, lease: int = 0, prev: bool = False) -> Any:
    return pb.RequestOp(request_put=pb.PutRequest(key=key, value=value, lease=lease, prev_kv=prev))


def get(key: bytes, end: bytes = b"") -> Any:
    return pb.RequestOp(request_range=pb.RangeRequest(key=key, range_end=end))


def oldest(key: bytes, end: bytes) -> Any:
    """The name of the key in ``[key, end)`` created first (a queue's head)."""
    return pb.RequestOp(
        request_range=pb.RangeRequest(
            key=key,
            range_end=end,
            limit=1,
            keys_only=True,
            sort_order=pb.RangeRequest.ASCEND,
            sort_target=pb.RangeRequest.CREATE,
        )
    )


def delete(key: bytes, prev: bool = False, end: bytes = b"") -> Any:
    return pb.RequestOp(
        request_delete_range=pb.DeleteRangeRequest(key=key, range_end=end, prev_kv=prev)
    )


def txn(compare: list[Any], success: list[Any], failure: list[Any]) -> Any:
    return pb.TxnRequest(compare=compare, success=success, failure=failure)


def nested(req: Any) -> Any:
    return pb.RequestOp(request_txn=req)


def kvs(op: Any) -> Any:
    """The KeyValues of a ResponseOp holding a range."""
    return op.response_range.kvs
