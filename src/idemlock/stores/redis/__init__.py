"""The Redis store: standalone Redis (or Valkey) and Redis Cluster, sync and asyncio.

URLs: ``redis://[user:password@]host[:port][/db]``, ``rediss://`` (TLS), ``unix:///path``,
``redis+cluster://host:port[,host:port...]``, ``rediss+cluster://``, and
``redis+sentinel://[user:password@]host:port[,host:port...]/SERVICE[/DB]`` (and
``rediss+sentinel://``: the primary of SERVICE as the Sentinels name it, asked again by
every new connection, so a failover is followed; ``sentinel_password=`` for Sentinels
with a password). Query options are redis-py's connection options (``socket_timeout=``,
``ssl_cert_reqs=``, ...) plus idemlock's ``timeout=`` (seconds, default 5: the bound on
one call, which the socket and connect timeouts default to; ``store.timeout``),
``counter_ttl=`` (seconds, default 60), ``handoff_ms=`` (default 10) and
``durability=`` (``none``, ``replicas:N``, ``aof``, ``aof+replicas:N``: each write a
caller relies on is followed, in the same round trip, by ``WAIT`` / ``WAITAOF``, and a
write not acknowledged within the bound raises StoreUnavailable; standalone and
Sentinel only). An
existing client (``redis.Redis``, ``redis.cluster.RedisCluster`` or their
``redis.asyncio`` versions) can be passed instead of a URL; idemlock never closes it.

**One round trip per transition.** Every port call is one Lua script run by EVALSHA;
a ``NOSCRIPT`` reply (a restart, a failover, ``SCRIPT FLUSH``: the call did not run)
sends the call again as EVAL, with the script (loaded too, where that costs no round
trip), so it runs however often the cache is emptied. Scripts read no key they are
not given and take all user data as arguments. Every freeing call carries a random
nonce, so a call that the client re-sends after losing the reply is recognised
instead of being reported stale.

**Connections.** On a standalone client whose pool is a plain ``ConnectionPool`` (what
a URL builds), scripts go pre-encoded over connections the store opens itself with
the pool's settings (timeouts, retry policy, TLS, credentials), kept in a free list:
as many as calls ran at once in threads (blocking) or on a loop (asyncio, at most
``max_connections``). This skips redis-py's command layer, about as costly as the
round trip itself on a fast network. A connection that failed or timed out mid-call
is disconnected before reuse, so a late reply is never read as another call's; a
forked child opens its own. A ``BlockingConnectionPool`` or another pool class, a
single-connection client and Cluster clients go through ``execute_command``.

**Keys.** ``il{TAG}c:<ns>|<key>`` (claim record), ``il{TAG}l:<ns>|<key>`` (lock),
``il{<resource slot>}f:<ns>|<resource>`` (fence gate); ``TAG`` is 72 bits of BLAKE2b of
(ns, key), placed first so no user character (``{``, ``}``, ``:``, ``|``) can move the
Cluster slot, and the rest of the name encodes (ns, key) injectively, so no key can
reach another's record. Every key one script touches shares one slot.

**Time and fencing tokens.** Expiry is judged by Redis's clock only (``TIME`` inside
the scripts, ``PEXPIREAT``), never the client's. Lock tokens and claim fences are
issued as ``max(last + 1, now_us)`` with ``now_us`` = Redis's ``TIME`` in microseconds,
and the last value of each key is kept ``counter_ttl`` seconds after its last use
(a completed record keeps it until its ttl ends). So tokens keep strictly increasing
per key when Redis loses its data (a restart without persistence, a failover to a
replica that lagged) or when the counter has expired, **provided Redis's clock never
goes back by more than the time since that key's last token** — in practice: NTP
keeps the clock within milliseconds, and after a failover the new primary's clock
agrees with the old one to within the seconds a failover takes. A clock stepped
back further than that (a badly set server clock) can reissue lower tokens once the
counter is gone.

**Fence gates.** ``fence_advance`` keeps the highest accepted token of a resource in
one string key, without expiry (a gate that forgot would accept a stale writer).
``fence_set`` (``FenceGate.set_if_fresh``) checks and advances the gate and SETs the
user's key in one script; on Redis Cluster that key must hash to the resource's
slot: use the resource name itself as the key, or give both the same hash tag
(resource ``{acct:42}``, key ``{acct:42}:balance``). The gate is placed in the slot of
the resource name for that reason; another key raises ``ConfigurationError``.

**Waiting.** complete, abandon, forget and release PUBLISH on the key's channel; each
store keeps one pub/sub connection, read by a daemon thread (sync) or a task
(asyncio), which wakes its local waiters, so a waiter in another process takes over
within a round trip of the release, without polling. Locks hand off fairly: a
process whose caller waits registers itself (one random waiter id per process and
key, kept in a small hash beside the lock) with every failed attempt; a release
picks the longest-registered waiter, reserves the lock for it for ``handoff_ms`` and
names it in the notification. Only that process wakes up and only its callers may
take the lock in that window, so neither the releasing process nor a newcomer can
barge in, and waiters are served in arrival order. The other waiters sleep on; they
are woken ``handoff_ms`` later only if no newer notification came (the chosen
process may have died, which costs the others that window once). A registration
ends when its process gets the lock or stops waiting, or 1.5 s after its last
attempt. A channel stays subscribed 2 s after its last local waiter left, so a
process that keeps coming back to the same key pays no SUBSCRIBE each time.
An election's observers listen on the lock's channel too, woken by all of the
above; and an acquire that grants, or a renew that succeeds, with a value (a term
began, ``term.proclaim()``) PUBLISHes ``!`` there from the same script, which wakes
the observers alone: waiters sleep through it, as no permit was freed. A call
without a value (plain locks, semaphores, the renewer) publishes nothing.

**Memory.** A claim record is one packed string (binary token and fingerprint, 7-byte
fence, 6-byte expiry; a completed record with a 100-byte result takes about 220 bytes
of ``MEMORY USAGE`` with a 40-byte key name); a lock is a small hash. A released lock
or an abandoned claim leaves only its counter (about 120 bytes) for ``counter_ttl``
seconds, a completed record nothing after its ttl; ``purge()`` returns 0 as Redis
expires everything itself.
"""

from __future__ import annotations

from typing import Any

from ..._errors import ConfigurationError
from ._async import AsyncRedisStore
from ._common import Options
from ._sync import RedisStore
from ._url import build, check_aof, check_client, client_options, shown

__all__ = ["AsyncRedisStore", "Options", "RedisStore", "from_client", "open_async", "open_sync"]


def open_sync(url: str, **options: Any) -> tuple[RedisStore, None]:
    client, cluster, own = build(url, options, asynchronous=False)
    try:
        check_aof(client, own.durability, shown(url))
    except BaseException:
        client.close()
        raise
    return RedisStore(client, cluster=cluster, options=own, owned=True), None


def open_async(url: str, **options: Any) -> tuple[AsyncRedisStore, None]:
    client, cluster, own = build(url, dict(options), asynchronous=True)
    if own.durability.aof:  # checked now, with a blocking client of the same URL
        check = build(url, dict(options), asynchronous=False)[0]
        try:
            check_aof(check, own.durability, shown(url))
        finally:
            check.close()

    def another() -> Any:  # a client of the same URL for another event loop
        return build(url, dict(options), asynchronous=True)[0]

    store = AsyncRedisStore(client, cluster=cluster, options=own, owned=True, factory=another)
    return store, None


def from_client(
    client: Any, asynchronous: bool, **options: Any
) -> tuple[RedisStore | AsyncRedisStore, None]:
    """A store on an existing redis-py client (which stays the caller's to close)."""
    cluster = check_client(client, asynchronous)
    own = client_options(options, client)
    if cluster and not own.durability.none:
        raise ConfigurationError(
            f"durability={own.durability} is not supported on Redis Cluster yet; "
            "use durability=none with a RedisCluster client"
        )
    if not asynchronous:
        check_aof(client, own.durability, "the client's address")
    if asynchronous:
        return AsyncRedisStore(client, cluster=cluster, options=own, owned=False), None
    return RedisStore(client, cluster=cluster, options=own, owned=False), None
