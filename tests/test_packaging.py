"""Packaging: the version the package, the CLI and the installed metadata report agree;
LICENSE, CHANGELOG and the project URLs exist; extras name their broker clients."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import metadata, version
from pathlib import Path

import tomllib

import idemlock

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_comes_from_the_installed_metadata() -> None:
    assert idemlock.__version__ == version("idemlock") == PYPROJECT["project"]["version"]


def test_cli_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "idemlock", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == f"idemlock {idemlock.__version__}"


def test_license_and_changelog() -> None:
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("MIT License")
    assert "Copyright (c) 2026 the idemlock authors" in text
    changelog = (ROOT / "CHANGELOG.md").read_text()
    assert "## Unreleased" in changelog
    assert f"## {idemlock.__version__}" in changelog


def test_license_is_an_spdx_expression_setuptools_builds_without_warning() -> None:
    # A TOML table ({text = "MIT"}) makes setuptools >= 77 print a deprecation warning on
    # every install; the SPDX string needs setuptools >= 77 to build.
    project = PYPROJECT["project"]
    assert project["license"] == "MIT"
    assert project["license-files"] == ["LICENSE"]
    assert "setuptools>=77" in PYPROJECT["build-system"]["requires"]
    # PEP 639: a license expression and a "License ::" classifier are exclusive.
    assert not [c for c in project["classifiers"] if c.startswith("License ::")]


def test_python_classifiers_match_requires_python() -> None:
    project = PYPROJECT["project"]
    assert project["requires-python"] == ">=3.10"
    versions = [
        c.rsplit(" :: ", 1)[1]
        for c in project["classifiers"]
        if c.startswith("Programming Language :: Python :: 3.")
    ]
    assert versions == ["3.10", "3.11", "3.12", "3.13"]
    assert f"{sys.version_info[0]}.{sys.version_info[1]}" in versions


def test_project_urls_in_the_metadata() -> None:
    urls = metadata("idemlock").get_all("Project-URL") or []
    names = {u.split(",", 1)[0].strip() for u in urls}
    assert {"Homepage", "Source", "Issues", "Changelog"} <= names


def test_description_names_every_store_the_readme_lists() -> None:
    # The one line PyPI and `pip show` print: every store of the README's table, no fewer.
    readme = (ROOT / "README.md").read_text()
    table = readme.split("## Stores", 1)[1].split("\n## ", 1)[0]
    description = PYPROJECT["project"]["description"]
    for store in ("SQLite", "memory", "Redis", "PostgreSQL", "etcd"):
        assert store in table, f"README's store table no longer lists {store}"
        assert store in description, f"pyproject's description does not name {store}"


def test_queue_extras_pull_in_their_broker_clients() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert any(d.startswith("celery[redis]") for d in extras["celery"])
    assert any(d.startswith("redis") for d in extras["rq"])
    assert any(d.startswith("dramatiq[redis]") for d in extras["dramatiq"])
    assert any(d.startswith("arq") for d in extras["arq"])  # arq depends on redis itself


def test_pytest_plugin_entry_point() -> None:
    assert PYPROJECT["project"]["entry-points"]["pytest11"] == {
        "idemlock": "idemlock.pytest_plugin"
    }


# Each queue extra alone in a fresh virtualenv, reaching a real Redis broker through its
# integration's documented use: the nox sessions extra-celery, extra-rq, extra-dramatiq and
# extra-arq (`pip install 'idemlock[X]'` alone, pip check, then the integration's tests
# with real workers), and `nox -s extras` imports each extra's modules (kombu's Redis
# transport once failed to import under a `pip check` that passed).
