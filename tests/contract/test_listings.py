"""Listings name whose records they list: the root coordinator's ``keys()`` and
``locks()`` cover its tenants' namespaces too, and each row carries its tenant, so
that ``status``/``forget`` can act on it through ``for_tenant``."""

from __future__ import annotations

from datetime import timedelta

from idemlock import Claimed, IdempotencySpec, LockSpec

from .facade import Facade

SPEC = IdempotencySpec("orders", lease=timedelta(seconds=30))
LOCKS = LockSpec("jobs", ttl=timedelta(seconds=30))


def tenant_of(api: Facade, tenant: str) -> Facade:
    return Facade(api.harness, api.coord.for_tenant(tenant), api.mode)


async def test_root_listing_names_each_records_tenant(api: Facade) -> None:
    acme = tenant_of(api, "acme")
    mine = await api.idem(SPEC).claim("k-root")
    theirs = await acme.idem(SPEC).claim("k-acme")
    assert isinstance(mine, Claimed) and isinstance(theirs, Claimed)
    listed = {(r.tenant, r.spec, r.key) for r in await api.keys()}
    assert listed == {(None, "orders", "k-root"), ("acme", "orders", "k-acme")}
    # A tenant view lists its own namespace only, and says so.
    assert {(r.tenant, r.key) for r in await acme.keys()} == {("acme", "k-acme")}
    # What is listed can be acted on: through the row's tenant and spec.
    for row in await api.keys():
        owner = api if row.tenant is None else tenant_of(api, row.tenant)
        status = await owner.idem(row.spec).status(row.key)
        assert status is not None and status.tenant == row.tenant
        assert status.fence == row.fence
    row = next(r for r in await api.keys() if r.tenant == "acme")
    assert row.tenant is not None
    assert await tenant_of(api, row.tenant).idem(row.spec).forget(row.key) is True
    assert {r.key for r in await api.keys()} == {"k-root"}


async def test_root_lock_listing_names_each_locks_tenant(api: Facade) -> None:
    acme = tenant_of(api, "acme")
    mine = await api.lock(LOCKS).acquire("a")
    theirs = await acme.lock(LOCKS).acquire("a")
    assert mine is not None and theirs is not None
    rows = {(r.tenant, r.key): r for r in await api.locks()}
    assert set(rows) == {(None, "a"), ("acme", "a")}
    assert rows[("acme", "a")].owner == theirs.owner and rows[("acme", "a")].token == theirs.token
    assert not rows[(None, "a")].corrupt
    assert [(r.tenant, r.key) for r in await acme.locks()] == [("acme", "a")]
    row = rows[("acme", "a")]
    assert row.tenant is not None
    assert await tenant_of(api, row.tenant).lock(row.spec).owner(row.key) == theirs.owner
    await api.lock(LOCKS).release(mine)
    await acme.lock(LOCKS).release(theirs)
