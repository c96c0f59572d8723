"""Pure helpers of the Redis store's script calls, shared by the blocking and the
asyncio store: the batch of a renewal, Cluster slot checks and ``TIME`` replies."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from redis.client import NEVER_DECODE
from redis.exceptions import NoScriptError, ReadOnlyError

from ..._errors import ConfigurationError
from . import _common as C

#: keyword of redis-py's execute_command: raw bytes back, whatever the client decodes
ND = {NEVER_DECODE: True}

RenewCall = tuple[C.Script, tuple[bytes, ...], tuple[Any, ...]]


def renew_calls(items: Sequence[tuple[Any, ...]], keep: int) -> list[RenewCall]:
    """The EXTEND/RENEW script calls of a batched renewal."""
    calls: list[RenewCall] = []
    for item in items:
        if item[0] == "claim":
            _, ns, key, token, lease_ms = item
            args: tuple[Any, ...] = (C.pack_id(token), lease_ms, keep)
            calls.append((C.EXTEND, (C.names(ns, key).claim,), args))
        else:
            _, ns, key, owner, token, ttl_ms = item
            args = (owner, str(token), ttl_ms, keep, b"")
            calls.append((C.RENEW, (C.names(ns, key).lock,), args))
    return calls


def now_ms(reply: Any) -> int:
    if isinstance(reply, dict):  # a cluster answers per node
        reply = next(iter(reply.values()))
    sec, usec = reply
    return int(sec) * 1000 + int(usec) // 1000


def check_claim_slot(
    cluster: bool, claim: bytes, writes: Sequence[tuple[str, bytes]]
) -> tuple[bytes, ...]:
    users = tuple(k.encode("utf-8", "surrogatepass") for k, _ in writes)
    if cluster and users:
        from redis.crc import key_slot

        slot = key_slot(claim)
        for name, raw in zip((k for k, _ in writes), users, strict=True):
            if key_slot(raw) != slot:
                tag = claim[claim.index(b"{") + 1 : claim.index(b"}")].decode()
                raise ConfigurationError(
                    f"on Redis Cluster, writes completed with a claim must hash to the "
                    f"claim's slot, and {name!r} does not: put the claim's hash tag in its "
                    f"name, e.g. '{{{tag}}}:{name}' (port.write_key(key, {name!r}) gives it)"
                )
    return users


def check_same_slot(cluster: bool, resource: str, key: str, gate: bytes, user: bytes) -> None:
    if not cluster:
        return
    from redis.crc import key_slot

    if key_slot(gate) != key_slot(user):
        raise ConfigurationError(
            f"on Redis Cluster, set_if_fresh writes {key!r} in the same script as the "
            f"fence of {resource!r}, so both must hash to one slot: use the resource name "
            f"as the key, or give both the same hash tag (resource '{{{resource}}}' and "
            f"key '{{{resource}}}:...')"
        )


# ---- fork ------------------------------------------------------------------------------


# ---- pre-encoded EVALSHA -----------------------------------------------------------------


def pack_eval(head: bytes, keys: tuple[bytes, ...], args: tuple[Any, ...]) -> bytes:
    """The RESP bytes of ``EVALSHA sha len(keys) *keys *args``, ``head`` being the
    script's pre-encoded ``$7 EVALSHA $40 sha`` (:func:`eval_head`). The store's
    arguments are bytes, str or int only: anything else is a bug here, not user data."""
    n = len(keys)
    out = [b"*%d\r\n" % (n + len(args) + 3), head, b"$%d\r\n%d\r\n" % (len(str(n)), n)]
    for a in (*keys, *args):
        t = type(a)
        if t is bytes:
            b = a
        elif t is int:
            b = b"%d" % a
        elif t is str:
            b = a.encode("utf-8", "surrogatepass")
        else:
            raise TypeError(f"cannot send a {t.__name__} to Redis")
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


@lru_cache(maxsize=64)
def eval_head(sha: str) -> bytes:
    """``$7 EVALSHA $40 <sha>`` in RESP, encoded once per script."""
    return b"$7\r\nEVALSHA\r\n$40\r\n" + sha.encode() + b"\r\n"


# ---- NOSCRIPT ----------------------------------------------------------------------------
#
# Every path that sends EVALSHA (the blocking store's own connections, a Cluster node's,
# execute_command; the asyncio store's pipelined connection and its client; a renewal
# batch) answers a NOSCRIPT reply the same way, with these: the script is not in Redis's
# cache (a restart, a failover, SCRIPT FLUSH), so the call did not run; it is sent
# again as EVAL with the script's text, which cannot meet NOSCRIPT, so the call runs
# however often the cache is emptied (a flapping failover flushing it again and again).
# Where it costs no round trip, a SCRIPT LOAD goes ahead of it for the calls that follow
# (EVAL caches the script too, but Redis 7.4+ may evict what only EVAL brought).


def noscript(reply: BaseException) -> bool:
    """Whether ``reply`` is Redis's NOSCRIPT refusal (the call did not run)."""
    return isinstance(reply, NoScriptError) or str(reply).startswith("NOSCRIPT")


def readonly(reply: BaseException) -> bool:
    """Whether ``reply`` is a replica's READONLY refusal (the call did not run): the
    connection reached a primary that has been demoted since."""
    return isinstance(reply, ReadOnlyError) or str(reply).startswith("READONLY")


def eval_text_args(
    script: C.Script, keys: tuple[bytes, ...], args: tuple[Any, ...]
) -> tuple[Any, ...]:
    """The arguments of ``execute_command`` for the call as EVAL, script text included."""
    return ("EVAL", script.text, len(keys), *keys, *args)


def pack_eval_text(script: C.Script, keys: tuple[bytes, ...], args: tuple[Any, ...]) -> bytes:
    """The RESP bytes of the call as ``EVAL <text> len(keys) *keys *args``."""
    return pack_eval(_eval_text_head(script.text), keys, args)


def pack_script_load(script: C.Script) -> bytes:
    """The RESP bytes of ``SCRIPT LOAD <text>``."""
    text = script.text
    return b"*3\r\n$6\r\nSCRIPT\r\n$4\r\nLOAD\r\n$%d\r\n%b\r\n" % (len(text), text)


@lru_cache(maxsize=64)
def _eval_text_head(text: bytes) -> bytes:
    return b"$4\r\nEVAL\r\n$%d\r\n%b\r\n" % (len(text), text)
