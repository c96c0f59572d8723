"""The dependency matrix (noxfile.py, its data in tools/matrix.py) stays in step with
pyproject.toml, the README's test command and .ci/run: every extra has a session or says
where it is tested, every test file runs in some session, and no install step hides a
conflict with ``--no-deps``. No network: this reads files and collects tests."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _matrix() -> ModuleType:
    spec = importlib.util.spec_from_file_location("matrix", ROOT / "tools" / "matrix.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


M = _matrix()
CI_RUN = (ROOT / ".ci" / "run").read_text()


def readme_test_command() -> str:
    """The Quick start's second command: the one that runs the tests."""
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```sh\n(.*?)```", quick, re.DOTALL)
    assert len(blocks) >= 2, "the Quick start lost its test command"
    return blocks[1].strip()


def test_every_extra_has_a_session_or_says_where_it_is_tested() -> None:
    sessions, covered = set(M.EXTRA_SESSIONS), set(M.COVERED_BY)
    assert not sessions & covered, "an extra both has a session and is said to be covered"
    extras = set(M.EXTRAS)
    assert sessions | covered == extras, (
        f"extras with neither: {sorted(extras - sessions - covered)}; "
        f"named but not extras of pyproject.toml: {sorted((sessions | covered) - extras)}"
    )


def test_readme_test_command_is_what_ci_runs_and_hides_no_conflict() -> None:
    command = readme_test_command()
    assert "--no-deps" not in command
    assert "nox -s tests" in command  # the newest session: the whole suite
    # as written, alone on its line or as the one command the watchdog runs
    ci_lines = [line.strip() for line in CI_RUN.splitlines()]
    guarded = [f'guarded {n} bash -c "{command}"' for n in range(1, 5400)]
    assert command in ci_lines or any(line in guarded for line in ci_lines), (
        ".ci/run must run the README's test command as written"
    )
    assert "--no-deps" not in CI_RUN


def test_ci_runs_every_session() -> None:
    for name in ["tests", "lowest", "extras", *(f"extra-{x}" for x in M.EXTRA_SESSIONS)]:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", CI_RUN), name


def test_the_newest_environment_cannot_hold_arq_so_arq_tests_run_elsewhere() -> None:
    test_names = {M.name_of(r) for r in M.EXTRAS["test"]}
    assert "arq" not in test_names  # arq's redis<6 pin would hold Celery back
    for path in M.ARQ_FILES:
        assert f"--ignore={path}" in M.NEWEST_ARGS
        assert path in M.EXTRA_SESSIONS["arq"]["tests"]
    assert M.NEWEST_ARGS[-2:] == ["-m", f"not {M.ARQ_MARKER}"]
    assert M.EXTRA_SESSIONS["arq"]["examples"][-2:] == ["-m", M.ARQ_MARKER]
    markers = M.PYPROJECT["tool"]["pytest"]["ini_options"]["markers"]
    assert any(m.startswith(f"{M.ARQ_MARKER}:") for m in markers)


IMPORTS_ARQ = re.compile(
    r"^\s*(?:from|import)\s+(?:arq|idemlock\.integrations\.arq)\b", re.MULTILINE
)


def test_only_the_arq_files_import_arq() -> None:
    """A module the newest session collects must not import arq: collecting it would fail."""
    helpers = {p.stem for p in (ROOT / "tests").rglob("*.py") if IMPORTS_ARQ.search(p.read_text())}
    arq_files = {str(ROOT / f) for f in M.ARQ_FILES}
    for path in (ROOT / "tests").rglob("test_*.py"):
        if str(path) in arq_files:
            continue
        text = path.read_text()
        assert not IMPORTS_ARQ.search(text), f"{path} imports arq: add it to ARQ_FILES"
        for helper in helpers:
            assert not re.search(rf"\bimport\b.*\b{helper}\b|\b{helper}\b.*\bimport\b", text), (
                f"{path} imports {helper}, which imports arq"
            )


def test_a_contract_left_to_another_session_is_run_there() -> None:
    for extra, spec in M.EXTRA_SESSIONS.items():
        for other in spec.get("contract_unless_client_of", []):
            assert "contract" in M.EXTRA_SESSIONS[other], (extra, other)
            assert "contract_unless_client_of" not in M.EXTRA_SESSIONS[other], (extra, other)


def _selected_paths(args: list[str]) -> set[str]:
    return {a for a in args if a.startswith("tests/")}


def test_every_file_a_session_names_exists() -> None:
    named = set(M.ARQ_FILES) | _selected_paths(M.LOWEST_CONTRACT) | set(M.LOWEST_TESTS)
    for spec in M.EXTRA_SESSIONS.values():
        for args in spec.values():
            named |= _selected_paths(args)
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, missing


def test_every_runtime_requirement_has_a_floor_for_the_lowest_session() -> None:
    for req in M.PYPROJECT["project"]["dependencies"]:
        assert ">=" in req, f"{req!r}: no lower bound for `nox -s lowest` to test"
    for extra in M.runtime_extras():
        for req in M.EXTRAS[extra]:
            assert ">=" in req, f"[{extra}] {req!r}: no lower bound for `nox -s lowest` to test"
    for req in M.from_test(*M.LOWEST_FROM_TEST, *M.TEST_TOOLS):
        assert ">=" in req, f"[test] {req!r}: no lower bound"


def test_floor_helpers() -> None:
    assert M.name_of("redis[hiredis]>=5") == "redis"
    assert M.name_of("Prometheus_Client>=0.17") == "prometheus-client"
    assert M.floors(["redis>=5", "redis[hiredis]>=5.0.1", "grpcio>=1.51,<2", "x"]) == {
        "redis": "5.0.1",
        "grpcio": "1.51",
    }
    assert M.in_floor_series("5", "5.0.1")
    assert M.in_floor_series("3.1", "3.1.0")
    assert M.in_floor_series("0.26.1", "0.26.1")
    assert M.in_floor_series("2", "2.0.2")
    assert not M.in_floor_series("5", "5.3.1")
    assert not M.in_floor_series("3.1", "3.2.0")
    assert not M.in_floor_series("1.51", "1.85.3")
    with pytest.raises(ValueError, match="not in the \\[test\\] extra"):
        M.from_test("no-such-package")


def test_known_conflicts_name_extras_and_are_documented() -> None:
    # Where a user choosing extras reads: the README's quick start and the integrations page.
    readme = (ROOT / "README.md").read_text() + (ROOT / "docs" / "integrations.md").read_text()
    for extras, why in M.KNOWN_CONFLICTS.items():
        assert set(extras) <= set(M.EXTRAS), extras
        assert why
        pair = " and ".join(f"`idemlock[{x}]`" for x in extras)
        assert pair in readme, f"the README or docs/integrations.md must say {pair}: not both"
    for combo, (extras, _packages) in M.COMBOS.items():
        assert set(extras) <= set(M.EXTRAS), combo


def _collect(*args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "no:xdist", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    return [line for line in out.stdout.splitlines() if "::" in line]


def test_the_newest_session_deselects_arq_examples_and_extra_arq_runs_them() -> None:
    from . import test_docs_examples as D

    arq_ids = {b.id for b in D.RUNNABLE if D.IMPORTS_ARQ.search(D.program(b))}
    assert arq_ids, "no documented arq example found: is the recipe gone?"
    marked = {b.id for b in D.RUNNABLE if any(m.name == M.ARQ_MARKER for m in D._marks(b))}
    assert marked == arq_ids  # what extra-arq's `-m arq` selects
    newest = _collect(*M.NEWEST_ARGS, "tests/test_docs_examples.py")
    ran = {re.sub(r"^.*\[(.*)\]$", r"\1", i) for i in newest if "test_example_runs[" in i}
    assert not ran & arq_ids, "an arq example in the newest session"
    assert ran | arq_ids == {b.id for b in D.RUNNABLE}, "an example runs in neither session"
