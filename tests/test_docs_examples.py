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

The pages' run commands run as written too (the end of this file): gunicorn for
docs/django.md, ``uvicorn app:app`` for docs/fastapi.md and docs/asgi.md (one request
sent twice: the retry is replayed), and the queue recipes' worker commands (``celery -A
tasks worker``, ``rq worker --with-scheduler``, ``arq worker.WorkerSettings``,
``dramatiq actors``) on the page's own module and sends, until the job is completed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def run_example(
    code: str, tmp_path: Path, cwd: Path | None = None
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """Run one example's program in a fresh interpreter with ``tmp_path`` (or ``cwd``)
    as its cwd; the program is saved in ``tmp_path``."""
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
        cwd=cwd or tmp_path,
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


# ---- every page's run command, as written --------------------------------------------
#
# A page that says how to run its example (``# app.py — run with: uvicorn app:app`` on the
# example's first line, or the command alone in a ```sh block) is run that way: its module
# saved under its own name in a temporary directory, its placeholder URLs rewritten to the
# throwaway servers as for the examples above, the command started from that directory
# with the console scripts of this interpreter first on PATH, then one request or job
# through it, and the command stopped.

RUN_WITH = re.compile(r"^# [A-Za-z_][A-Za-z0-9_]*\.py\s+—\s+run with:\s+(?P<cmd>\S.*?)\s*$")
SH_BLOCK = re.compile(r"^```sh\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)


def page_module(page: Path) -> Block:
    """The page's first example, the module its run command loads (``# name.py``)."""
    first = extract(page)[0]
    assert MODULE_NAME.match(first.code), f"{first.id}: not a '# name.py' module"
    return first


def save_module(module: Block, where: Path, servers: Servers) -> Path:
    """The page's module saved under its own name (``# name.py``), its placeholder URLs
    rewritten to the throwaway servers."""
    named = MODULE_NAME.match(module.code)
    assert named, module.id
    path = where / f"{named['name']}.py"
    path.write_text(substitute(program(module), servers), encoding="utf-8")
    return path


def run_command(page: Path, program: str) -> list[str]:
    """The page's command line that starts ``program``: from its module's ``run with:``
    comment or from a ```sh block of its own."""
    text = page.read_text(encoding="utf-8")
    found = RUN_WITH.match(page_module(page).code.splitlines()[0])
    commands = [found["cmd"]] if found else []
    commands += [
        line.strip()
        for m in SH_BLOCK.finditer(text)
        for line in m["body"].splitlines()
        if line.strip().startswith(program + " ")
    ]
    assert commands, f"{page.relative_to(ROOT)}: no '{program} ...' command"
    return shlex.split(commands[0])


def command_env(tmp_path: Path) -> dict[str, str]:
    """What a reader's shell gives the command: this interpreter's scripts first on PATH,
    the embedded store's default file in ``tmp_path``, no idemlock, pytest or Django
    variables (tests/test_django.py sets DJANGO_SETTINGS_MODULE for the whole process
    at import, and Celery's worker would load those settings)."""
    leaked = ("IDEMLOCK_", "PYTEST_", "DJANGO_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(leaked)}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@contextlib.contextmanager
def started(argv: list[str], cwd: Path, env: dict[str, str]) -> Iterator[Served]:
    """``argv`` running in ``cwd`` until the block ends; then SIGTERM to its process
    group (a worker's children too), SIGKILL if it has not exited 20 s later."""
    log = cwd / "command.log"
    with log.open("wb") as out:
        proc = popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    served = Served(" ".join(argv), proc, log)
    try:
        yield served
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(20)


@dataclass
class Served:
    command: str
    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, what: Callable[[], Any], doing: str, timeout: float = 90) -> Any:
        """Until ``what()`` is true (returned); fails at once if the command exited."""
        deadline = time.monotonic() + timeout
        while True:
            value = what()
            if value:
                return value
            assert self.proc.poll() is None, (
                f"{self.command!r} exited {self.proc.returncode} {doing}:\n{self.output()}"
            )
            assert time.monotonic() < deadline, f"{self.command!r}: {doing}:\n{self.output()}"
            time.sleep(0.05)

    def wait_listening(self, port: int) -> None:
        def listening() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        self.wait_for(listening, f"never listened on port {port}")


def test_django_page_serves_under_its_run_command(tmp_path: Path) -> None:
    # docs/django.md's project, saved as the page says (its first two blocks in one
    # project.py), served by the page's own command line: the command must work as written.
    import httpx

    page = ROOT / "docs" / "django.md"
    settings, views = extract(page)[:2]
    assert settings.code.startswith("# project.py") and views.continues
    (tmp_path / "project.py").write_text(settings.code + "\n" + views.code, encoding="utf-8")
    argv = run_command(page, "gunicorn")
    port = _free_port()
    argv += ["--bind", f"127.0.0.1:{port}", "--log-level", "warning"]
    with started(argv, tmp_path, command_env(tmp_path)) as served:
        served.wait_listening(port)
        url = f"http://127.0.0.1:{port}"
        headers = {"X-Api-Key": "k1", "Idempotency-Key": '"A17"'}
        # gunicorn's master listens before its workers have imported Django: on a busy
        # machine the first answer waits for a worker to boot (bounded, not timed).
        first = httpx.post(url + "/refunds", json={"amount": 1200}, headers=headers, timeout=90)
        retry = httpx.post(url + "/refunds", json={"amount": 1200}, headers=headers, timeout=60)
    assert (first.status_code, retry.status_code) == (201, 201), first.text + retry.text
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.json() == first.json()


# The FastAPI and ASGI pages: their app.py under `uvicorn app:app`, on a free port, and
# one request sent twice with its key (the headers and body each page's example sends).
UVICORN_PAGES = {
    "fastapi.md": (
        "/charges",
        {"Authorization": "Bearer tok-alice"},
        {"order_id": "A17", "amount": 1200},
    ),
    "asgi.md": ("/charges", {"x-api-key": "k1"}, {"order_id": "A17", "amount": 1200}),
}


@pytest.mark.parametrize("name", sorted(UVICORN_PAGES))
def test_asgi_pages_serve_under_their_run_command(name: str, tmp_path: Path) -> None:
    import httpx

    page = ROOT / "docs" / name
    module = page_module(page)
    argv = run_command(page, "uvicorn")
    save_module(module, tmp_path, {})
    port = _free_port()
    argv += ["--host", "127.0.0.1", "--port", str(port)]
    path, headers, body = UVICORN_PAGES[name]
    with started(argv, tmp_path, command_env(tmp_path)) as served:
        served.wait_listening(port)
        keyed = {**headers, "Idempotency-Key": '"order-A17"'}
        sent = [
            httpx.post(f"http://127.0.0.1:{port}{path}", json=body, headers=keyed, timeout=60)
            for _ in range(2)
        ]
    first, retry = sent
    assert (first.status_code, retry.status_code) == (201, 201), first.text + retry.text
    assert "idempotent-replayed" not in first.headers
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.json() == first.json()


# The queue recipes: the page's module (broker and store on the throwaway Redis, a SQLite
# store in the worker's directory), the jobs sent by the page's own example from that
# directory with no worker running, then the page's worker command, until the job's
# record is completed in the page's store. (page, its command, the example that sends,
# the key the worker completes)
WORKER_PAGES = [
    ("celery.md", "celery", 2, "order-A18"),
    ("rq.md", "rq", 1, "order-o-7"),
    pytest.param("arq.md", "arq", 1, "order-o-7", marks=pytest.mark.arq, id="arq.md"),
    ("dramatiq.md", "dramatiq", 1, "order-o-7"),
]
COORDINATOR_URL = re.compile(r"""\b(?:idemlock_)?coordinator=["'](?P<url>[^"']+)["']""")


@pytest.mark.parametrize(("name", "program_name", "send", "key"), WORKER_PAGES)
def test_queue_recipes_run_under_their_worker_command(
    name: str, program_name: str, send: int, key: str, tmp_path: Path, docs_redis: RedisServer
) -> None:
    import idemlock

    page = ROOT / "docs" / "recipes" / name
    blocks = extract(page)
    module, sender = page_module(page), blocks[send]
    assert sender.continues and blocks[0] is not sender
    docs_redis.client().flushall()  # type: ignore[attr-defined]
    base = docs_redis.url.rsplit("/", 1)[0]
    servers: Servers = {"redis": lambda: base}
    work = tmp_path / "work"
    work.mkdir()
    saved = save_module(module, work, servers)
    found = COORDINATOR_URL.search(saved.read_text())
    assert found, f"{module.id}: no coordinator URL"
    store = found["url"]
    if store.startswith("sqlite:///") and not store.startswith("sqlite:////"):
        store = f"sqlite:///{work / store.removeprefix('sqlite:///')}"  # the worker's cwd
    # The page's sends, from the worker's directory; the program is kept apart from
    # the module so the worker imports the module alone.
    out, script = run_example(substitute(program(sender), servers), tmp_path, cwd=work)
    assert out.returncode == 0, f"{sender.id}: {out.stdout}{out.stderr}\n{script.read_text()}"
    argv = run_command(page, program_name)
    env = command_env(work)
    env["RQ_REDIS_URL"] = base + "/0"  # rq's own variable for the Redis the page's Queue uses

    with idemlock.connect(store) as coord, started(argv, work, env) as served:
        port = coord.idempotency("charge-order")

        def completed() -> bool:
            status = port.status(key)
            return status is not None and status.state == "completed"

        served.wait_for(completed, f"did not complete {key}")
    if program_name == "rq":
        # One job sent, one job made: every work horse imports jobs.py to find `charge`,
        # so a send in that module would have queued another job before this one ran.
        made = {k for k in map(_text, docs_redis.client().scan_iter("rq:job:*"))}  # type: ignore[attr-defined]
        assert len({k for k in made if k.count(":") == 2}) == 1, sorted(made)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
