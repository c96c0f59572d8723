"""The contract suite's store harnesses (every store), reused by the façade tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from idemlock.compat import ports
from tests.contract.conftest import harness  # noqa: F401  (the every-store fixture)
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
