"""Every ```python block of README.md and docs/**/*.md runs, so no example can rot.

Each block runs in a fresh interpreter with a temporary working directory, against a
real store: the embedded SQLite default (``$XDG_STATE_HOME`` points into the temporary
directory, ``$IDEMLOCK_URL`` is unset), or for the documented placeholder URLs the
throwaway servers of ``tests/servers/``: ``redis://localhost:6379/N`` (and
``redis://localhost/N``), ``redis+cluster://10.0.0.1:7000,...``,
``postgresql://app@db/app``, ``etcd://10.0.0.1:2379,...`` are rewritten to their URLs,
and ``sqlite:////var/lib/app/`` to a file in the working directory. A block may use
top-level ``await`` (it then runs under ``asyncio.run``).

Markers, HTML comments on the lines just above a block (invisible on the site):

- ``<!-- not-run: REASON -->``: the block is a fragment or needs a running server; it is
  counted (``test_not_run_blocks_are_counted``), never silently dropped.
- ``<!-- continues -->``: the block runs after the previous runnable block of the same
  file (and that one's own predecessors), as a reader who typed them in order would.
- ``<!-- setup:`` ... ``-->``: Python run before the block, for stand-ins of the
  reader's own code (``payments.charge``); keep it short.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .servers._proc import mkdtemp, popen
from .servers.postgres import PgServer
from .servers.redis import RedisServer, start_redis

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE_OPEN = re.compile(r"^(?P<indent>\s*)```(?P<lang>[A-Za-z0-9_+-]*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(?P<reason>\S.*?)\s*-->$")
CONTINUES = re.compile(r"^<!--\s*continues\s*-->$")
SETUP_OPEN = "<!-- setup:"

# Runs the example as the module its first line names (``# jobs.py``: a queue then
# finds its functions by that name), else as ``__main__``; top-level await is allowed
# (the module body is then a coroutine).
RUNNER = """
import ast, asyncio, inspect, sys, types
path, name = sys.argv[1], sys.argv[2]
code = compile(open(path, encoding="utf-8").read(), path, "exec",
               flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
module = types.ModuleType(name)
module.__file__ = path
sys.modules[name] = module
if code.co_flags & inspect.CO_COROUTINE:
    asyncio.run(eval(code, module.__dict__))
else:
    exec(code, module.__dict__)
"""
MODULE_NAME = re.compile(r"^# (?P<name>[A-Za-z_][A-Za-z0-9_]*)\.py\b")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository root
    line: int  # 1-based line of the opening fence
    code: str
    not_run: str | None = None
    setup: str = ""
    continues: bool = False

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"


def extract(path: Path) -> list[Block]:
    """The ```python blocks of one Markdown file, with the markers above each."""
    return extract_text(path.relative_to(ROOT).as_posix(), path.read_text(encoding="utf-8"))


def extract_text(rel: str, text: str) -> list[Block]:
    lines = text.splitlines()
    blocks: list[Block] = []
    not_run: str | None = None
    setup: list[str] = []
    continues = False
    i = 0
    while i < len(lines):
        text = lines[i].strip()
        m = FENCE_OPEN.match(lines[i])
        if m and m["lang"]:
            start, indent = i, len(m["indent"])
            body: list[str] = []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i][indent:] if lines[i][:indent].isspace() else lines[i])
                i += 1
            if m["lang"] in ("python", "py"):
                blocks.append(
                    Block(
                        rel, start + 1, "\n".join(body) + "\n", not_run, "\n".join(setup), continues
                    )
                )
            elif not_run or setup or continues:
                raise AssertionError(
                    f"{rel}:{start + 1}: an example marker above a non-Python block"
                )
            not_run, setup, continues = None, [], False
        elif (nr := NOT_RUN.match(text)) is not None:
            not_run = nr["reason"]
        elif CONTINUES.match(text):
            continues = True
        elif text.startswith(SETUP_OPEN):
            i += 1
            while i < len(lines) and lines[i].strip() != "-->":
                setup.append(lines[i])
                i += 1
        elif text and (not_run or setup or continues):
            # prose between a marker and its block: the marker belongs to nothing
            raise AssertionError(f"{rel}:{i + 1}: an example marker not followed by a block")
        i += 1
    return blocks


ALL_BLOCKS = [b for f in DOC_FILES for b in extract(f)]
RUNNABLE = [b for b in ALL_BLOCKS if b.not_run is None]
NOT_RUN_BLOCKS = [b for b in ALL_BLOCKS if b.not_run is not None]


def program(block: Block) -> str:
    """The block's code with its setup and, for ``continues``, its predecessors."""
    parts: list[str] = []
    if block.continues:
        same_file = [b for b in RUNNABLE if b.path == block.path and b.line < block.line]
        if not same_file:
            raise AssertionError(f"{block.id}: 'continues' but no runnable block before it")
        parts.append(program(same_file[-1]))
    if block.setup:
        parts.append(block.setup + "\n")
    parts.append(block.code)
    return "\n".join(parts)


# Documented placeholder -> (the server it needs, its replacement).
Servers = dict[str, Callable[[], str]]
PLACEHOLDERS: list[tuple[re.Pattern[str], str, Callable[[re.Match[str], str], str]]] = [
    (
        re.compile(r"redis://localhost(?::6379)?(?:/(?P<db>\d+))?"),
        "redis",
        lambda m, url: f"{url}/{m['db'] or 0}",
    ),
    (
        re.compile(r"redis\+cluster://10\.0\.0\.1:7000(?:,10\.0\.0\.\d+:7000)*"),
        "cluster",
        lambda m, url: url,
    ),
    (re.compile(r"postgresql://app@db/app"), "postgres", lambda m, url: url),
    (
        re.compile(r"etcd://10\.0\.0\.1:2379(?:,10\.0\.0\.\d+:2379)*"),
        "etcd",
        lambda m, url: url,
    ),
    (re.compile(r"sqlite:////var/lib/app/"), "", lambda m, url: "sqlite:///"),
]


def substitute(code: str, servers: Servers) -> str:
    for pattern, need, replace in PLACEHOLDERS:
        if pattern.search(code):
            url = servers[need]() if need else ""
            code = pattern.sub(lambda m, url=url, r=replace: r(m, url), code)  # type: ignore[misc]
    # Never the machine's own services: every store a block reaches is a throwaway one.
    for local in ("localhost:6379", "127.0.0.1:6379", "Redis()", "RedisSettings()"):
        assert local not in code, f"{local!r} would reach the machine's own server"
    return code


@pytest.fixture(scope="module")
def docs_redis() -> Iterator[RedisServer]:
    # A server of its own: examples enqueue jobs and write keys the session's tests
    # must not see.
    root = mkdtemp("idemlock-docs-redis-")
    server = start_redis(root)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def _fresh_database(server: PgServer, name: str) -> str:
    import psycopg

    with psycopg.connect(server.admin_dsn, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return server.dsn.rsplit("/", 1)[0] + "/" + name


def _marks(block: Block) -> list[pytest.MarkDecorator]:
    """``arq`` for an example that imports arq or idemlock's arq integration: the newest
    environment cannot hold arq (its redis-py<6 pin), so such examples run in
    ``nox -s extra-arq`` (noxfile.py) instead."""
    return [pytest.mark.arq] if IMPORTS_ARQ.search(program(block)) else []


IMPORTS_ARQ = re.compile(
    r"^\s*(?:from|import)\s+(?:arq|idemlock\.integrations\.arq)\b", re.MULTILINE
)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id, marks=_marks(b)) for b in RUNNABLE])
def test_example_runs(
    block: Block, tmp_path: Path, request: pytest.FixtureRequest, docs_redis: RedisServer
) -> None:
    def redis_url() -> str:
        docs_redis.client().flushall()  # type: ignore[attr-defined]
        return docs_redis.url.rsplit("/", 1)[0]

    def postgres_url() -> str:
        server: PgServer = request.getfixturevalue("postgres_server")
        name = "docs_" + re.sub(r"\W", "_", block.id).lower()
        return _fresh_database(server, name)

    servers: Servers = {
        "redis": redis_url,
        "cluster": lambda: request.getfixturevalue("redis_cluster").url,
        "postgres": postgres_url,
        "etcd": lambda: request.getfixturevalue("etcd_server").url,
    }
    code = substitute(program(block), servers)
    out, script = run_example(code, tmp_path)
    assert out.returncode == 0, (
        f"{block.id} failed (exit {out.returncode}):\n--- program\n{script.read_text()}"
        f"\n--- stdout\n{out.stdout}\n--- stderr\n{out.stderr}"
    )


def run_example(code: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run one example's program in a fresh interpreter with ``tmp_path`` as its cwd."""
    named = MODULE_NAME.match(code)
    module = named["name"] if named else "__main__"
    script = tmp_path / (f"{module}.py" if named else "example.py")
    script.write_text(code, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEMLOCK_", "PYTEST_"))}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")  # the default SQLite file lands here
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # `idemlock` in an example is this interpreter's console script, as for a reader who
    # installed the package.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", RUNNER, str(script), module],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return out, script


def test_a_rotten_example_fails(tmp_path: Path) -> None:
    # The runner reports a failing example, also one failing under top-level await,
    # and runs a "# name.py" block as that module.
    out, _ = run_example("import idemlock\nidemlock.connect().no_such_method()\n", tmp_path)
    assert out.returncode != 0 and "no_such_method" in out.stderr
    out, _ = run_example("import asyncio\nawait asyncio.sleep(0)\nraise SystemExit(3)\n", tmp_path)
    assert out.returncode == 3
    out, _ = run_example(
        "# jobs.py\nimport sys\nassert __name__ == 'jobs' in sys.modules\n", tmp_path
    )
    assert out.returncode == 0, out.stderr


def test_not_run_blocks_are_counted() -> None:
    # Every block is either run above or marked with its reason; print the tally so a
    # CI log shows how many examples are not executed, and keep them a minority.
    for b in NOT_RUN_BLOCKS:
        print(f"not run: {b.id}: {b.not_run}")
    print(f"{len(RUNNABLE)} examples run, {len(NOT_RUN_BLOCKS)} not run")
    assert len(ALL_BLOCKS) == len(RUNNABLE) + len(NOT_RUN_BLOCKS)
    assert len(NOT_RUN_BLOCKS) < len(RUNNABLE)


def test_extractor_sees_markers() -> None:
    text = (
        "# probe\n\n```python\nx = 1\n```\n\n<!-- continues -->\n```python\nassert x == 1\n```\n"
        "\n<!-- not-run: a fragment -->\n```python\n...\n```\n\n- item\n\n<!-- setup:\ny = 2\n-->\n"
        "  ```python\n  assert y == 2\n  ```\n"
    )
    blocks = extract_text("probe.md", text)
    assert [(b.id, b.continues, b.not_run) for b in blocks] == [
        ("probe.md:3", False, None),
        ("probe.md:8", True, None),
        ("probe.md:13", False, "a fragment"),
        ("probe.md:22", False, None),
    ]
    assert blocks[3].code == "assert y == 2\n"
    assert blocks[3].setup == "y = 2"


def test_a_marker_without_its_block_is_refused() -> None:
    with pytest.raises(AssertionError, match=r"probe\.md:3: an example marker not followed"):
        extract_text("probe.md", "<!-- not-run: why -->\n\nsome prose\n```python\nx\n```\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_django_page_serves_under_its_run_command(tmp_path: Path) -> None:
    # docs/django.md's project, saved as the page says (its first two blocks in one
    # project.py), served by the page's own command line: the command must work as written.
    import httpx

    page = ROOT / "docs" / "django.md"
    settings, views = extract(page)[:2]
    assert settings.code.startswith("# project.py") and views.continues
    (tmp_path / "project.py").write_text(settings.code + "\n" + views.code, encoding="utf-8")
    found = re.search(r"^```sh\n(gunicorn [^\n]*)\n```", page.read_text(), re.MULTILINE)
    assert found, "docs/django.md: no gunicorn command"
    argv = shlex.split(found[1])
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEMLOCK_", "PYTEST_"))}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    proc = popen(
        [sys.executable, "-m", *argv, "--bind", f"127.0.0.1:{port}", "--log-level", "warning"],
        cwd=tmp_path,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"{found[1]!r} exited {proc.returncode}"
            try:
                httpx.get(url + "/", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, f"{found[1]!r} did not start"
                time.sleep(0.1)
        headers = {"X-Api-Key": "k1", "Idempotency-Key": '"A17"'}
        first = httpx.post(url + "/refunds", json={"amount": 1200}, headers=headers, timeout=20)
        retry = httpx.post(url + "/refunds", json={"amount": 1200}, headers=headers, timeout=20)
        assert (first.status_code, retry.status_code) == (201, 201), first.text + retry.text
        assert retry.headers["Idempotent-Replayed"] == "true"
        assert retry.json() == first.json()
    finally:
        proc.terminate()
        proc.wait(20)
