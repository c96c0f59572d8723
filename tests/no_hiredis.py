"""A pytest plugin that runs the suite as if hiredis were not installed.

``python -m pytest -p tests.no_hiredis tests/contract -k redis`` is what a user gets
from ``pip install 'idemlock[redis]'``: redis-py with its pure-Python parser. The
plugin loads before anything imports redis (``-p`` plugins load first), and refuses to
run if redis was imported already, so the run can never silently use hiredis.
"""

from __future__ import annotations

import sys

import pytest

if "redis" in sys.modules:  # pragma: no cover - a mistake in how the plugin is loaded
    raise RuntimeError("tests.no_hiredis must load before redis is imported (use -p)")
sys.modules["hiredis"] = None  # type: ignore[assignment]  # makes `import hiredis` fail


def pytest_configure(config: pytest.Config) -> None:
    import redis.utils

    if redis.utils.HIREDIS_AVAILABLE:  # pragma: no cover
        raise pytest.UsageError("tests.no_hiredis: redis-py still sees hiredis")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # Printed even with -q, so a caller can check the run really had no hiredis.
    terminalreporter.write_line(
        "hiredis: made unimportable by tests.no_hiredis (redis-py's Python parser)"
    )
