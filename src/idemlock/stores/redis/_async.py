"""The Redis store's port methods: one Lua script per transition.

``_async.py`` is the source and ``_sync.py`` is written from it by
``tools/async_to_sync.py``: edit the source, then run the tool. How calls reach Redis
(clients, bounds, waiting, closing) differs between the two and is the base class's,
:class:`AsyncPlumbing`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import NoScriptError

from ..._core import table as T
from ..._core.port import (
    Acquired,
    Capabilities,
    ClaimReply,
    Held,
    LockRow,
    RecordRow,
    StepRow,
)
from . import _common as C
from ._calls import (
    ND,
    RenewCall,
    check_claim_slot,
    check_same_slot,
    eval_text_args,
    now_ms,
    renew_calls,
)
from ._plumbing_async import AsyncPlumbing

_ERRORS = C.redis_errors()


class AsyncRedisStore(AsyncPlumbing):
    """The port on a Redis or Redis Cluster client (see :class:`AsyncPlumbing`)."""

    kind = "redis"
    capabilities = Capabilities(
        handoff=True, renew_many=True, complete_with=True, fence_set=True, steps=True
    )

    # ---- idempotency records -------------------------------------------------------------

    async def claim(
        self, ns: str, key: str, fp: str | None, token: str, lease_ms: int
    ) -> ClaimReply:
        n = C.names(ns, key)
        args = (C.pack_id(fp), C.pack_id(token), lease_ms, self._keep)

        def undo(reply: Any) -> Any:
            # Our own token only: abandoning a claim that never happened changes nothing.
            if reply is None or reply[0] == T.GRANTED.code:
                return self.abandon(ns, key, token)
            return None

        reply = await self._eval(C.CLAIM, (n.claim, n.steps), args, undo=undo, undo_late=True)
        return C.claim_reply(reply, token)

    def claim_tag(self, ns: str, key: str) -> str:
        """The hash tag of the claim's key: ``complete_with`` may write keys named
        ``{tag}...`` (on Cluster, those share its slot)."""
        return C.claim_tag(ns, key)

    async def complete(self, ns: str, key: str, token: str, result: bytes, ttl_ms: int) -> bool:
        return await self.complete_with(ns, key, token, result, ttl_ms, ())

    async def complete_with(
        self,
        ns: str,
        key: str,
        token: str,
        result: bytes,
        ttl_ms: int,
        writes: Sequence[tuple[str, bytes]],
    ) -> bool:
        """Complete the claim and SET the caller's keys in the same script: the effects
        and the record commit together. On Cluster the keys must share the claim's slot
        (the ConfigurationError names the tag to use)."""
        n = C.names(ns, key)
        users = check_claim_slot(self.cluster, n.claim, writes)
        # ARGV[5] stays empty: the token's tag, not a nonce, recognises a re-send.
        args = (C.pack_id(token), bytes(result), ttl_ms, n.claim_channel, b"")
        values = tuple(bytes(v) for _, v in writes)
        keys = (n.claim, n.steps, *users)
        reply = await self._eval(C.COMPLETE, keys, args + values, finish=True)
        return bool(reply == T.OK.code)

    async def abandon(self, ns: str, key: str, token: str) -> bool:
        n = C.names(ns, key)
        args = (C.pack_id(token), self._keep, n.claim_channel, C.nonce())
        return bool(await self._eval(C.ABANDON, (n.claim,), args, finish=True) == T.OK.code)

    async def extend(self, ns: str, key: str, token: str, lease_ms: int) -> int | None:
        args = (C.pack_id(token), lease_ms, self._keep)
        exp = await self._eval(C.EXTEND, (C.names(ns, key).claim,), args)
        return None if exp == T.NO_EXPIRY else int(exp)

    async def record(self, ns: str, key: str) -> RecordRow | None:
        reply = await self._eval(C.PEEK_CLAIM, (C.names(ns, key).claim,), ())
        return C.record_row(ns, key, reply)

    async def forget(self, ns: str, key: str) -> bool:
        n = C.names(ns, key)
        args = (self._keep, n.claim_channel, C.nonce())
        return bool(await self._eval(C.FORGET, (n.claim, n.steps), args) == T.OK.code)

    # ---- steps inside a claim --------------------------------------------------------

    async def step(
        self,
        ns: str,
        key: str,
        token: str,
        name: str,
        result: bytes | None,
        lease_ms: int,
        ttl_ms: int,
    ) -> int | None:
        """Rows step.record / step.stale, one script: the claim's new expiry, or None."""
        n = C.names(ns, key)
        args = (C.pack_id(token), lease_ms, self._keep, name, C.pack_step(result), ttl_ms)
        exp = await self._eval(C.STEP, (n.claim, n.steps), args)
        return None if exp == T.NO_EXPIRY else int(exp)

    async def drop_step(
        self, ns: str, key: str, token: str, name: str, lease_ms: int
    ) -> int | None:
        """Rows step.drop / step.drop.stale, one script: the claim's new expiry, or None."""
        n = C.names(ns, key)
        args = (C.pack_id(token), lease_ms, self._keep, name)
        exp = await self._eval(C.DROP_STEP, (n.claim, n.steps), args)
        return None if exp == T.NO_EXPIRY else int(exp)

    async def steps(self, ns: str, key: str) -> list[StepRow]:
        """The key's live steps (Redis drops them at their end)."""
        reply = await self._eval(C.PEEK_STEPS, (C.names(ns, key).steps,), ())
        return C.step_rows(reply)

    async def records(self, ns_prefix: str) -> Sequence[RecordRow]:
        rows: list[RecordRow] = await self._listing("c", ns_prefix)
        return rows

    # ---- locks -------------------------------------------------------------------------

    async def acquire(
        self, ns: str, key: str, owner: str, ttl_ms: int, limit: int = 1, value: bytes | None = None
    ) -> Acquired | Held:
        """One more holder of the key while fewer than ``limit`` hold it (a lock:
        ``limit=1``), in one script (rows ``lock.*``)."""
        n = C.names(ns, key)
        g = self._waiting(n.lock_channel)
        gid = g.gid if g is not None else b""
        args = (
            owner,
            ttl_ms,
            self._keep,
            gid,
            C.REGISTER_MS,
            C.check_limit(limit),
            C.pack_value(value),
        )

        def undo(raw: Any) -> Any:
            # Only a lease this call took (not one the owner held before); without the
            # reply the token is unknown and that lease ends with its ttl.
            if raw is not None and raw[0] == T.ACQUIRED.code and len(raw) > 4 and raw[4] == 1:
                return self.release(ns, key, owner, int(raw[1]))
            # The caller stopped waiting before this attempt could mark its registration:
            # if nobody here waits any more, drop it, or each release would hold the lock
            # back for nobody until it lapses (REGISTER_MS).
            if g is not None and self._waiting(n.lock_channel) is not g:
                return self._unregister(n.lock_channel, g.gid)
            return None

        raw = await self._eval(C.ACQUIRE, (n.lock, n.waiters), args, undo=undo)
        reply = C.lock_reply(raw)
        if g is not None:
            g.registered = isinstance(reply, Held)
        return reply

    async def release(self, ns: str, key: str, owner: str, token: int) -> bool:
        n = C.names(ns, key)
        args = (owner, str(token), self._keep, self._handoff, n.lock_channel, C.nonce())
        return bool(
            await self._eval(C.RELEASE, (n.lock, n.waiters), args, finish=True) == T.OK.code
        )

    async def break_lock(self, ns: str, key: str, token: int | None = None) -> bool:
        n = C.names(ns, key)
        args = (self._keep, n.lock_channel, b"" if token is None else str(token))
        return bool(await self._eval(C.BREAK, (n.lock,), args, finish=True) == T.OK.code)

    async def renew_many(self, items: Sequence[tuple[Any, ...]]) -> list[int | None]:
        """Renew many claims (``("claim", ns, key, token, lease_ms)``) and leases
        (``("lock", ns, key, owner, token, ttl_ms)``) in one round trip: a pipeline of
        the EXTEND/RENEW scripts (each atomic on its key), for a coordinator's renewer.
        On a Cluster, where keys live on many nodes, one script per item. The batch is
        bounded by ``timeout``."""
        calls = renew_calls(items, self._keep)
        if self.cluster:
            replies = [await self._eval(*call) for call in calls]
        else:
            replies = await self._bounded(self._pipelined(calls), "renew_many")
        return [None if r == T.NO_EXPIRY else int(r) for r in replies]

    async def _pipelined(self, calls: list[RenewCall]) -> list[Any]:
        async with self._client() as client:
            try:
                pipe = client.pipeline(transaction=False)
                for script, keys, args in calls:
                    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args, **ND)
                for wait in self._waits:  # durability=: on the same connection
                    pipe.execute_command(*wait)
                replies = await pipe.execute(raise_on_error=False)
                replies, acks = replies[: len(calls)], replies[len(calls) :]
                again = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
                if again:
                    # Not in the cache: those renewals did not run; as EVAL (see _calls).
                    pipe = client.pipeline(transaction=False)
                    for i in again:
                        pipe.execute_command(*eval_text_args(*calls[i]), **ND)
                    for wait in self._waits:
                        pipe.execute_command(*wait)
                    redone = await pipe.execute(raise_on_error=False)
                    redone, acks = redone[: len(again)], redone[len(again) :]
                    for i, reply in zip(again, redone, strict=True):
                        replies[i] = reply
            except _ERRORS as exc:
                raise C.store_error(exc, "renew_many") from exc
            C.check_acks(self._durability, acks, "renew_many")
            # A script error is about its one key (say, a corrupt value): that
            # renewal is refused (the holder learns it lost it), the others stand.
            return [T.NO_EXPIRY if isinstance(r, Exception) else r for r in replies]

    async def renew(
        self, ns: str, key: str, owner: str, token: int, ttl_ms: int, value: bytes | None = None
    ) -> int | None:
        n = C.names(ns, key)
        args = (owner, str(token), ttl_ms, self._keep, C.pack_value(value))
        exp = await self._eval(C.RENEW, (n.lock,), args)
        return None if exp == T.NO_EXPIRY else int(exp)

    async def lock(self, ns: str, key: str) -> LockRow | None:
        rows = await self.holders(ns, key)
        return rows[0] if rows else None

    async def holders(self, ns: str, key: str) -> Sequence[LockRow]:
        reply = await self._eval(C.PEEK_LOCK, (C.names(ns, key).lock,), ())
        return C.holder_rows(ns, key, reply)

    async def locks(self, ns_prefix: str) -> Sequence[LockRow]:
        rows: list[LockRow] = await self._listing("l", ns_prefix)
        return rows

    # ---- fences ------------------------------------------------------------------------

    async def fence_advance(self, ns: str, resource: str, token: int) -> tuple[bool, int]:
        reply = await self._eval(C.FENCE_ADVANCE, (C.gate_name(ns, resource),), (str(token),))
        return C.fence_reply(reply)

    async def fence_current(self, ns: str, resource: str) -> int | None:
        reply = await self._eval(C.FENCE_CURRENT, (C.gate_name(ns, resource),), ())
        return None if reply is None else int(reply)

    async def fence_set(
        self, ns: str, resource: str, token: int, key: str, value: bytes
    ) -> tuple[bool, int]:
        """Accept ``token`` on the gate of ``resource`` and, if accepted, SET ``key`` to
        ``value`` in one script. On Redis Cluster ``key`` must hash to the slot of
        ``resource`` (be the resource itself, or share its ``{hash tag}``)."""
        gate = C.gate_name(ns, resource)
        user = key.encode("utf-8", "surrogatepass")
        check_same_slot(self.cluster, resource, key, gate, user)
        reply = await self._eval(C.FENCE_SET, (gate, user), (str(token), bytes(value)))
        return C.fence_reply(reply)

    async def purge(self, dry_run: bool = False) -> int:
        return 0  # Redis expires every key by itself: nothing is ever left to purge

    # ---- listings ------------------------------------------------------------------------

    async def _listing(self, kind: C.Kind, ns_prefix: str) -> list[Any]:
        # Not bounded as a whole (a listing of a large keyspace takes as long as it
        # takes); every round trip is, by the socket timeout.
        async with self._client() as client:
            try:
                keys: list[bytes] = []
                pattern = C.match_pattern(kind, ns_prefix)
                async for k in client.scan_iter(match=pattern, count=1000):
                    raw = k if isinstance(k, bytes) else str(k).encode("utf-8", "surrogatepass")
                    keys.append(raw)
                now = now_ms(await client.time())
                rows: list[Any] = []
                for i in range(0, len(keys), 500):
                    batch = keys[i : i + 500]
                    pipe = client.pipeline(transaction=False)
                    for k in batch:
                        if kind == "c":
                            pipe.execute_command("GET", k, **ND)
                        else:
                            pipe.execute_command("HGETALL", k, **ND)
                    values = await pipe.execute(raise_on_error=False)
                    rows += C.listing_rows(kind, batch, values, now, ns_prefix)
                return rows
            except _ERRORS as exc:
                raise C.store_error(exc, "listing") from exc
