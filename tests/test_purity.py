"""The domain stays pure and `import idemlock` stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import idemlock

CORE = Path(idemlock.__file__).parent / "_core"
FORBIDDEN = {
    "asyncio",
    "socket",
    "ssl",
    "select",
    "selectors",
    "subprocess",
    "sqlite3",
    "redis",
    "psycopg",
    "psycopg_pool",
    "sqlalchemy",
    "urllib",
    "http",
    "platformdirs",
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_core_imports_no_io() -> None:
    files = sorted(CORE.glob("*.py"))
    assert files
    for path in files:
        bad = imported_modules(path) & FORBIDDEN
        assert not bad, f"{path.name} imports {bad}: the domain must not do I/O"


def test_core_relative_imports_stay_in_the_domain() -> None:
    for path in CORE.glob("*.py"):
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
