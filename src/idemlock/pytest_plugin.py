"""pytest fixtures for testing code that uses idemlock, without any server.

Installed with idemlock (a ``pytest11`` entry point), so the fixtures are there in
every test session; no ``conftest.py`` import is needed. Disable the plugin with
``-p no:idemlock``.

``idemlock_clock``
    A :class:`~idemlock.ManualClock`: time moves only when the test says
    ``idemlock_clock.advance(seconds)``, so a test crosses a lease or a ttl without
    sleeping.
``idemlock_coordinator``
    A blocking :class:`~idemlock.Coordinator` on a fresh in-memory store driven by
    ``idemlock_clock``; closed after the test.
``idemlock_async_coordinator``
    Its asyncio twin (:class:`idemlock.aio.AsyncCoordinator`), on the same clock.
``idemlock_sqlite_coordinator``
    A blocking Coordinator on a throwaway SQLite file in the test's ``tmp_path``
    (real SQL, real transactions, the system clock).

Run the application's code against them by handing the coordinator to the code the
way the application does in production: build decorated functions from the
fixture (a factory taking the coordinator), pass it to the object under test, or
point ``$IDEMLOCK_URL`` at it for code that calls :func:`idemlock.connect`::

    def make_charge(coord):
        @coord.idempotent("charge", key=lambda order_id: order_id)
        def charge(order_id: str) -> str:
            return payments.charge(order_id)
        return charge

    def test_a_retry_is_replayed(idemlock_coordinator, idemlock_clock):
        charge = make_charge(idemlock_coordinator)
        assert charge("o-1") == charge("o-1")          # the second call replays
        idemlock_clock.advance(25 * 3600)             # past the spec's ttl
        charge("o-1")                                  # runs again

For code that opens its own coordinator from the environment, use
``monkeypatch.setenv("IDEMLOCK_URL", f"sqlite:///{tmp_path}/idem.db")``; a
``memory://`` URL would give every :func:`idemlock.connect` its own empty store.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import idemlock
import idemlock.aio
from idemlock import Coordinator, ManualClock
from idemlock.aio import AsyncCoordinator

__all__ = [
    "idemlock_async_coordinator",
    "idemlock_clock",
    "idemlock_coordinator",
    "idemlock_sqlite_coordinator",
]


@pytest.fixture
def idemlock_clock() -> ManualClock:
    """A clock that moves only on ``advance(seconds)``."""
    return ManualClock()


@pytest.fixture
def idemlock_coordinator(idemlock_clock: ManualClock) -> Iterator[Coordinator]:
    """A Coordinator on a fresh in-memory store, on ``idemlock_clock``."""
    coord = idemlock.connect("memory://", clock=idemlock_clock)
    try:
        yield coord
    finally:
        coord.close()


def _async_fixture() -> Callable[[Any], Any]:
    # pytest-asyncio's own decorator works in its strict and auto modes alike.
    try:
        import pytest_asyncio
    except ImportError:
        return pytest.fixture
    return pytest_asyncio.fixture


@_async_fixture()
async def idemlock_async_coordinator(
    idemlock_clock: ManualClock,
) -> AsyncIterator[AsyncCoordinator]:
    """An AsyncCoordinator on a fresh in-memory store, on ``idemlock_clock``
    (needs an asyncio test runner such as pytest-asyncio or anyio)."""
    coord = idemlock.aio.connect("memory://", clock=idemlock_clock)
    try:
        yield coord
    finally:
        await coord.close()


@pytest.fixture
def idemlock_sqlite_coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    """A Coordinator on a throwaway SQLite file under ``tmp_path``."""
    coord = idemlock.connect(f"sqlite:///{tmp_path / 'idemlock.db'}")
    try:
        yield coord
    finally:
        coord.close()
