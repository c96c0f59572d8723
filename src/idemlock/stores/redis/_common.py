"""What the sync and async Redis stores share: key names, argument encoding, reply
parsing, error mapping and the script registry. Nothing here does I/O."""

from __future__ import annotations

import base64
import hashlib
import logging
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Literal

from ..._core import table as T
from ..._core.clock import duration
from ..._core.port import (
    Acquired,
    Busy,
    ClaimReply,
    Done,
    Granted,
    Held,
    LockRow,
    Mismatch,
    RecordRow,
    StepRow,
)
from ..._errors import ConfigurationError, StoreCorrupt, StoreFull, StoreUnavailable
from ..._logfields import fields as log_fields
from . import _lua

log = logging.getLogger("idemlock")

#: Every key and channel of the store starts with this, then the hash tag.
PREFIX = b"il"
#: Length of the hash tag: 9 bytes of BLAKE2b in URL-safe base64 (no braces).
TAG_LEN = 12
#: How long a failed attempt of a waiting caller keeps it registered as a waiter;
#: longer than the longest wait between re-checks (flows.MAX_WAIT_CHUNK, 1 s).
REGISTER_MS = 1500

Kind = Literal["c", "l"]


@dataclass(frozen=True)
class Script:
    name: str
    text: bytes
    sha: str


def _script(name: str, text: str) -> Script:
    raw = text.encode()
    return Script(name, raw, hashlib.sha1(raw).hexdigest())


CLAIM = _script("claim", _lua.CLAIM)
COMPLETE = _script("complete", _lua.COMPLETE)
ABANDON = _script("abandon", _lua.ABANDON)
EXTEND = _script("extend", _lua.EXTEND)
FORGET = _script("forget", _lua.FORGET)
PEEK_CLAIM = _script("record", _lua.PEEK_CLAIM)
ACQUIRE = _script("acquire", _lua.ACQUIRE)
RELEASE = _script("release", _lua.RELEASE)
BREAK = _script("break_lock", _lua.BREAK)
RENEW = _script("renew", _lua.RENEW)
PEEK_LOCK = _script("lock", _lua.PEEK_LOCK)
FENCE_ADVANCE = _script("fence_advance", _lua.FENCE_ADVANCE)
FENCE_SET = _script("fence_set", _lua.FENCE_SET)
FENCE_CURRENT = _script("fence_current", _lua.FENCE_CURRENT)
UNREGISTER = _script("unregister", _lua.UNREGISTER)
STEP = _script("step", _lua.STEP)
DROP_STEP = _script("drop_step", _lua.DROP_STEP)
PEEK_STEPS = _script("steps", _lua.PEEK_STEPS)

#: The scripts whose writes ``durability=`` waits for (every write a caller relies
#: on: records, leases, fence gates; not a waiter's registration, not a peek).
DURABLE = frozenset(
    s.sha
    for s in (
        CLAIM, COMPLETE, ABANDON, EXTEND, FORGET, ACQUIRE, RELEASE, BREAK, RENEW,
        FENCE_ADVANCE, FENCE_SET, STEP, DROP_STEP,
    )
)  # fmt: skip


def wait_commands(d: Durability, timeout: float) -> list[tuple[Any, ...]]:
    """The commands that follow a durable write on its connection: ``WAITAOF`` /
    ``WAIT`` with a deadline inside the call's bound (never 0, which waits forever)."""
    # 80 % of the bound less 100 ms (Redis < 7.2 times a WAIT out on its 100 ms cron
    # tick), shared when both wait, so the replies still arrive within the bound
    ms = max(1, (int(timeout * 800) - 100) // (2 if d.aof and d.replicas else 1))
    out: list[tuple[Any, ...]] = []
    if d.aof:
        out.append(("WAITAOF", 1, 0, ms))  # the primary's own AOF, fsynced
    if d.replicas:
        out.append(("WAIT", d.replicas, ms))
    return out


def check_acks(d: Durability, replies: list[Any], what: str) -> None:
    """Raise StoreUnavailable when the WAIT/WAITAOF replies fall short of ``d``."""
    for reply in replies:
        if isinstance(reply, Exception):
            if "unknown command" in str(reply).lower():
                raise ConfigurationError(
                    f"redis {what}: durability={d} needs WAITAOF (Redis >= 7.2), which "
                    "this server does not know; use durability=replicas:N or none"
                ) from reply
            raise store_error(reply, f"{what} (durability={d})") from reply
        if isinstance(reply, list):  # WAITAOF: [local fsynced, replicas fsynced]
            local, reps = int(reply[0]), int(reply[1])
        else:
            local, reps = 1, int(reply)
        missing = []
        if d.aof and local < 1:
            missing.append("the primary's append-only file")
        if reps < d.replicas:
            missing.append(f"{d.replicas} replica(s) ({reps} acknowledged)")
        if missing:
            raise StoreUnavailable(
                f"redis {what}: written on the primary, but not acknowledged by "
                f"{' and '.join(missing)} within the bound (durability={d}); the write "
                "stands on the primary and may be lost if it fails over now"
            )


# ---- names ---------------------------------------------------------------------------
#
# Record:  il{TAG}c:<ns escaped>|<key>      TAG = b64(blake2b(len(ns):ns key))[:12]
# Lock:    il{TAG}l:<ns escaped>|<key>
# Channel: il{TAG}C / il{TAG}L              (claim / lock notifications; the lock
#                                           scripts derive il{TAG}L from the lock)
# Waiters: il{TAG}w                          (processes waiting for the lock)
# Steps:   il{TAG}s:<ns escaped>|<key>      (a claim's steps, beside its record)
# Gate:    il{<slot tag of resource>}f:<ns escaped>|<resource>
#
# The hash tag comes first, so nothing a user writes can move it; the rest of the name
# is an injective encoding of (ns, key): ns has '%' and '|' escaped and the first '|'
# after the header ends it. Two pairs that share a tag (a 72-bit hash) still have
# different names; they would only share a slot, a notification channel and a waiters
# hash (spurious wake-ups, never a wrong answer).


def _esc(ns: str) -> bytes:
    return ns.replace("%", "%25").replace("|", "%7C").encode("utf-8", "surrogatepass")


def _unesc(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogatepass").replace("%7C", "|").replace("%25", "%")


@lru_cache(maxsize=1024)
def _ns_parts(ns: str) -> tuple[bytes, bytes]:
    """What the tag of a key of ``ns`` hashes before the key, and the name's part
    between the kind letter and the key (computed once per namespace)."""
    return f"{len(ns)}:{ns}".encode("utf-8", "surrogatepass"), b":" + _esc(ns) + b"|"


def claim_tag(ns: str, key: str) -> str:
    """The hash tag of (ns, key)'s names, b64(blake2b(len(ns):ns key)[:9]): a user key
    named ``{tag}...`` shares their Cluster slot."""
    name = names(ns, key).claim
    return name[name.index(b"{") + 1 : name.index(b"}")].decode()


@dataclass(frozen=True, slots=True)
class Names:
    claim: bytes
    lock: bytes
    claim_channel: bytes
    lock_channel: bytes
    waiters: bytes
    steps: bytes


@lru_cache(maxsize=8192)
def names(ns: str, key: str) -> Names:
    # A claim's key is new on almost every call, so this runs once per claim: the
    # namespace's parts come from a cache and the key is encoded once.
    pre, mid = _ns_parts(ns)
    raw = key.encode("utf-8", "surrogatepass")
    tag = base64.urlsafe_b64encode(hashlib.blake2b(pre + raw, digest_size=9).digest())
    head = b"%b{%b}" % (PREFIX, tag)
    tail = mid + raw
    return Names(
        head + b"c" + tail,
        head + b"l" + tail,
        head + b"C",
        head + b"L",
        head + b"w",
        head + b"s" + tail,
    )


def waiters_of(lock_channel: bytes) -> bytes:
    """The waiters hash of the lock whose channel is ``lock_channel``."""
    return lock_channel[:-1] + b"w"


def channel_name(kind: str, ns: str, key: str) -> bytes:
    """The channel of a claim key, or of a lock key (its waiters' ``"lock"`` and its
    observers' ``"leader"``: one channel, where a published value's ``!`` wakes the
    observers alone)."""
    n = names(ns, key)
    return n.claim_channel if kind == "claim" else n.lock_channel


def parse_name(raw: bytes, kind: Kind) -> tuple[str, str] | None:
    """(ns, key) of a record or lock key name, None if it is not one of ours."""
    head = len(PREFIX) + 1 + TAG_LEN
    if (
        len(raw) <= head + 3
        or not raw.startswith(PREFIX + b"{")
        or raw[head : head + 3] != b"}" + kind.encode() + b":"
    ):
        return None
    rest = raw[head + 3 :]
    ns_raw, sep, key_raw = rest.partition(b"|")
    if not sep:
        return None
    try:
        return _unesc(ns_raw), key_raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:
        return None


def _glob_escape(raw: bytes) -> bytes:
    out = bytearray()
    for b in raw:
        if b in b"*?[]\\":
            out += b"\\"
        out.append(b)
    return bytes(out)


def match_pattern(kind: Kind, ns_prefix: str) -> bytes:
    """SCAN MATCH pattern for the records or locks whose ns starts with ns_prefix."""
    return (
        PREFIX + b"{" + b"?" * TAG_LEN + b"}" + kind.encode() + b":" + _glob_escape(_esc(ns_prefix))
    ) + b"*"


def hashed_part(key: bytes) -> bytes:
    """The part of a key Redis Cluster hashes: the first non-empty {tag}, else all."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            return key[start + 1 : end]
    return key


@lru_cache(maxsize=1)
def _slot_strings() -> dict[int, bytes]:
    # A short string per cluster slot, for resources whose hashed part cannot be
    # written inside braces (it contains '}'). Built once, on first need.
    from redis.crc import key_slot

    table: dict[int, bytes] = {}
    i = 0
    while len(table) < 16384:
        s = str(i).encode()
        table.setdefault(key_slot(s), s)
        i += 1
    return table


@lru_cache(maxsize=4096)
def gate_name(ns: str, resource: str) -> bytes:
    """The fence gate of (ns, resource). It hashes to the Cluster slot of the resource
    name itself, so a user key that shares the resource's hash tag (or is the resource)
    can be written by ``fence_set`` in the same script."""
    res = resource.encode("utf-8", "surrogatepass")
    part = hashed_part(res)
    if b"}" in part:
        from redis.crc import key_slot

        part = _slot_strings()[key_slot(res)]
    return PREFIX + b"{" + part + b"}f:" + _esc(ns) + b"|" + res


# ---- argument encoding -----------------------------------------------------------------


def pack_id(value: str | None) -> bytes:
    """Compact, injective bytes for tokens and fingerprints: lowercase hex (what
    idemlock generates) is stored as raw bytes behind a marker, anything else as
    UTF-8 behind another; None is empty."""
    if value is None:
        return b""
    if len(value) % 2 == 0:
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            pass  # not hex: stored as text below
        else:
            if raw.hex() == value:
                return b"h" + raw
    out = b"s" + value.encode("utf-8", "surrogatepass")
    if len(out) > 255:
        # The claim record keeps tokens and fingerprints behind a one-byte length.
        raise ConfigurationError(
            f"a claim token or fingerprint of {len(out)} bytes is too long for the Redis "
            "store (at most 254 bytes of UTF-8, or 508 hex digits)"
        )
    return out


def nonce() -> bytes:
    """4 bytes telling this call's own retry from another call: unique enough, not
    secret (the random module, reseeded in a forked child, is 4x cheaper than
    os.urandom's system call)."""
    return random.randbytes(4)


def waiter_id() -> bytes:
    """A process's waiter id for one key: 8 random bytes (never b'*')."""
    return os.urandom(8)


# ---- replies ---------------------------------------------------------------------------


def _int(v: Any) -> int:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    return int(v)


def claim_reply(reply: Any, token: str) -> ClaimReply:
    """The port reply of the CLAIM script: its first element is a claim reply code of
    the state table."""
    code = reply[0]
    if code == T.GRANTED.code:
        g = Granted(token, _int(reply[1]), _int(reply[2]), _int(reply[3]))
        if len(reply) > 4:  # the key's steps: none on the hot path
            return replace(g, steps=tuple(step_rows(reply[4:])))
        return g
    if code == T.BUSY.code:
        return Busy(_int(reply[1]), _int(reply[2]))
    if code == T.DONE.code:
        return Done(bytes(reply[2]), _int(reply[1]))
    if code == T.MISMATCH.code:
        return Mismatch("in_flight" if reply[1] in (b"I", "I") else "completed")
    raise StoreCorrupt(f"unexpected reply from the claim script: {reply!r}")


def pack_step(result: bytes | None) -> bytes:
    """ARGV of a step's result: b'' for a "started" marker, else b'=' and the result
    (the script puts the claim's fence, 7 bytes, in front)."""
    return pack_value(result)


def step_rows(flat: Any) -> list[StepRow]:
    """The steps of a key from a steps hash as HGETALL answers it (name, value, ...);
    StoreCorrupt for a value idemlock did not write."""
    rows: list[StepRow] = []
    for i in range(0, len(flat) - 1, 2):
        name, value = flat[i], flat[i + 1]
        if not isinstance(value, bytes) or not (
            len(value) == 7 or (len(value) > 7 and value[7:8] == b"=")
        ):
            raise StoreCorrupt(
                f"redis steps: the steps of a claim hold a value idemlock did not write "
                f"(step {name!r}: {value!r:.60}); delete the key or use another key_prefix"
            )
        result = None if len(value) == 7 else value[8:]
        rows.append(StepRow(text(name), int.from_bytes(value[:7], "big"), result))
    return rows


def lock_reply(reply: Any) -> Acquired | Held:
    if reply[0] == T.ACQUIRED.code:
        return Acquired(_int(reply[1]), _int(reply[2]), _int(reply[3]))
    return Held(_int(reply[1]), _int(reply[2]))


def record_row(ns: str, key: str, reply: Any) -> RecordRow | None:
    if not reply:
        return None
    state: Literal["in_flight", "completed"] = (
        "in_flight" if reply[0] in (b"I", "I") else "completed"
    )
    return RecordRow(ns, key, state, _int(reply[1]), _int(reply[2]))


def holder_rows(ns: str, key: str, reply: Any) -> list[LockRow]:
    """The live holders the PEEK_LOCK script answers (owner, token, expiry, value
    four by four, lowest token first)."""
    rows: list[LockRow] = []
    for i in range(0, len(reply), 4):
        owner, token, exp, value = reply[i : i + 4]
        rows.append(LockRow(ns, key, text(owner), _int(token), _int(exp), value=_published(value)))
    return rows


def _published(v: Any) -> bytes | None:
    """A value as the scripts answer it: '' for none, else '=' and the value."""
    if not v:
        return None
    raw = v if isinstance(v, bytes) else str(v).encode("utf-8", "surrogatepass")
    return raw[1:]


def check_limit(limit: int) -> int:
    """A caller's limit: how many may hold a key at once (a lock: 1)."""
    if type(limit) is not int or limit < 1:
        raise ConfigurationError(
            f"a limit is how many may hold a key at once, an int >= 1; got {limit!r}"
        )
    return limit


def pack_value(value: bytes | None) -> bytes:
    """ARGV of a published value: b'' for none, else b'=' and the value."""
    return b"" if value is None else b"=" + bytes(value)


def fence_reply(reply: Any) -> tuple[bool, int]:
    return reply[0] == T.OK.code, int(reply[1])


def text(v: Any) -> str:
    return v.decode("utf-8", "surrogatepass") if isinstance(v, bytes) else str(v)


def listing_rows(
    kind: Kind, keys: list[bytes], values: list[Any], now_ms: int, ns_prefix: str
) -> list[Any]:
    """Rows of a listing from key names and their GET/HGETALL values. A value idemlock
    cannot read (foreign or damaged data under the prefix) is listed as a corrupt row,
    with one warning per listing, so it never hides every other record."""
    rows: list[Any] = []
    bad: list[bytes] = []
    for raw, vals in zip(keys, values, strict=False):
        parsed = parse_name(raw, kind)
        if parsed is None or not parsed[0].startswith(ns_prefix):
            continue
        ns, key = parsed
        try:
            if isinstance(vals, Exception):
                raise ValueError(str(vals))
            if kind == "c":
                if vals is None:
                    continue
                state, fence, exp = unpack_claim(vals)
                if state in (b"I", b"C") and exp > now_ms:
                    st: Literal["in_flight", "completed"] = (
                        "in_flight" if state == b"I" else "completed"
                    )
                    rows.append(RecordRow(ns, key, st, fence, exp))
            else:
                rows += lock_rows(ns, key, vals, now_ms)
        except (TypeError, ValueError, IndexError, UnicodeDecodeError):
            bad.append(raw)
            if kind == "c":
                rows.append(RecordRow(ns, key, "corrupt", 0, 0))
            else:
                rows.append(LockRow(ns, key, "", 0, 0, corrupt=True))
    if bad:
        log.warning(
            "idemlock: %d Redis key(s) under the prefix hold data idemlock did not write "
            "(first: %r); they are listed as corrupt: delete them or use another key_prefix",
            len(bad),
            bad[0],
            extra=log_fields(store="redis", operation="list", outcome="corrupt"),
        )
    return rows


#: The fields of a lock record (a hash, see _lua) that name its newest holder: owner,
#: token (the key's counter), expiry. Other holders are in fields b"h" + owner.
LOCK_FIELDS = (b"o", b"t", b"x")


def lock_rows(ns: str, key: str, fields: Any, now_ms: int) -> list[LockRow]:
    """The live holders of a lock record read with HGETALL (a dict of bytes), lowest
    token first; ValueError if idemlock cannot read it."""
    if not isinstance(fields, dict):
        raise ValueError("not a hash")
    f = {(k if isinstance(k, bytes) else str(k).encode()): v for k, v in fields.items()}
    owner, token, exp, pub = f.get(b"o"), f.get(b"t"), f.get(b"x"), f.get(b"v")
    others = {k[1:]: v for k, v in f.items() if k[:1] == b"h"}
    if token is None:
        if owner is not None or exp is not None or others:
            raise ValueError("missing field")
        return []  # gone between SCAN and HGETALL, or not ours (the scripts refuse it)
    tok = _int(token)
    rows: list[LockRow] = []
    if owner is not None or exp is not None:
        if owner is None or exp is None:
            raise ValueError("missing field")
        until = _int(exp)
        if until > now_ms:
            value = None
            if pub is not None:
                raw = pub if isinstance(pub, bytes) else str(pub).encode()
                head = b"%d:" % tok
                value = raw[len(head) :] if raw.startswith(head) else None
            rows.append(LockRow(ns, key, text(owner), tok, until, value=value))
    for name, enc in others.items():
        raw = enc if isinstance(enc, bytes) else str(enc).encode()
        t, x, *rest = raw.split(b":", 2)
        until = _int(x)
        if until > now_ms:
            rows.append(
                LockRow(ns, key, text(name), _int(t), until, value=rest[0] if rest else None)
            )
    rows.sort(key=lambda r: r.token)
    return rows


def unpack_claim(raw: Any) -> tuple[bytes, int, int]:
    """(state, fence, expiry) of a packed claim record (see _lua)."""
    if isinstance(raw, str):
        raise ValueError("a claim record must be binary")
    state = bytes(raw[:1])
    if len(raw) < 17:
        raise ValueError("not an idemlock claim record")
    fence, exp = int.from_bytes(raw[1:8], "big"), int.from_bytes(raw[8:14], "big")
    pos = 14
    for _ in range(3):
        pos += 1 + raw[pos]
        if pos > len(raw):
            break
    if state not in (b"I", b"C", b"A", b"F") or pos > len(raw):
        raise ValueError("not an idemlock claim record")
    return state, fence, exp


# ---- the listener's connection -----------------------------------------------------------


def listener_kwargs(pool_kwargs: dict[str, Any]) -> dict[str, Any]:
    """Connection options for the pub/sub listener, from its pool's.

    The listener speaks RESP2 with raw bytes (pub/sub messages come back as plain
    arrays). Maintenance notifications need RESP3 and, without hiredis, refuse RESP2,
    so their settings (which redis-py 8 adds to every pool) are not copied; a
    pub/sub connection has no use for them.
    """
    kwargs = {k: v for k, v in pool_kwargs.items() if "maint_notifications" not in k}
    kwargs.update(decode_responses=False, protocol=2)
    return kwargs


# ---- errors ----------------------------------------------------------------------------


def store_error(exc: BaseException, what: str) -> Exception:
    """The idemlock error for a redis-py failure (the caller chains ``exc``)."""
    import redis.exceptions as rx

    msg = str(exc)
    if isinstance(exc, rx.ResponseError):
        if msg.startswith("IDEMLOCK_CORRUPT") or msg.startswith("WRONGTYPE"):
            why = msg.removeprefix("IDEMLOCK_CORRUPT").strip()
            return StoreCorrupt(
                f"redis {what}: the key holds data idemlock did not write ({why}); delete "
                "it or use another key_prefix"
            )
        if msg.startswith("IDEMLOCK_RANGE"):
            why = msg.removeprefix("IDEMLOCK_RANGE").strip()
            return ConfigurationError(
                f"redis {what}: {why} is past what the Redis store can keep (year 10889); "
                "use a ttl or lease of at most idemlock.MAX_TTL"
            )
        if msg.startswith("OOM"):
            return StoreFull(
                f"redis {what}: Redis is out of memory (maxmemory reached and nothing "
                f"may be evicted): {msg}"
            )
    return StoreUnavailable(f"redis {what} failed: {_cause(exc, msg)}{type(exc).__name__}: {msg}")


def _cause(exc: BaseException, msg: str) -> str:
    """A short name for why a call failed, before redis-py's own words."""
    import redis.exceptions as rx

    low = msg.lower()
    if isinstance(exc, rx.AuthenticationError) or any(
        m in low for m in ("noauth", "wrongpass", "invalid password", "already authenticated")
    ):
        return "authentication failed (check the user and password of the URL): "
    if isinstance(exc, rx.ReadOnlyError) or msg.startswith("READONLY"):
        return (
            "the server is a read-only replica (a failover demoted it, or the URL names a "
            "replica; the call did not write): "
        )
    if type(exc).__name__ == "MasterNotFoundError":  # redis.sentinel's
        return (
            "no Sentinel of the URL names a primary for its service (a failover under "
            "way, Sentinels down, or a wrong SERVICE name): "
        )
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and len(chain) < 5:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(isinstance(c, ConnectionRefusedError) for c in chain) or "error 111 " in low:
        return "connection refused (is Redis running at that address?): "
    if isinstance(exc, rx.TimeoutError) or any(isinstance(c, TimeoutError) for c in chain):
        return "no reply within the timeout (Redis or the network is stalled): "
    return ""


def known_nodes(client: Any) -> list[Any]:
    """The nodes a Cluster client (blocking or asyncio) knows, primaries if any; a
    redis-py ConnectionError (the caller's retry or StoreUnavailable) if it knows none,
    as redis-py's blocking client (up to 6.4) after calls failed on every node, until it
    reads the slot map again (see _compat.StartupNodes)."""
    nodes: list[Any] = client.get_primaries() or client.get_nodes()
    if not nodes:
        import redis.exceptions

        raise redis.exceptions.ConnectionError(
            "the Redis Cluster client knows no node (its slot map is being read again)"
        )
    return nodes


def redis_errors() -> tuple[type[BaseException], ...]:
    import redis.exceptions as rx

    return (rx.RedisError, rx.RedisClusterException, OSError)


# ---- options ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Durability:
    """``durability=``: after each write that matters, wait for ``replicas`` replicas
    (``WAIT``) and, with ``aof``, for the primary's own append-only file
    (``WAITAOF``), within the call's bound. ``none`` (the default) waits for nothing."""

    replicas: int = 0
    aof: bool = False

    @property
    def none(self) -> bool:
        return not self.replicas and not self.aof

    def __str__(self) -> str:
        if self.none:
            return "none"
        parts = (["aof"] if self.aof else []) + (
            [f"replicas:{self.replicas}"] if self.replicas else []
        )
        return "+".join(parts)


def parse_durability(raw: Any) -> Durability:
    """The ``durability`` option: ``none``, ``replicas:N``, ``aof`` or ``aof+replicas:N``."""
    if isinstance(raw, Durability):
        return raw
    # A '+' written in a URL's query arrives as a space (form encoding): the same.
    text = "+".join(raw.lower().split()) if isinstance(raw, str) else None
    if text == "none":
        return Durability()
    replicas, aof, ok = 0, False, text is not None and text != ""
    for part in (text or "").split("+"):
        if part == "aof" and not aof and not replicas:
            aof = True
            continue
        name, colon, count = part.partition(":")
        if name == "replicas" and colon and count.isdigit() and 1 <= int(count) <= 100:
            if replicas:
                ok = False
            replicas = int(count)
            continue
        ok = False
    if not ok:
        raise ConfigurationError(
            f"durability must be none, replicas:N (N from 1 to 100), aof or "
            f"aof+replicas:N, got {raw!r}; e.g. durability=replicas:1"
        )
    return Durability(replicas, aof)


@dataclass(frozen=True)
class Options:
    """idemlock's own options of the Redis store (URL query or keywords)."""

    #: how long (ms) a key's counter outlives its last use (clock-step protection)
    keep_ms: int = 60_000
    #: hand-off window (ms) after a release with waiters; 0 disables it
    handoff_ms: int = 10
    #: the bound (seconds) on one store call: socket and connect timeouts default to it
    timeout: float = 5.0
    #: what must acknowledge a write before the call returns (``durability=``)
    durability: Durability = Durability()


OWN_OPTIONS = ("counter_ttl", "durability", "handoff_ms", "timeout")


def check_timeout(raw: Any) -> float:
    """The ``timeout`` option (seconds, from a URL string or a number)."""
    what = "timeout (the bound on one Redis call: connect, request, reply)"
    return duration(raw, what, positive=True, text=True)


def own_options(values: dict[str, Any]) -> Options:
    """Pop and check idemlock's options (strings from a URL, or numbers)."""
    opts = Options()
    if "counter_ttl" in values:
        raw = values.pop("counter_ttl")
        try:
            sec = float(raw)
        except (TypeError, ValueError):
            sec = -1.0
        if not (math.isfinite(sec) and sec >= 1):
            raise ConfigurationError(
                f"counter_ttl is how many seconds a key's fence counter outlives its last "
                f"use; it must be a number >= 1, got {raw!r}"
            )
        opts = replace(opts, keep_ms=int(sec * 1000))
    if "handoff_ms" in values:
        raw = values.pop("handoff_ms")
        try:
            ms = -1 if isinstance(raw, bool) else int(raw)
        except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
            ms = -1
        if ms < 0 or ms > 10_000:
            raise ConfigurationError(
                f"handoff_ms must be an int from 0 (no hand-off window) to 10000, got {raw!r}"
            )
        opts = replace(opts, handoff_ms=ms)
    if "timeout" in values:
        opts = replace(opts, timeout=check_timeout(values.pop("timeout")))
    if "durability" in values:
        opts = replace(opts, durability=parse_durability(values.pop("durability")))
    return opts


Caller = Callable[..., Any]
