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


def test_project_urls_in_the_metadata() -> None:
    urls = metadata("idemlock").get_all("Project-URL") or []
    names = {u.split(",", 1)[0].strip() for u in urls}
    assert {"Homepage", "Source", "Issues", "Changelog"} <= names


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
