"""Plumbing of the Redis store on Cluster that the contract suite cannot see: where a
waiter's notification channel is subscribed (the node that holds its slot, where the
scripts PUBLISH), that a hand-off still reaches a waiter there, and that scripts sent
straight to the node of their slot follow a redirection when the slot map is stale."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import redis
from redis.crc import key_slot

import idemlock
from idemlock import LockSpec
from idemlock._core.port import Acquired, Channel, Held
from idemlock.stores.redis import _common as C
from idemlock.stores.redis import open_async, open_sync

from .servers.redis import RedisCluster


def _ns() -> str:
    return "h" + uuid.uuid4().hex[:8]


def _node_channels(port: int) -> set[bytes]:
    r = redis.Redis(port=port)
    try:
        return set(r.pubsub_channels())
    finally:
        r.close()


def test_cluster_channels_are_subscribed_on_the_node_of_their_slot(
    redis_cluster: RedisCluster,
) -> None:
    store = open_sync(redis_cluster.url)[0]
    ns = _ns()
    keys = [f"k{i}" for i in range(12)]  # spread over the three masters
    subs = []
    try:
        for k in keys:
            subs.append(store.subscribe(Channel("lock", ns, k)))
        where = {
            C.names(ns, k).lock_channel: store.client.get_node_from_key(
                C.names(ns, k).lock_channel
            ).port
            for k in keys
        }
        assert len(set(where.values())) > 1  # the keys do land on several nodes
        for port in redis_cluster.ports:
            mine = {ch for ch, p in where.items() if p == port}
            # Each channel on its own node, and only there.
            assert _node_channels(port) & set(where) == mine
    finally:
        for sub in subs:
            sub.close()
        store.close()


async def test_async_cluster_channels_are_subscribed_on_the_node_of_their_slot(
    redis_cluster: RedisCluster,
) -> None:
    store = open_async(redis_cluster.url)[0]
    ns = _ns()
    keys = [f"k{i}" for i in range(12)]
    subs = []
    try:
        await store.acquire(ns, "warm", "me", 60_000)  # reads the slot map
        for k in keys:
            subs.append(await store.subscribe(Channel("lock", ns, k)))
        where = {
            C.names(ns, k).lock_channel: store.client.get_node_from_key(
                C.names(ns, k).lock_channel
            ).port
            for k in keys
        }
        assert len(set(where.values())) > 1
        for port in redis_cluster.ports:
            mine = {ch for ch, p in where.items() if p == port}
            assert _node_channels(port) & set(where) == mine
    finally:
        for sub in subs:
            await sub.aclose()
        await store.aclose()


def test_cluster_hand_off_wakes_a_waiter_on_every_node(redis_cluster: RedisCluster) -> None:
    holder = idemlock.connect(redis_cluster.url, key_prefix="ho")
    waiter = idemlock.connect(redis_cluster.url, key_prefix="ho")
    spec = LockSpec("l", ttl=timedelta(seconds=60))
    ns_key = [f"w{i}-{uuid.uuid4().hex[:6]}" for i in range(6)]
    try:
        for key in ns_key:
            lease = holder.lock(spec).acquire(key)
            assert lease is not None
            got: list[object] = []
            t = threading.Thread(
                target=lambda k=key, out=got: out.append(waiter.lock(spec).acquire(k, wait=30))
            )
            t.start()
            # Released once the waiter is registered: it is woken by the notification
            # (or, were the notification lost, by its next re-check within 1 s).
            while not holder.store.client.hlen(C.names(holder.lock(spec)._ns, key).waiters):
                threading.Event().wait(0.005)
            assert holder.lock(spec).release(lease)
            t.join(30)
            assert got and got[0] is not None and got[0].token > lease.token  # type: ignore[attr-defined]
    finally:
        holder.close()
        waiter.close()


def test_cluster_scripts_follow_a_redirection_from_a_stale_slot_map(
    redis_cluster: RedisCluster,
) -> None:
    store = open_sync(redis_cluster.url)[0]
    other = open_sync(redis_cluster.url)[0]
    ns = _ns()
    try:
        assert isinstance(store.acquire(ns, "k", "me", 60_000), Acquired)  # connections made
        slot = key_slot(C.names(ns, "k").lock)
        manager = store.client.nodes_manager
        right = manager.slots_cache[slot][0]
        wrong = next(n for n in store.client.get_primaries() if n.name != right.name)
        manager.slots_cache[slot] = [wrong]  # as after a resharding the client missed
        # The wrong node answers MOVED; the call is run where the slot is, once.
        reply = store.acquire(ns, "k", "me", 60_000)
        assert isinstance(reply, Acquired)
        assert isinstance(other.acquire(ns, "k", "you", 60_000), Held)
        assert manager.slots_cache[slot][0].name == right.name  # the map was corrected
        assert store.release(ns, "k", "me", reply.token)
        assert isinstance(other.acquire(ns, "k", "you", 60_000), Acquired)
    finally:
        store.close()
        other.close()
