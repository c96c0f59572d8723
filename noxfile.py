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

import importlib.util
import json
import re
from pathlib import Path

import nox

_spec = importlib.util.spec_from_file_location("matrix", Path(__file__).parent / "tools/matrix.py")
assert _spec is not None and _spec.loader is not None
M = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(M)

nox.options.default_venv_backend = "uv|virtualenv"
nox.options.sessions = ["tests"]

PYTEST = ["python", "-m", "pytest", "-n", "2", "--dist", "loadgroup"]


def install(session: nox.Session, *args: str) -> None:
    # pip too: `pip check`, and the tests that build venvs or download with it
    session.install("pip", *args)
    pip_check(session)


def pip_check(session: nox.Session) -> None:
    """``pip check``: every installed distribution's requirements are met. Part of the
    install (so ``--install-only`` runs it, and ``-R``, which installs nothing, does not)."""
    session.run_install("python", "-m", "pip", "check")


def run_selection(session: nox.Session, *selections: list[str]) -> None:
    """One pytest run per selection; arguments after ``--`` replace them all."""
    for args in [session.posargs] if session.posargs else selections:
        session.run(*PYTEST, *args)


@nox.session
def check(session: nox.Session) -> None:
    """scripts/check (ruff, format, mypy --strict, generated files) in its own environment,
    so a fresh machine needs no linters of its own."""
    install(session, "-e", ".[test]")
    # mypy reads integrations/arq.py against arq's own types, and arq's redis<6 pin cannot
    # share [test]'s redis-py: this lint-only environment takes arq without its pin (after
    # pip check, which it would fail); no test runs here, users' installs are extra-arq's.
    session.install("--no-deps", "arq>=0.26.1")
    session.run("python", "scripts/check", *session.posargs)


@nox.session
def tests(session: nox.Session) -> None:
    """Newest versions: `.[test]`, the whole suite but arq's tests (see extra-arq)."""
    install(session, "-e", ".[test]")
    # the slowest tests, so that every run shows where the time goes (issue 23)
    session.run(*PYTEST, "--durations=25", *M.NEWEST_ARGS, *session.posargs)


@nox.session
def lowest(session: nox.Session) -> None:
    """Floors: every extra's and framework's lowest version, contract and integrations."""
    if session.venv_backend != "uv":
        session.install("uv")
    extras = M.runtime_extras()
    direct = [f".[{','.join(extras)}]", *M.from_test(*M.LOWEST_FROM_TEST)]
    # Floors for what idemlock and the frameworks declare; the newest for what they
    # depend on in turn (what a user pinning their own floors gets) and for the runner.
    session.run_install("uv", "pip", "install", "--resolution", "lowest-direct", "-e", *direct)
    # mypy too: the integrations' tests type-check users' programs against the floors
    install(session, *M.from_test(*M.TEST_TOOLS, "mypy"))
    check_floors(session, extras)
    run_selection(session, M.LOWEST_CONTRACT, M.LOWEST_TESTS)


def check_floors(session: nox.Session, extras: list[str]) -> None:
    """Fail unless every declared floor was installed from its own series."""
    core = M.PYPROJECT["project"]["dependencies"]
    declared = M.floors([*core, *(r for e in extras for r in M.EXTRAS[e])])
    declared.update(M.floors(M.from_test(*M.LOWEST_FROM_TEST)))
    code = (
        "import json, sys\n"
        "from importlib.metadata import version\n"
        "print(json.dumps({n: version(n) for n in sys.argv[1:]}))\n"
    )
    out = session.run("python", "-c", code, *declared, silent=True)
    installed = json.loads(str(out).strip().splitlines()[-1])
    wrong = []
    for name, floor in sorted(declared.items()):
        ok = M.in_floor_series(floor, installed[name])
        session.log(f"{name}: floor {floor}, installed {installed[name]}" + ("" if ok else " !"))
        if not ok:
            wrong.append(name)
    if wrong:
        session.error(
            f"{', '.join(wrong)}: installed above the declared floor's series; raise the "
            "floor in pyproject.toml to the lowest version that installs, and say why there"
        )


VERSIONS = (
    "import json, importlib.metadata as m\n"
    "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))\n"
)


@nox.session
def extras(session: nox.Session) -> None:
    """Each extra installs alone (uv) and the combinations users pick install together
    (pip, the resolver most users have): `pip check` passes, each extra's modules import,
    and a combination gets the versions its members get alone (tools/matrix.py: COMBOS)."""
    if session.venv_backend != "uv":
        session.install("uv")
    install(session)  # pip, for its resolver and its report
    tmp = Path(session.create_tmp())
    python = str(Path(session.bin) / "python")

    def fresh(name: str, *requirements: str, pip: bool) -> dict[str, str]:
        """A new venv with ``requirements``: checked, smoke-imported; its versions."""
        venv = tmp / name
        session.run("uv", "venv", "-q", "--python", python, str(venv))
        py = str(venv / "bin" / "python")
        # pip alone: `--seed` would add wheel, and with it `packaging`, hiding its absence
        session.run("uv", "pip", "install", "-q", "--python", py, "pip")
        if pip:
            session.run(py, "-m", "pip", "install", "-q", *requirements, external=True)
        else:
            session.run("uv", "pip", "install", "-q", "--python", py, *requirements)
        session.run(py, "-m", "pip", "check", external=True)
        extras = re.findall(r"\[(.*)\]", requirements[0])[0].split(",")
        modules = [m for e in extras for m in M.SMOKE.get(e, ())]
        session.run(py, "-c", f"import {', '.join(modules)}", external=True)
        out = session.run(py, "-c", VERSIONS, silent=True, external=True)
        versions = json.loads(str(out).strip().splitlines()[-1])
        return {M.name_of(n): v for n, v in versions.items()}

    alone = {e: fresh(f"alone-{e}", f".[{e}]", pip=False) for e in M.runtime_extras()}

    def resolve(package: str) -> dict[str, str]:
        """What ``pip install PACKAGE`` picks in an empty environment."""
        report = tmp / "report.json"
        session.run(
            "python", "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
            "--report", str(report), package,
        )  # fmt: skip
        picked = json.loads(report.read_text())["install"]
        return {M.name_of(i["metadata"]["name"]): i["metadata"]["version"] for i in picked}

    failures = []
    for n, (combo, (extras, packages)) in enumerate(M.COMBOS.items()):
        names = sorted({M.name_of(r) for e in extras for r in M.EXTRAS[e]} | set(packages))
        together = fresh(f"combo-{n}", f".[{','.join(extras)}]", *packages, pip=True)
        singles = [alone[e] for e in extras] + [resolve(p) for p in packages]
        back = M.held_back(together, singles, names)
        known = [why for pair, why in M.KNOWN_CONFLICTS.items() if set(pair) <= set(extras)]
        session.log(f"{combo}: " + (f"held back {back}" if back else "current versions"))
        if bool(back) != bool(known):
            failures.append(
                f"{combo}: held back {back} with no KNOWN_CONFLICTS entry saying why"
                if back
                else f"{combo}: installs current versions now; drop its KNOWN_CONFLICTS "
                "entry and the README's sentence"
            )
    if failures:
        session.error("; ".join(failures))


def _extra_session(extra: str, spec: dict[str, list[str]]) -> None:
    def run(session: nox.Session) -> None:
        pip_install_extra = f".[{','.join([extra, *M.CONTRACT_EXTRAS])}]"
        tools = (*M.TEST_TOOLS, *spec.get("tools", []))
        install(session, "-e", pip_install_extra, *M.from_test(*tools))
        selections = [spec[k] for k in ("contract", "tests", "examples") if k in spec]
        other = spec.get("contract_unless_client_of", [None])[0]
        if other and not session.posargs and same_client(session, other):
            session.log(f"the store's client is extra-{other}'s, which runs its contract")
            selections = selections[1:]
        run_selection(session, *selections)

    run.__doc__ = f"`pip install 'idemlock[{extra}]'` alone: its tests and its store's contract."
    nox.session(name=f"extra-{extra}")(run)


def same_client(session: nox.Session, other: str) -> bool:
    """Whether this session has the versions of the store client (the requirements of
    extra ``other``, and hiredis) that ``pip install 'idemlock[other]'`` gets."""
    names = sorted({M.name_of(r) for r in M.EXTRAS[other]} | {"hiredis"})
    report = Path(session.create_tmp()) / "report.json"
    session.run(
        "python", "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed",
        "--report", str(report), f".[{other}]",
    )  # fmt: skip
    picked = json.loads(report.read_text())["install"]
    theirs = {M.name_of(i["metadata"]["name"]): i["metadata"]["version"] for i in picked}
    out = session.run("python", "-c", VERSIONS, silent=True)
    mine = {M.name_of(n): v for n, v in json.loads(str(out).strip().splitlines()[-1]).items()}
    session.log(
        f"{names}: here {[mine.get(n) for n in names]}, [{other}] {[theirs.get(n) for n in names]}"
    )
    return all(mine.get(n) == theirs.get(n) for n in names)


for _extra, _spec in M.EXTRA_SESSIONS.items():
    _extra_session(_extra, _spec)
