"""The dependency matrix's data: which extras, files and floors each nox session covers.

noxfile.py runs it; tests/test_matrix.py checks it against pyproject.toml, the README and
.ci/run without a network. Plain data and helpers (no nox import), so both can load it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - nox itself depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
EXTRAS: dict[str, list[str]] = PYPROJECT["project"]["optional-dependencies"]

#: Test files and markers that need arq, which the newest environment cannot hold: arq
#: pins redis-py<6 and Celery 5.7's kombu needs redis-py>=6.4. `nox -s extra-arq` runs them.
ARQ_FILES = ["tests/test_arq.py"]
ARQ_MARKER = "arq"

#: What `nox -s tests` (and so the README's test command) passes to pytest.
NEWEST_ARGS = [*(f"--ignore={f}" for f in ARQ_FILES), "-m", f"not {ARQ_MARKER}"]

#: The test runner itself, taken from the [test] extra so its bounds live in one place.
TEST_TOOLS = ("pytest", "pytest-asyncio", "pytest-timeout", "pytest-xdist", "hypothesis")

#: The contract's result tests need these (tests/contract/test_results.py: models, sealing).
CONTRACT_EXTRAS = ("pydantic", "msgspec", "seal")

#: Extras that install nothing of their own (the ASGI and WSGI integrations need only the
#: standard library), or that are not for users (documentation, benchmarks, tests).
NOT_RUNTIME = {"asgi", "wsgi", "docs", "bench", "test"}

#: One session per extra whose install resolves differently from the newest environment
#: or that brings a store's client: what `pip install 'idemlock[X]'` gives, alone.
#: contract: the `-k` selection of tests/contract for its store; tests: its own files;
#: tools: entries of [test] the session installs beside the test runner;
#: contract_unless_client_of: the contract runs only if this extra installs another
#: version of the store's client (redis-py, hiredis) than that extra's session, which runs
#: it already (the queue's own tests use the store either way).
EXTRA_SESSIONS: dict[str, dict[str, list[str]]] = {
    "redis": {
        # redis-py without hiredis: its pure-Python parser (-p tests.no_hiredis proves it)
        "contract": ["-p", "tests.no_hiredis", "tests/contract", "-k", "redis"],
        "tests": [
            "-p",
            "tests.no_hiredis",
            "tests/test_redis_store.py",
            "tests/test_redis_sentinel.py",
        ],
    },
    "postgres": {
        # psycopg without [binary]: the pure-Python driver on the system's libpq
        "contract": ["tests/contract", "-k", "postgres"],
        # its SQLAlchemy helpers need [sqlalchemy]: tests and lowest run them
        "tests": ["tests/test_postgres_store.py", "-k", "not sqlalchemy"],
    },
    "etcd": {
        # the newest session has the same grpcio/protobuf and runs the cluster variants
        "contract": ["tests/contract", "-k", "etcd and not cluster"],
        "tests": ["tests/test_etcd_store.py"],
    },
    "arq": {
        # redis-py < 6 (arq's pin), with hiredis (arq asks for redis[hiredis]); the cluster
        # variants on redis-py 5 run in the lowest session
        "contract": ["tests/contract", "-k", "redis and not cluster"],
        "tests": ARQ_FILES,
        "examples": ["tests/test_docs_examples.py", "-m", ARQ_MARKER],
        # tests/test_arq.py type-checks a user's arq program
        "tools": ["mypy"],
    },
    "celery": {
        "contract": ["tests/contract", "-k", "redis and not cluster"],
        "contract_unless_client_of": ["redis"],
        "tests": ["tests/test_celery.py"],
    },
    "rq": {
        "contract": ["tests/contract", "-k", "redis and not cluster"],
        "contract_unless_client_of": ["redis"],
        "tests": ["tests/test_rq.py"],
    },
    "dramatiq": {
        "contract": ["tests/contract", "-k", "redis and not cluster"],
        "contract_unless_client_of": ["redis"],
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

#: What the lowest session runs: the contract on the stores with a driver to install (the
#: memory and SQLite stores need the standard library only), every integration and store.
LOWEST_CONTRACT = ["tests/contract", "-k", "not memory and not sqlite"]
LOWEST_TESTS = [
    "tests/test_redis_store.py",
    "tests/test_redis_sentinel.py",
    "tests/test_redis_cluster_outage.py",
    "tests/test_postgres_store.py",
    "tests/test_etcd_store.py",
    "tests/test_sqlite_store.py",
    "tests/test_fastapi.py",
    "tests/test_asgi.py",
    "tests/test_wsgi.py",
    "tests/test_flask.py",
    "tests/test_django.py",
    "tests/test_celery.py",
    "tests/test_rq.py",
    "tests/test_dramatiq.py",
    "tests/test_metrics.py",
    *ARQ_FILES,
]


#: What each extra is for, imported after `pip install 'idemlock[X]'` (`nox -s extras`):
#: a resolver can pick versions `pip check` accepts whose modules still fail to import
#: (kombu's Redis transport without its own dependencies did).
SMOKE: dict[str, tuple[str, ...]] = {
    "redis": ("redis.asyncio", "idemlock.stores.redis"),
    "hiredis": ("hiredis", "idemlock.stores.redis"),
    "postgres": ("psycopg", "psycopg_pool", "idemlock.stores.postgres"),
    "etcd": ("grpc", "idemlock.stores.etcd"),
    "sqlalchemy": ("sqlalchemy",),
    "seal": ("cryptography.hazmat.primitives.ciphers.aead",),
    "pydantic": ("pydantic",),
    "msgspec": ("msgspec",),
    "celery": ("idemlock.integrations.celery", "kombu.transport.redis"),
    "rq": ("idemlock.integrations.rq",),
    "arq": ("idemlock.integrations.arq",),
    "dramatiq": ("idemlock.integrations.dramatiq", "dramatiq.brokers.redis"),
    "prometheus": ("idemlock.integrations.prometheus",),
    "otel": ("idemlock.integrations.otel",),
    "django": ("idemlock.integrations.django",),
}


#: Extras a user would combine (a web framework, a queue, a store), with the framework's
#: own package: `nox -s extras` checks that each resolves to the versions its members get
#: alone, i.e. installs together with current versions.
COMBOS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "FastAPI + Celery + Redis": (("celery", "redis"), ("fastapi",)),
    "FastAPI + arq + Redis": (("arq", "redis"), ("fastapi",)),
    "FastAPI + Dramatiq + etcd": (("dramatiq", "etcd"), ("fastapi",)),
    "Starlette + arq + PostgreSQL": (("arq", "postgres"), ("starlette",)),
    "Django + RQ + PostgreSQL": (("django", "postgres", "rq"), ("djangorestframework",)),
    "Django + Celery + PostgreSQL": (("celery", "django", "postgres"), ()),
    "Flask + Dramatiq + Redis": (("dramatiq", "redis"), ("flask",)),
    "Flask + RQ + Redis, sealed, with metrics": (
        ("otel", "prometheus", "redis", "rq", "seal"),
        ("flask",),
    ),
    "Celery + arq": (("arq", "celery"), ()),
}

#: Extras that cannot both have their current versions in one environment, and why. The
#: README says so (tests/test_matrix.py), and `nox -s extras` fails once it is no longer
#: true, so the sentence goes when the conflict does.
KNOWN_CONFLICTS: dict[tuple[str, ...], str] = {
    ("arq", "celery"): (
        "every arq release pins redis-py<6 and Celery 5.7's kombu needs redis-py>=6.4: "
        "together, pip holds Celery and kombu back to 5.6 (with redis-py 5)"
    ),
}


def held_back(
    combo: dict[str, str], singles: list[dict[str, str]], names: list[str]
) -> dict[str, tuple[str, str]]:
    """The packages of ``names`` a combination resolves below the lowest version any of
    its members gets alone: ``{name: (in the combination, alone)}``."""
    out = {}
    for name in names:
        alone = [s[name] for s in singles if name in s]
        if name in combo and alone:
            best = min(alone, key=_release)
            if _release(combo[name]) < _release(best):
                out[name] = (combo[name], best)
    return out


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
