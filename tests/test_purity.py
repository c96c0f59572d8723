"""The domain stays pure and `import idemlock` stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import idemlock

CORE = Path(idemlock.__file__).parent / "_core"

_CLOCK = "reads a clock: let the driver answer a Now request, or take `now` as an argument"
_THREAD = "runs or guards threads: keep that in the driver or take the lock as an argument"
_IO = "does I/O: the domain must not"
_DRIVER = "is a store driver: it belongs in idemlock/stores/"
#: module -> why idemlock._core must not import it (the domain is pure: no clock
#: reads, no threads, locks or event loops, no I/O, no driver)
FORBIDDEN = {
    "time": _CLOCK,
    "os": _CLOCK + " (os.times, os.clock_gettime); and " + _IO,
    "threading": _THREAD,
    "_thread": _THREAD,
    "concurrent": _THREAD,
    "multiprocessing": _THREAD,
    "asyncio": "runs an event loop: keep awaiting in the driver",
    "importlib": "imports by name, which this test cannot see",
    "socket": _IO,
    "ssl": _IO,
    "select": _IO,
    "selectors": _IO,
    "subprocess": _IO,
    "urllib": _IO,
    "http": _IO,
    "platformdirs": _IO,
    "sqlite3": _DRIVER,
    "redis": _DRIVER,
    "psycopg": _DRIVER,
    "psycopg_pool": _DRIVER,
    "sqlalchemy": _DRIVER,
    "grpc": _DRIVER,
}
#: calls that read the wall clock through datetime
CLOCK_CALLS = {"now", "utcnow", "today"}


def core_files() -> list[Path]:
    files = sorted(CORE.rglob("*.py"))
    assert len(files) >= 10, files
    return files


def imported_modules(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "__import__"
        ):
            names.add("importlib")  # a dynamic import counts as importlib's
    return names


def test_core_imports_no_clock_thread_io_or_driver() -> None:
    for path in core_files():
        tree = ast.parse(path.read_text(), str(path))
        bad = {name: FORBIDDEN[name] for name in imported_modules(tree) if name in FORBIDDEN}
        assert not bad, f"idemlock/_core/{path.relative_to(CORE)} imports {bad}"
        reads = [
            node.lineno
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in CLOCK_CALLS
        ]
        assert not reads, f"{path.name} reads the wall clock (datetime.now()...) at lines {reads}"


def test_the_purity_check_sees_what_it_forbids() -> None:
    """The checker itself: each way of reaching a forbidden module is found."""
    samples = {
        "import time": {"time"},
        "import os.path": {"os"},
        "from threading import Lock": {"threading"},
        "import asyncio as aio": {"asyncio"},
        "from redis.asyncio import Redis": {"redis"},
        "def f():\n    import sqlite3": {"sqlite3"},
        "m = __import__('time')": {"importlib"},
        "from .clock import duration": set(),
        "from datetime import time": {"datetime"},
    }
    for code, expected in samples.items():
        assert imported_modules(ast.parse(code)) == expected, code
    assert "time" in FORBIDDEN and "datetime" not in FORBIDDEN


def test_core_relative_imports_stay_in_the_domain() -> None:
    for path in core_files():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level >= 2:
                # Only the error hierarchy may be reached from outside _core.
                assert node.module == "_errors", f"{path.name} imports ..{node.module}"


def test_import_idemlock_loads_no_driver() -> None:
    code = (
        "import sys, idemlock, idemlock.aio\n"
        "c = idemlock.connect('memory://')\n"
        "drivers = {'redis', 'psycopg', 'psycopg_pool', 'sqlite3', 'sqlalchemy'}\n"
        "print(sorted(drivers & set(sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
