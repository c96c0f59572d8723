from __future__ import annotations

import os
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


#: The contract files that also run through PgBouncer (store ``postgres-pgbouncer``):
#: the core ones and the fault files. Measured on a busy 2-core machine (-n 2,
#: ``-k pgbouncer``): these 11 files took 70-91 s, the first 7 alone 74 s, all 21
#: files 108 s; IDEMLOCK_PGBOUNCER_FULL=1 runs every file through it.
PGBOUNCER_FILES = {
    "test_idempotency",
    "test_locks",
    "test_table",
    "test_races",
    "test_fences",
    "test_faults_network",
    "test_faults_restart",
    "test_faults_cancel",
    "test_faults_fork",
    "test_faults_burst",
    "test_faults_loops",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("IDEMLOCK_PGBOUNCER_FULL"):
        return
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        pooled = "postgres-pgbouncer" in params.values()
        (drop if pooled and item.path.stem not in PGBOUNCER_FILES else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
