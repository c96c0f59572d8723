"""The dependency matrix: which versions of idemlock's dependencies the tests run on.

    pip install 'nox[uv]'
    nox -s tests               # the newest versions, the whole suite (README's test command)
    nox -s lowest              # the lowest version every extra admits: contract, integrations
    nox -s extra-arq           # `pip install 'idemlock[arq]'` alone: its tests, Redis contract
    nox -l                     # every session
    nox -R -s extra-arq -- tests/test_arq.py -x   # reuse the venv; run pytest with these

Every session installs with uv (`nox[uv]`) when it is there, checks the environment with
`pip check`, and runs pytest with two workers. A test that needs a package the newest
environment cannot hold (arq pins redis-py<6, which Celery's kombu>=5.7 refuses) is marked
and runs in the session of its extra instead: every test runs in some session, none skips.
tests/test_matrix.py keeps this file in step with pyproject.toml.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import nox

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - nox itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests"]

PYTEST = ["python", "-m", "pytest", "-n", "2", "--dist", "loadgroup"]

#: Test files and markers that need arq, which the newest environment cannot hold: arq
#: pins redis-py<6 and Celery 5.7's kombu needs redis-py>=6.4. `nox -s extra-arq` runs them.
ARQ_FILES = ["tests/test_arq.py"]
ARQ_MARKER = "arq"

#: What `nox -s tests` (and so the README's test command) passes to pytest.
NEWEST_ARGS = [*(f"--ignore={f}" for f in ARQ_FILES), "-m", f"not {ARQ_MARKER}"]

#: The test runner itself, taken from the [test] extra so its bounds live in one place.
TEST_TOOLS = ("pytest", "pytest-asyncio", "pytest-timeout", "pytest-xdist", "hypothesis")

#: The contract's result tests import both (tests/contract/test_results.py).
CONTRACT_EXTRAS = ("pydantic", "msgspec")

#: Extras that install nothing of their own (the ASGI and WSGI integrations need only the
#: standard library), or that are not for users (documentation, benchmarks, tests).
NOT_RUNTIME = {"asgi", "wsgi", "docs", "bench", "test"}

#: One session per extra whose install resolves differently from the newest environment
#: or that brings a store's client: what `pip install 'idemlock[X]'` gives, alone.
#: contract: the `-k` selection of tests/contract for its store; tests: its own files.
EXTRA_SESSIONS: dict[str, dict[str, list[str]]] = {
    "redis": {
        # redis-py without hiredis: its pure-Python parser (-p tests.no_hiredis proves it)
        "contract": ["-p", "tests.no_hiredis", "-k", "redis"],
        "tests": ["-p", "tests.no_hiredis", "tests/test_redis_store.py"],
    },
    "postgres": {
        # psycopg without [binary]: the pure-Python driver on the system's libpq
        "contract": ["-k", "postgres"],
        "tests": ["tests/test_postgres_store.py"],
    },
    "etcd": {
        "contract": ["-k", "etcd"],
        "tests": ["tests/test_etcd_store.py"],
    },
    "arq": {
        # redis-py < 6 (arq's pin), with hiredis (arq asks for redis[hiredis])
        "contract": ["-k", "redis"],
        "tests": ARQ_FILES,
        "examples": ["tests/test_docs_examples.py", "-m", ARQ_MARKER],
    },
    "celery": {
        "contract": ["-k", "redis and not cluster"],
        "tests": ["tests/test_celery.py"],
    },
    "rq": {
        "contract": ["-k", "redis and not cluster"],
        "tests": ["tests/test_rq.py"],
    },
    "dramatiq": {
        "contract": ["-k", "redis and not cluster"],
        "tests": ["tests/test_dramatiq.py"],
    },
}

#: Extras without a session of their own, and where they are tested.
COVERED_BY = {
    "hiredis": "tests and lowest (redis[hiredis] is in [test]; arq pulls it in)",
    "sqlalchemy": "tests and lowest",
    "seal": "tests and lowest",
    "pydantic": "tests and lowest, and every extra- session (the contract's result tests)",
    "msgspec": "tests and lowest, and every extra- session (the contract's result tests)",
    "prometheus": "tests and lowest",
    "otel": "tests and lowest",
    "django": "tests and lowest",
    "asgi": "tests and lowest (no dependency of its own)",
    "wsgi": "tests and lowest (no dependency of its own)",
    "docs": "tests (test_docs_site builds the site)",
    "bench": "not a user extra: benchmarks/ install it",
    "test": "tests",
}

#: Entries of [test] the lowest session installs at their floors: the frameworks and the
#: servers the integrations are tested under (idemlock does not depend on them, users do).
LOWEST_FROM_TEST = (
    "fastapi",
    "starlette",
    "uvicorn",
    "httpx",
    "python-multipart",
    "flask",
    "gunicorn",
    "djangorestframework",
    "opentelemetry-sdk",
)

#: What the lowest session runs besides the whole contract: every integration and store.
LOWEST_TESTS = [
    "tests/test_redis_store.py",
    "tests/test_postgres_store.py",
    "tests/test_etcd_store.py",
    "tests/test_sqlite_store.py",
    "tests/test_fastapi.py",
    "tests/test_asgi.py",
    "tests/test_wsgi.py",
    "tests/test_django.py",
    "tests/test_celery.py",
    "tests/test_rq.py",
    "tests/test_dramatiq.py",
    "tests/test_metrics.py",
    *ARQ_FILES,
]


def name_of(requirement: str) -> str:
    """The normalized project name of a requirement string (``redis[hiredis]>=5`` -> redis)."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match[1]).lower()


def from_test(*names: str) -> list[str]:
    """The [test] extra's requirements for these project names, bounds as written there."""
    wanted = {name_of(n) for n in names}
    found = [r for r in EXTRAS["test"] if name_of(r) in wanted]
    missing = wanted - {name_of(r) for r in found}
    if missing:
        raise ValueError(f"not in the [test] extra of pyproject.toml: {sorted(missing)}")
    return found


def runtime_extras() -> list[str]:
    return sorted(set(EXTRAS) - NOT_RUNTIME)


def floors(requirements: list[str]) -> dict[str, str]:
    """The ``>=`` lower bound of each requirement that has one (the highest, if several)."""
    out: dict[str, str] = {}
    for req in requirements:
        for bound in re.findall(r">=\s*([0-9][0-9A-Za-z.]*)", req):
            name = name_of(req)
            if name not in out or _release(bound) > _release(out[name]):
                out[name] = bound
    return out


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:3])


def in_floor_series(floor: str, installed: str) -> bool:
    """True if ``installed`` is a release of the floor's series: floor 5 admits 5.0.x,
    3.1 admits 3.1.x, 0.26.1 admits 0.26.x (a later minor means the floor was not tested)."""
    want = (*_release(floor), 0, 0)[:2]
    return _release(installed)[:2] == want


def install(session: nox.Session, *args: str) -> None:
    # pip too: `pip check`, and the tests that build venvs or download with it
    session.install("pip", *args)
    pip_check(session)


def pip_check(session: nox.Session) -> None:
    """``pip check``: every installed distribution's requirements are met."""
    session.run("python", "-m", "pip", "check")


def run_selection(session: nox.Session, *selections: list[str]) -> None:
    """One pytest run per selection; arguments after ``--`` replace them all."""
    for args in [session.posargs] if session.posargs else selections:
        session.run(*PYTEST, *args)


@nox.session
def tests(session: nox.Session) -> None:
    """Newest versions: `.[test]`, the whole suite but arq's tests (see extra-arq)."""
    install(session, "-e", ".[test]")
    session.run(*PYTEST, *NEWEST_ARGS, *session.posargs)


@nox.session
def lowest(session: nox.Session) -> None:
    """Floors: every extra's and framework's lowest version, contract and integrations."""
    if session.venv_backend != "uv":
        session.install("uv")
    extras = runtime_extras()
    direct = [f".[{','.join(extras)}]", *from_test(*LOWEST_FROM_TEST)]
    # Floors for what idemlock and the frameworks declare; the newest for what they
    # depend on in turn (what a user pinning their own floors gets) and for the runner.
    session.run_install("uv", "pip", "install", "--resolution", "lowest-direct", "-e", *direct)
    install(session, *from_test(*TEST_TOOLS))
    check_floors(session, extras)
    run_selection(session, ["tests/contract"], LOWEST_TESTS)


def check_floors(session: nox.Session, extras: list[str]) -> None:
    """Fail unless every declared floor was installed from its own series."""
    code = (
        "import json, sys\n"
        "from importlib.metadata import version\n"
        "print(json.dumps({n: version(n) for n in sys.argv[1:]}))\n"
    )
    declared = floors([r for e in extras for r in EXTRAS[e]])
    declared.update(floors(from_test(*LOWEST_FROM_TEST)))
    out = session.run("python", "-c", code, *declared, silent=True)
    installed = json.loads(str(out).strip().splitlines()[-1])
    wrong = []
    for name, floor in sorted(declared.items()):
        mark = "ok" if in_floor_series(floor, installed[name]) else "NOT THE FLOOR"
        session.log(f"{name}: floor {floor}, installed {installed[name]} {mark}")
        if mark != "ok":
            wrong.append(name)
    if wrong:
        session.error(
            f"{', '.join(wrong)}: the lowest install is above the declared floor's series; "
            "raise the floor in pyproject.toml to what installs (and say why there)"
        )


def _extra_session(extra: str, spec: dict[str, list[str]]) -> None:
    def run(session: nox.Session) -> None:
        install(
            session,
            "-e",
            f".[{','.join([extra, *CONTRACT_EXTRAS])}]",
            *from_test(*TEST_TOOLS),
        )
        run_selection(
            session,
            ["tests/contract", *spec["contract"]],
            spec["tests"],
            *([spec["examples"]] if "examples" in spec else []),
        )

    run.__doc__ = f"`pip install 'idemlock[{extra}]'` alone: its tests and its store's contract."
    nox.session(name=f"extra-{extra}")(run)


for _extra, _spec in EXTRA_SESSIONS.items():
    _extra_session(_extra, _spec)
