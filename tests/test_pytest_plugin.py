"""The pytest plugin, run as users run it: pytester writes a test module into a fresh
directory and runs pytest on it in a subprocess, which loads the plugin through its
``pytest11`` entry point (nothing imports it by hand)."""

from __future__ import annotations

import pytest

pytest_plugins = ["pytester"]

USER_TESTS = """
import asyncio
import sqlite3

import pytest

import idemlock
from idemlock import ManualClock, InFlightError


def make_charge(coord, calls):
    @coord.idempotent("charge", key=lambda order_id: order_id)
    def charge(order_id: str) -> str:
        calls.append(order_id)
        return f"ch-{order_id}-{len(calls)}"
    return charge


def test_memory_replays_and_the_clock_crosses_the_ttl(idemlock_coordinator, idemlock_clock):
    assert isinstance(idemlock_clock, ManualClock)
    calls = []
    charge = make_charge(idemlock_coordinator, calls)
    assert charge("o-1") == charge("o-1") == "ch-o-1-1"
    assert calls == ["o-1"]
    idemlock_clock.advance(24 * 3600 + 1)
    assert charge("o-1") == "ch-o-1-2"


def test_the_clock_ends_a_lease(idemlock_coordinator, idemlock_clock):
    port = idemlock_coordinator.idempotency("job")
    first = port.claim("k")
    with pytest.raises(InFlightError):
        port.run("k").__enter__()
    idemlock_clock.advance(31)  # the default lease is 30 s
    second = port.claim("k")
    assert second.token.fence > first.token.fence


def test_each_test_gets_a_fresh_store(idemlock_coordinator):
    assert idemlock_coordinator.keys() == []
    idemlock_coordinator.idempotency("job").claim("left-behind")


def test_fresh_again(idemlock_coordinator):
    assert idemlock_coordinator.keys() == []


async def test_async_twin(idemlock_async_coordinator, idemlock_clock):
    calls = []

    @idemlock_async_coordinator.idempotent("email", key=lambda to: to)
    async def send(to: str) -> int:
        calls.append(to)
        await asyncio.sleep(0)
        return len(calls)

    assert await send("a@x") == await send("a@x") == 1
    idemlock_clock.advance(24 * 3600 + 1)
    assert await send("a@x") == 2


def test_sqlite_is_a_real_file(idemlock_sqlite_coordinator, tmp_path):
    calls = []
    charge = make_charge(idemlock_sqlite_coordinator, calls)
    charge("o-9")
    charge("o-9")
    assert calls == ["o-9"]
    db = tmp_path / "idemlock.db"
    assert db.exists()
    with sqlite3.connect(db) as raw:
        tables = [r[0] for r in raw.execute("select name from sqlite_master where type='table'")]
    assert tables
"""


@pytest.mark.parametrize("mode", ["auto", "strict"])
def test_fixtures_work_in_a_users_test_session(pytester: pytest.Pytester, mode: str) -> None:
    source = USER_TESTS
    if mode == "strict":
        # In strict mode a user marks async tests; the plugin's async fixture must
        # still be set up by pytest-asyncio.
        source = source.replace("async def test_", "@pytest.mark.asyncio\nasync def test_")
    pytester.makepyfile(test_user=source)
    args = ["-p", "no:cacheprovider", "-o", f"asyncio_mode={mode}"]
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=6)


def test_plugin_is_registered_by_its_entry_point(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_x="def test_x(idemlock_coordinator):\n    pass\n")
    result = pytester.runpytest_subprocess("--fixtures", "-p", "no:cacheprovider")
    listed = result.stdout.str()
    assert "fixtures defined from idemlock.pytest_plugin" in listed
    for name in (
        "idemlock_clock",
        "idemlock_coordinator",
        "idemlock_async_coordinator",
        "idemlock_sqlite_coordinator",
    ):
        assert f"{name} -- " in listed, name
    # Turned off like any plugin: the fixture is then unknown.
    off = pytester.runpytest_subprocess("-p", "no:idemlock", "-p", "no:cacheprovider")
    off.assert_outcomes(errors=1)
    off.stdout.fnmatch_lines(["*fixture 'idemlock_coordinator' not found*"])
