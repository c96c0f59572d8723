"""``import idemlock`` loads only what the blocking API needs (issue 13's import-time
item): asyncio and what it drags in (ssl, socket, subprocess, selectors, concurrent
futures), the metadata machinery behind ``__version__``, hashing and the keyring,
the typed-result helpers, the stores (sqlite3 included), the drivers and the
integrations are loaded on first use.
Checked by which modules a fresh interpreter holds, not by timing (timings belong in
benchmarks/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

#: never loaded by ``import idemlock`` alone
HEAVY = [
    "asyncio",
    "ssl",
    "socket",
    "selectors",
    "subprocess",
    "concurrent.futures",
    "email",
    "importlib.metadata",
    "logging.handlers",
    "hashlib",
    "hmac",
    "secrets",
    "uuid",
    "decimal",
    "idemlock._keyring",
    "idemlock._core.typed",
    "idemlock._urls",
    "idemlock.stores",
    "sqlite3",
    "redis",
    "psycopg",
    "grpc",
    "cryptography",
    "idemlock.aio",
    "idemlock.integrations",
    "idemlock.stores.redis",
    "idemlock.stores.postgres",
    "idemlock.stores.etcd",
    "idemlock._tasks",
]


def _loaded_after(code: str) -> set[str]:
    probe = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    # -I: no user site or PYTHONPATH extras that might load something themselves
    out = subprocess.run(
        [sys.executable, "-I", "-c", probe], capture_output=True, text=True, check=True
    )
    return set(json.loads(out.stdout))


def test_import_idemlock_loads_no_heavy_module() -> None:
    baseline = _loaded_after("")
    loaded = _loaded_after("import idemlock")
    assert "idemlock" in loaded
    # Only what this import added counts (an interpreter may start with some loaded).
    added = loaded - baseline
    assert sorted(added & set(HEAVY)) == []


@pytest.mark.parametrize("store", ["memory", "sqlite"])
def test_blocking_round_trips_stay_light(store: str, tmp_path: Path) -> None:
    """The blocking API on the memory and SQLite stores, decorator and lock included,
    needs none of them either."""
    url = "memory://" if store == "memory" else f"sqlite:///{tmp_path / 'x.db'}"
    code = (
        "import idemlock\n"
        f"c = idemlock.connect({url!r})\n"
        "f = c.idempotent('s', key=lambda x: str(x))(lambda x: x + 1)\n"
        "assert f(1) == 2 and f(1) == 2\n"
        "with c.lock('l').hold('k') as lease:\n"
        "    assert lease.token >= 1\n"
        "c.close()\n"
    )
    added = _loaded_after(code) - _loaded_after("")
    # socket: the SQLite store's cross-process wake-ups load it when a lock is contended
    light = {"asyncio", "ssl", "subprocess", "socket", "idemlock.aio"}
    assert sorted(added & light) == []


def test_lazy_names_still_resolve() -> None:
    """What moved behind first use is still there: ``__version__``, ``idemlock.aio``,
    and every name of ``__all__``."""
    code = (
        "import idemlock\n"
        "assert isinstance(idemlock.__version__, str) and idemlock.__version__\n"
        "assert all(getattr(idemlock, n) is not None for n in idemlock.__all__)\n"
        "assert callable(idemlock.aio.connect)\n"
    )
    loaded = _loaded_after(code)
    assert {"idemlock.aio", "asyncio", "importlib.metadata"} <= loaded
