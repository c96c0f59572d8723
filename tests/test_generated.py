"""The sync twins are what tools/async_to_sync.py generates from their async sources."""

from __future__ import annotations

import ast
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "async_to_sync.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("async_to_sync", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["async_to_sync"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(TOOL), "--check", *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_generated_files_are_current() -> None:
    done = _check()
    assert done.returncode == 0, done.stderr


def test_every_target_has_the_header() -> None:
    tool = _tool()
    assert tool.PAIRS
    for pair in tool.PAIRS:
        text = (ROOT / pair.target).read_text()
        assert text.startswith(tool.header(pair.source)), pair.target
        assert "do not edit" in tool.header(pair.source)


def test_check_fails_on_a_hand_edited_copy(tmp_path: Path) -> None:
    tool = _tool()
    for pair in tool.PAIRS:
        for rel in (pair.source, pair.target):
            (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / rel, tmp_path / rel)
    first = tool.PAIRS[0]
    # the untouched copy passes: the failure below is the edit's
    assert _check("--root", str(tmp_path), first.source).returncode == 0
    edited = tmp_path / first.target
    edited.write_text(edited.read_text() + "\nHAND_EDITED = True\n")
    done = _check("--root", str(tmp_path))
    assert done.returncode == 1
    assert f"{tool.PAIRS[0].target} is not what" in done.stderr
    assert "HAND_EDITED" in done.stderr  # the diff shows the edit


def test_check_fails_on_a_stale_copy(tmp_path: Path) -> None:
    tool = _tool()
    pair = tool.PAIRS[0]
    for rel in (pair.source, pair.target):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    source = tmp_path / pair.source
    source.write_text(source.read_text() + "\n\nasync def added() -> None:\n    pass\n")
    done = _check("--root", str(tmp_path), pair.source)
    assert done.returncode == 1
    assert "-def added() -> None:" in done.stderr  # the generated text has it, the target lacks it


def test_the_transformer_keeps_comments_and_maps_names() -> None:
    tool = _tool()
    source = (
        '"""Waits on an ``AsyncPostgresStore``."""\n'
        "import asyncio\n"
        "from ._listen import AsyncListenSubscription  # why this import\n"
        "\n"
        "\n"
        "class AsyncPostgresStore:\n"
        '    """An async store."""\n'
        "\n"
        "    async def __aenter__(self) -> AsyncPostgresStore:\n"
        "        # the AsyncPostgresStore opens lazily\n"
        "        async with self._lock:\n"
        "            await asyncio.sleep(0.1)\n"
        "        self._loop_check()  # async-only\n"
        "        # sync-only: self._thread_check()\n"
        "        async for row in self._rows():\n"
        "            print(await (row + 1), x=await self.y())\n"
        "        return (await self.first())[0]\n"
    )
    out = tool.convert(source, tool.RENAMES)
    assert out == (
        '"""Waits on an ``PostgresStore``."""\n'
        "import asyncio\n"
        "from ._listen import ListenSubscription  # why this import\n"
        "\n"
        "\n"
        "class PostgresStore:\n"
        '    """A store."""\n'
        "\n"
        "    def __enter__(self) -> PostgresStore:\n"
        "        # the PostgresStore opens lazily\n"
        "        with self._lock:\n"
        "            time.sleep(0.1)\n"
        "        self._thread_check()\n"
        "        for row in self._rows():\n"
        "            print((row + 1), x=self.y())\n"
        "        return self.first()[0]\n"
    )
    ast.parse(out)


def test_unsupported_constructs_are_refused() -> None:
    tool = _tool()
    source = "async def f(xs):\n    return [x async for x in xs]\n"
    try:
        tool.convert(source, tool.RENAMES)
    except tool.Unsupported as exc:
        assert "async comprehension at line 2" in str(exc)
    else:
        raise AssertionError("an async comprehension was converted")


def test_an_async_only_compound_statement_goes_whole() -> None:
    # _drive.py relies on it: the async sleep's try/except has no twin, a sync-only
    # line stands in its place, and module-level sync-only lines become imports.
    tool = _tool()
    source = (
        "# sync-only: import time\n"
        "async def nap(stop):\n"
        "    import asyncio  # async-only\n"
        "\n"
        "    try:  # async-only\n"
        "        await asyncio.wait_for(stop.wait(), 1)\n"
        "        return True\n"
        "    except asyncio.TimeoutError:\n"
        "        return False\n"
        "    # sync-only: return stop.wait(1)\n"
    )
    out = tool.convert(source, tool.RENAMES)
    assert out == "import time\ndef nap(stop):\n\n    return stop.wait(1)\n"
    ast.parse(out)
