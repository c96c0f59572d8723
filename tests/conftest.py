"""Session fixtures shared by every test: throwaway servers live in tests/servers/."""

from __future__ import annotations

import pytest

from .servers.etcd import (  # noqa: F401  (session fixtures)
    etcd_cluster,
    etcd_server,
    fault_etcd_cluster,
    fault_etcd_server,
)
from .servers.faults import (  # noqa: F401  (session fixtures)
    fault_postgres_server,
    fault_redis_cluster,
    fault_redis_server,
)
from .servers.postgres import postgres_dsn, postgres_server  # noqa: F401  (session fixtures)
from .servers.redis import redis_cluster, redis_server  # noqa: F401  (session fixtures)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A skipped test is a failure here: every store and every dependency the suite
    needs is installed by .ci/run, so a skip can only hide a missing piece."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped and session.exitstatus == 0:
        reporter.write_line(
            f"FAILED: {len(skipped)} test(s) skipped; skips are not allowed in this suite",
            red=True,
        )
        session.exitstatus = 1
