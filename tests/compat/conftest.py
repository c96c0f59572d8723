"""The contract suite's store harnesses (every store), reused by the façade tests."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from idemlock.compat import ports
from tests.contract.conftest import harness  # noqa: F401  (the every-store fixture)
from tests.contract.facade import each_mode
from tests.contract.harness import Harness


@pytest.fixture(params=["sync", "async"])
async def backend(request: pytest.FixtureRequest, harness: Harness) -> AsyncIterator[Any]:  # noqa: F811
    """A ports.Backend (sync) or ports.AsyncBackend on the store under test."""
    if request.param == "sync":
        made: Any = ports.Backend(harness.sync())
        try:
            yield made
        finally:
            made.close()
    else:
        made = ports.AsyncBackend(harness.aio())
        try:
            yield made
        finally:
            await made.close()


async def each_backend(
    harness: Harness,  # noqa: F811
    scenario: Callable[[Any, Harness], Awaitable[None]],
) -> None:
    """``scenario(backend, h)`` on a ports.Backend and on a ports.AsyncBackend, each on a
    key prefix of its own (``h``), for a test whose subject takes real time: both run at
    once on a store that judges time by its own clock, so the wait is spent once for
    the two, and one after the other on a manual clock (tests/contract/facade.py
    each_mode). Every check of each is made; a failure names its face."""

    async def one(mode: str, h: Harness) -> None:
        if mode == "sync":
            made: Any = ports.Backend(h.sync())
            try:
                await scenario(made, h)
            finally:
                made.close()
        else:
            made = ports.AsyncBackend(h.aio())
            try:
                await scenario(made, h)
            finally:
                await made.close()

    await each_mode(harness, one)
