"""Steps written once for several callers (issue 12) keep what each caller's own copy
did: the CLI's whole-number arguments, the memory store's timeout check, and the sleep of
the flow drivers (``run_sync`` generated from ``run_async``)."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from idemlock._core.flows import Sleep
from idemlock._drive import run_async, run_sync
from idemlock._errors import ConfigurationError
from idemlock.stores.memory import MemoryStore, open_async, open_sync

from .test_cli import cli


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("unlock", "k", "--force", "--token", "-1"), "tokens are not negative: '-1'"),
        (("unlock", "k", "--force", "--token", "x"), "not a token (a whole number): 'x'"),
        (("demo", "--jobs", "0"), "invalid number '0': it must be at least 1"),
        (("demo", "--workers", "two"), "invalid number 'two'"),
    ],
)
def test_whole_number_arguments_are_refused_as_before(
    tmp_path: Path, args: tuple[str, ...], message: str
) -> None:
    done = cli(f"sqlite:///{tmp_path / 'store.db'}", *args)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr


@pytest.mark.parametrize("bad", ["abc", "0", "-1", "nan", "inf"])
def test_a_bad_memory_timeout_in_its_url_is_refused(bad: str) -> None:
    expected = (
        "the memory store option timeout must be a positive number of seconds, up to the "
        f"maximum of 100 years (idemlock.MAX_TTL), got {bad!r}"
    )
    with pytest.raises(ConfigurationError, match=re.escape(expected)):
        open_sync(f"memory://?timeout={bad}")  # the store's own check, under connect's


@pytest.mark.parametrize("bad", [0, -2.5, True, float("nan"), "soon"])
def test_a_bad_memory_timeout_keyword_is_refused(bad: object) -> None:
    with pytest.raises(ConfigurationError, match=re.escape(f"got {bad!r}")):
        MemoryStore(timeout=bad)  # type: ignore[arg-type]


async def test_a_good_memory_timeout_is_kept_on_both_faces() -> None:
    assert MemoryStore(timeout="2.5").timeout == 2.5  # type: ignore[arg-type]
    store, _ = open_async("memory://?timeout=0.25")
    assert store.timeout == 0.25
    await store.aclose()


def _sleeper(seconds: float) -> Generator[Any, Any, Any]:
    woken = yield Sleep(seconds)
    return woken


@pytest.mark.timeout(30)  # a stop signal that is not heeded sleeps a minute
def test_the_sync_driver_sleeps_until_its_stop_signal() -> None:
    stop = threading.Event()
    stop.set()
    assert run_sync(_sleeper(60), MemoryStore(), stop) is True
    assert run_sync(_sleeper(0), MemoryStore()) is False


@pytest.mark.timeout(30)
async def test_the_async_driver_sleeps_until_its_stop_signal() -> None:
    store, _ = open_async("memory://")
    stop = asyncio.Event()
    stop.set()
    assert await run_async(_sleeper(60), store, stop) is True
    assert await run_async(_sleeper(0), store) is False
    await store.aclose()
