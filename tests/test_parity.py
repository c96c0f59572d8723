"""The sync and async APIs have the same methods with the same parameters."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

import idemlock
import idemlock.aio

PAIRS = [
    (idemlock.Coordinator, idemlock.aio.AsyncCoordinator),
    (idemlock.IdempotencyPort, idemlock.aio.AsyncIdempotencyPort),
    (idemlock.LockPort, idemlock.aio.AsyncLockPort),
    (idemlock.SemaphorePort, idemlock.aio.AsyncSemaphorePort),
    (idemlock.ElectionPort, idemlock.aio.AsyncElectionPort),
    (idemlock.Term, idemlock.aio.AsyncTerm),
    (idemlock.FenceGate, idemlock.aio.AsyncFenceGate),
]
# Methods that exist on one side only, with the reason.
# only a task can be cancelled for the body
ONLY_ASYNC_PARAMS = {("hold", "cancel_on_lost"), ("run", "cancel_on_lost")}
PROTOCOL = {"__enter__", "__exit__", "__aenter__", "__aexit__"}
NOT_IO = {
    "idempotency", "lock", "semaphore", "election", "fence", "idempotent", "hold", "run",
    "store", "campaign", "observe",
    "for_tenant", "add_hook", "write_key", "remaining",
}  # fmt: skip


def public(cls: type) -> dict[str, object]:
    return {
        name: member
        for name, member in inspect.getmembers(cls)
        if (not name.startswith("_") or name in PROTOCOL) and callable(member)
    }


@pytest.mark.parametrize(("sync", "aio"), PAIRS, ids=lambda c: c.__name__)
def test_same_methods_and_parameters(sync: type, aio: type) -> None:
    s, a = public(sync), public(aio)
    assert set(s) - PROTOCOL == set(a) - PROTOCOL
    for name in set(s) - PROTOCOL:
        sp = inspect.signature(s[name]).parameters  # type: ignore[arg-type]
        ap = inspect.signature(a[name]).parameters  # type: ignore[arg-type]
        extra = {p for p in ap if (name, p) in ONLY_ASYNC_PARAMS}
        assert list(sp) == [p for p in ap if p not in extra], name
        for pname in sp:
            assert sp[pname].kind == ap[pname].kind, (name, pname)
            assert sp[pname].default == ap[pname].default, (name, pname)
        if name not in NOT_IO:
            assert not inspect.iscoroutinefunction(s[name]), name
            assert inspect.iscoroutinefunction(a[name]), name


def test_context_managers() -> None:
    assert hasattr(idemlock.Coordinator, "__enter__")
    assert hasattr(idemlock.aio.AsyncCoordinator, "__aenter__")


def test_connect_signatures_match() -> None:
    assert inspect.signature(idemlock.connect).parameters.keys() == (
        inspect.signature(idemlock.aio.connect).parameters.keys()
    )


# ---- store classes ---------------------------------------------------------------------

STORE_PAIRS = [
    ("idemlock.stores.memory", "MemoryStore", "MemoryAsyncStore"),
    ("idemlock.stores.sqlite", "SQLiteStore", "SQLiteAsyncStore"),
    ("idemlock.stores.redis", "RedisStore", "AsyncRedisStore"),
    ("idemlock.stores.postgres", "PostgresStore", "AsyncPostgresStore"),
    ("idemlock.stores.etcd", "EtcdStore", "AsyncEtcdStore"),
]
#: sync name -> async name: asyncio's spelling of closing
STORE_RENAMED = {"close": "aclose"}
#: the async faces of a sync store set these per instance, where the wrapped
#: store declares them (renew_many: test_heartbeat_batch; steps: test_table)
FACE_INSTANCE_ONLY = {"renew_many", "step", "drop_step", "steps"}
FACES = {"MemoryAsyncStore", "SQLiteAsyncStore"}
#: the caller's connection decides: both stores complete in a sync or an async
#: transaction of the caller's (fenced.complete_in_transaction / acomplete_in_...)
EITHER_SIDE = {"complete_in", "acomplete_in"}
#: no I/O: a plain method on both sides
STORE_NOT_IO = {"claim_tag"}


def _store_pair(module: str, sync: str, aio: str) -> tuple[type, type]:
    mod = importlib.import_module(module)
    # etcd imports its async store (grpc.aio) on first use
    amod = mod if hasattr(mod, aio) else importlib.import_module(f"{module}._async")
    return getattr(mod, sync), getattr(amod, aio)


def _store_methods(cls: type) -> dict[str, Any]:
    return {
        name: member
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def _unasync(annotation: object) -> str:
    # the async side names its own classes Async*; a list on one side and a Sequence
    # on the other is a difference
    return str(annotation).replace("Async", "")


@pytest.mark.parametrize(("module", "sync", "aio"), STORE_PAIRS, ids=lambda v: v)
def test_store_classes_have_the_same_methods(module: str, sync: str, aio: str) -> None:
    s_cls, a_cls = _store_pair(module, sync, aio)
    s, a = _store_methods(s_cls), _store_methods(a_cls)
    if aio in FACES:
        s = {n: f for n, f in s.items() if n not in FACE_INSTANCE_ONLY}
    assert {STORE_RENAMED.get(n, n) for n in s} == set(a)
    for name, s_fn in s.items():
        a_fn = a[STORE_RENAMED.get(name, name)]
        sp, ap = inspect.signature(s_fn), inspect.signature(a_fn)
        assert list(sp.parameters) == list(ap.parameters), name
        for pname, sparam in sp.parameters.items():
            aparam = ap.parameters[pname]
            assert sparam.kind == aparam.kind, (name, pname)
            assert sparam.default == aparam.default, (name, pname)
        if name in EITHER_SIDE:
            assert s_fn is a_fn, name
            continue
        if name in STORE_NOT_IO:
            assert not inspect.iscoroutinefunction(a_fn), name
            continue
        assert not inspect.iscoroutinefunction(s_fn), name
        assert inspect.iscoroutinefunction(a_fn), name


@pytest.mark.parametrize(
    ("module", "sync", "aio"),
    [p for p in STORE_PAIRS if p[1] in ("PostgresStore", "EtcdStore")],
    ids=lambda v: v,
)
def test_generated_store_pairs_have_the_same_types(module: str, sync: str, aio: str) -> None:
    s_cls, a_cls = _store_pair(module, sync, aio)
    s, a = _store_methods(s_cls), _store_methods(a_cls)
    for name, s_fn in s.items():
        a_fn = a[STORE_RENAMED.get(name, name)]
        sp, ap = inspect.signature(s_fn), inspect.signature(a_fn)
        assert _unasync(sp.return_annotation) == _unasync(ap.return_annotation), name
        for pname, sparam in sp.parameters.items():
            a_ann = ap.parameters[pname].annotation
            assert _unasync(sparam.annotation) == _unasync(a_ann), (name, pname)
