from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from .facade import Facade, async_facade, sync_facade
from .fault_stores import fault_api, fault_harness  # noqa: F401  (fault contract fixtures)
from .harness import Harness
from .stores import IN_PROCESS_ONLY, STORES


@pytest.fixture(params=list(STORES))
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    yield STORES[request.param](request, tmp_path)


@pytest.fixture(params=[name for name in STORES if name not in IN_PROCESS_ONLY])
def process_harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    """Stores that outlive a process, for races between real processes."""
    yield STORES[request.param](request, tmp_path)


@pytest.fixture(params=["sync", "async"])
async def api(request: pytest.FixtureRequest, harness: Harness) -> AsyncIterator[Facade]:
    """One coordinator on the store under test, sync or async, behind one facade so
    each contract test is written once."""
    facade = sync_facade(harness) if request.param == "sync" else async_facade(harness)
    try:
        yield facade
    finally:
        await facade.close()
