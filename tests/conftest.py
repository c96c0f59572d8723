"""Session fixtures shared by every test: throwaway servers live in tests/servers/.

Also what keeps a run clean and accountable (in every pytest process, the xdist
controller and each worker):

* ``tests/_progress.py``: per-test progress events, stacks on SIGUSR1, and a hard
  stop behind pytest-timeout (see there);
* SIGTERM (a CI cancel, ``timeout``) and SIGINT end the run the way Ctrl-C does: a
  ``KeyboardInterrupt`` in the main thread, so every fixture's finalizer runs (the
  servers stop, their directories go). The xdist controller passes the signal on to
  its workers first. A second signal during that cleanup is ignored (SIGKILL still
  works: every server started through ``tests/servers/_proc.popen`` dies with the
  process that started it);
* at exit, whatever ``_proc.popen`` started and still runs is killed, and the
  directories of a run that was SIGKILLed earlier are removed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from types import FrameType

import pytest

from . import _progress
from .servers import _proc
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

# Before any test module imports grpc: the etcd store turns gRPC's fork handlers off at
# import (its docstring says why), and the many forks of this suite need that too. An
# install without the etcd extra has no gRPC to turn off.
with contextlib.suppress(ImportError):
    import idemlock.stores.etcd  # noqa: F401

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


class _LoadGroupIds:
    """What pytest-xdist's ``--dist loadgroup`` does on each worker, where it cannot:
    the group of an item (its ``xdist_group`` marks) is a suffix of its node id
    (``...::test@group``), by which the controller keeps a group on one worker.
    pytest-xdist 3.8 writes ``item._nodeid``, which pytest >= 9.2 no longer reads (the
    id lives in ``item._id``): every group was spread over both workers, so each file's
    module-scoped servers, apps and benchmark reports started once per worker, at the
    same time. Runs after xdist's own hook and leaves an id it suffixed alone."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        if not getattr(config.option, "loadgroup", False):
            return
        for item in items:
            names = {
                str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                for m in item.iter_markers("xdist_group")
            }
            if not names:
                continue
            suffix = "@" + "_".join(sorted(names))
            if item.nodeid.endswith(suffix):
                continue  # xdist did it (pytest < 9.2)
            nodeid = item.nodeid + suffix
            if hasattr(item, "_id"):  # pytest >= 9.2: nodeid is str(item._id)
                from _pytest.nodeid import coerce_node_id

                item._id = coerce_node_id(nodeid)
            else:
                item._nodeid = nodeid
            assert item.nodeid == nodeid, (item.nodeid, nodeid)


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
    if _stopping and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.INTERRUPTED


# ---- a run that is stopped stops its servers ------------------------------------------

_stopping = False
_installed_by = os.getpid()


def _child_pids() -> list[int]:
    me = str(os.getpid())
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses
        if stat[stat.rindex(")") + 2 :].split()[1] == me:
            pids.append(int(entry))
    return pids


def _stop_run(signum: int, frame: FrameType | None) -> None:
    global _stopping
    if os.getpid() != _installed_by:
        # A child forked by a test: what it would do without this handler.
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if _stopping:
        return  # let the cleanup the first one started finish
    _stopping = True
    name = signal.Signals(signum).name
    config = _config
    if config is not None and config.pluginmanager.hasplugin("dsession"):
        # The controller: its workers run the tests and own the servers.
        for pid in _child_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
    if signum != signal.SIGINT:  # (Ctrl-C says so itself)
        with contextlib.suppress(Exception):
            sys.stderr.write(f"\n{name}: stopping the test run and its servers\n")
    raise KeyboardInterrupt(name)


def _still_stopping() -> None:
    """The ``KeyboardInterrupt`` of :func:`_stop_run` is lost when the signal arrives
    while the main thread runs a ``__del__``, a weakref callback or a GC finalizer
    (Python prints "Exception ignored in" and goes on): so it is raised again at the
    next test boundary, and a run that ends meanwhile still fails."""
    if _stopping and os.getpid() == _installed_by:
        raise KeyboardInterrupt("stopped by a signal")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    _still_stopping()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    _still_stopping()


def _defaults_in_child() -> None:
    # A process forked by a test (multiprocessing, os.fork) must die of SIGTERM even
    # when its main thread is stuck in C code, where no Python handler can run:
    # Pool.terminate() and the hard stop count on it.
    with contextlib.suppress(ValueError):  # (not from the main thread: not ours)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)


os.register_at_fork(after_in_child=_defaults_in_child)


_config: pytest.Config | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _config
    _config = config
    config.pluginmanager.register(_progress, "idemlock-progress")
    config.pluginmanager.register(_LoadGroupIds(), "idemlock-loadgroup-ids")
    _proc.sweep_stale_roots()
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, _stop_run)


def pytest_unconfigure(config: pytest.Config) -> None:
    _proc.cleanup()
    if config.pluginmanager.hasplugin("dsession"):
        # The controller ends last: a worker that xdist had to kill while its servers
        # stopped (it waits 10 s for one, less than a loaded machine may take) left
        # its root behind; remove the roots of every process that is gone.
        _proc.sweep_stale_roots()
