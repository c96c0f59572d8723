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
from .servers.pgbouncer import fault_pgbouncer_server, pgbouncer_server  # noqa: F401
from .servers.postgres import postgres_dsn, postgres_server  # noqa: F401  (session fixtures)
from .servers.redis import redis_cluster, redis_server  # noqa: F401  (session fixtures)

#: fixture scopes wider than a test but narrower than the session: a file using one
#: runs on a single xdist worker, so its servers and apps start once per run
_FILE_SCOPES = {"module", "class", "package"}


@pytest.hookimpl(tryfirst=True)  # before xdist's hook turns the marks into groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under ``--dist loadgroup`` tests are spread one by one, except those of a file
    with a module-scoped fixture (a uvicorn, gunicorn, Celery broker, benchmark report
    ...): that file becomes one group, or each worker would start its own copy."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(d and d[-1].scope in _FILE_SCOPES for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.path.stem))


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
