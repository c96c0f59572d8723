from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from .facade import Facade, async_facade, sync_facade
from .harness import Harness
from .stores import STORES


@pytest.fixture(params=list(STORES))
def harness(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Harness]:
    yield STORES[request.param](request, tmp_path)


@pytest.fixture(params=["sync", "async"])
async def api(request: pytest.FixtureRequest, harness: Harness) -> AsyncIterator[Facade]:
    """One coordinator on the store under test, sync or async, behind one facade so
    each contract test is written once."""
    if request.param == "sync":
        facade = sync_facade(harness)
    else:
        facade = async_facade(harness)
    try:
        yield facade
    finally:
        await facade.close()
