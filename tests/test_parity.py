"""The sync and async APIs have the same methods with the same parameters."""

from __future__ import annotations

import inspect

import pytest

import idemlock
import idemlock.aio

PAIRS = [
    (idemlock.Coordinator, idemlock.aio.AsyncCoordinator),
    (idemlock.IdempotencyPort, idemlock.aio.AsyncIdempotencyPort),
    (idemlock.LockPort, idemlock.aio.AsyncLockPort),
    (idemlock.FenceGate, idemlock.aio.AsyncFenceGate),
]
# Methods that exist on one side only, with the reason.
# only a task can be cancelled for the body
ONLY_ASYNC_PARAMS = {("hold", "cancel_on_lost"), ("run", "cancel_on_lost")}
PROTOCOL = {"__enter__", "__exit__", "__aenter__", "__aexit__"}
NOT_IO = {
    "idempotency", "lock", "fence", "idempotent", "hold", "run", "store", "for_tenant", "add_hook"
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
