"""A Redis Cluster down as a whole while calls reach every primary: the same
coordinator works again once the cluster is back, sync and async.

redis-py's cluster clients (5.0 to 6.4 at least) drop a node from their startup
nodes when a call to it fails on its connection, and read the slot map again only
from the startup nodes left. Calls failing on every primary during one outage leave
none: the asyncio client then fails every call ("Redis Cluster cannot be connected.
Please provide at least one reachable node: None") long after the cluster is back;
the blocking one, whose startup nodes are its known nodes too, still reaches the
slots it knew but knows no node for a listener to connect to. The store puts the
startup nodes it was given back when that happens
(``idemlock.stores.redis._compat.StartupNodes``), and the blocking store reads the
slot map again.

The calls here are claims on keys chosen so that every primary holds some of them
(from the cluster's own slot table), all made at once while every node is stopped:
each reaches its primary before any has failed. redis-py 8.1 keeps its startup
nodes; the test runs on every admitted release (the lowest session too).
"""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from idemlock import Claimed, Completed, IdempotencySpec, LockSpec

from .contract.facade import Facade, async_facade, sync_facade
from .contract.fault_stores import TIMEOUT, assert_unavailable, eventually, in_thread, timed
from .contract.stores import by_url
from .servers.faults import cluster_faults

SPEC = IdempotencySpec("outage", lease=timedelta(seconds=30))
LOCK = LockSpec("outage", ttl=timedelta(seconds=30))
#: keys per primary claimed at once during the outage
PER_PRIMARY = 4


def _owners(port: int) -> list[tuple[int, int, str]]:
    """The cluster's slot table: (first slot, last slot, primary's host:port)."""
    with redis.Redis(port=port, socket_timeout=5) as r:
        table = r.execute_command("CLUSTER", "SLOTS")
    out = []
    for first, last, primary, *_ in table:
        host = primary[0].decode() if isinstance(primary[0], bytes) else str(primary[0])
        out.append((int(first), int(last), f"{host}:{int(primary[1])}"))
    return out


def _owner(table: list[tuple[int, int, str]], name: str) -> str:
    slot = key_slot(name.encode())
    for first, last, node in table:
        if first <= slot <= last:
            return node
    raise AssertionError(f"slot {slot} of {name!r} is not covered")


async def _keys_on_every_primary(api: Facade, port: int) -> list[str]:
    """Keys whose claims land PER_PRIMARY on each primary: a claim's slot is that of
    ``write_key`` (its hash tag), looked up in the cluster's slot table."""
    table = _owners(port)
    primaries = {node for _, _, node in table}
    port_api = api.idem(SPEC)
    found: dict[str, list[str]] = {node: [] for node in primaries}
    i = 0
    while any(len(keys) < PER_PRIMARY for keys in found.values()):
        key = f"k{i}"
        i += 1
        name = await port_api.write_key(key, "x")
        keys = found[_owner(table, name)]
        if len(keys) < PER_PRIMARY:
            keys.append(key)
        assert i < 10_000, "no key found for some primary"
    return [k for keys in found.values() for k in keys]


async def _outage_on_every_primary(api: Facade, faults: Any, port: int) -> None:
    idem = api.idem(SPEC)
    locks = api.lock(LOCK)
    keys = await _keys_on_every_primary(api, port)
    # Set up before the outage (slot map read, scripts loaded).
    await eventually(api, lambda: idem.status("warm-up"))
    cm = faults.outage()
    await in_thread(cm.__enter__)
    try:
        # All at once, so that each reaches its primary before any has failed.
        outs = await asyncio.gather(
            *(timed(api, lambda k=k: idem.claim(k)) for k in keys),
            timed(api, lambda: locks.acquire(keys[0])),
        )
        names = [f"claim {k!r}" for k in keys] + [f"acquire {keys[0]!r}"]
        for what, out in zip(names, outs, strict=True):
            assert_unavailable(out, what)
    finally:
        await in_thread(cm.__exit__, None, None, None)  # every node back, cluster ok
    # Back: the same coordinator works again, without being reopened, on every primary.
    for key in keys:
        fresh = await eventually(api, lambda k=key: idem.claim(k))
        assert isinstance(fresh, Claimed)
        await idem.complete(fresh.token, key)
        replay = await idem.claim(key)
        assert isinstance(replay, Completed) and replay.result == key
    lease = await eventually(api, lambda: locks.acquire("after"))
    assert lease is not None
    # A wait (a listener connecting to a node of the client's): it waits, then gives up.
    assert await eventually(api, lambda: locks.acquire("after", wait=0.2)) is None
    assert await locks.release(lease) is True


@pytest.mark.parametrize("mode", ["async", "sync"])
async def test_the_coordinator_works_again_after_an_outage_that_failed_calls_on_every_primary(
    fault_redis_cluster: Any, mode: str
) -> None:
    """Claims on every primary fail while the whole cluster is down; once it is back,
    claims on every primary, a lock and a wait (a listener) work again within the
    recovery window, on the same coordinator."""
    url, faults = cluster_faults(fault_redis_cluster)
    harness = by_url("redis_cluster", url)
    api = (async_facade if mode == "async" else sync_facade)(harness, timeout=TIMEOUT)
    try:
        await _outage_on_every_primary(api, faults, fault_redis_cluster.nodes[0].port)
    finally:
        await api.close()
        faults.close()


@pytest.mark.parametrize("mode", ["async", "sync"])
async def test_a_cluster_client_that_dropped_every_startup_node_works_again(
    redis_cluster: Any, mode: str
) -> None:
    """The state redis-py up to 6.4 leaves after calls failed on every primary, made on any
    release (later ones never reach it by themselves): the client's startup nodes all
    dropped (on the blocking client, its known nodes too: the same dict there), and
    (asyncio) the slot map to be read again. Calls on every primary, a lock and a wait
    work again on the same coordinator."""
    harness = by_url("redis_cluster", redis_cluster.url)
    api = (async_facade if mode == "async" else sync_facade)(harness, timeout=TIMEOUT)
    try:
        idem, locks = api.idem(SPEC), api.lock(LOCK)
        keys = await _keys_on_every_primary(api, redis_cluster.nodes[0].port)
        await eventually(api, lambda: idem.status("warm-up"))
        client = api.coord.store.client
        client.nodes_manager.startup_nodes.clear()
        if mode == "async":
            await client.aclose()  # as after a failed call: initialize() on the next
        else:
            client.nodes_manager.nodes_cache.clear()
        for key in keys:
            fresh = await eventually(api, lambda k=key: idem.claim(k))
            assert isinstance(fresh, Claimed)
        lease = await eventually(api, lambda: locks.acquire("after"))
        assert lease is not None
        assert await eventually(api, lambda: locks.acquire("after", wait=0.2)) is None
        assert await locks.release(lease) is True
    finally:
        await api.close()
