"""The documentation site builds with ``mkdocs build --strict`` (mkdocs-material, API
reference by mkdocstrings), and a broken link makes that build fail."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # material's banner, not a warning
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_site_builds_strictly(tmp_path: Path) -> None:
    out = _build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert out.returncode == 0, out.stdout + out.stderr
    site = tmp_path / "site"
    pages = ["index", "guarantees", "threat-model", "operations", "states", "recipes/celery"]
    # The README's reference sections live on these pages (issue 27).
    pages += ["idempotency", "locks", "stores", "integrations", "cli", "errors"]
    pages += ["fault-injection", "performance", "architecture"]
    for page in [f"{p}/index.html" if p != "index" else "index.html" for p in pages]:
        assert (site / page).is_file(), page
    # The API reference is generated from the docstrings, not written by hand.
    reference = (site / "reference" / "index.html").read_text(encoding="utf-8")
    for name in ("idemlock.connect", "idemlock.IdempotencyPort.claim", "idemlock.LockPort.hold"):
        assert f'id="{name}"' in reference, name
    # Sphinx roles in the docstrings are shown as code (tools/griffe_sphinx_roles.py).
    assert ":class:" not in reference and ":func:" not in reference
    # Long lines in code blocks wrap instead of overflowing the page (docs/stylesheets).
    assert 'href="../stylesheets/extra.css"' in reference
    css = (site / "stylesheets" / "extra.css").read_text(encoding="utf-8")
    assert re.search(r"pre > code \{[^}]*white-space: pre-wrap", css)
    # Each object is documented once, whichever modules re-export it.
    assert _documented_twice(reference) == []


def _documented_twice(reference: str) -> list[list[str]]:
    """The reference's entries of module-level objects that are one object."""
    import importlib

    by_object: dict[int, list[str]] = {}
    for path in re.findall(r'<h[2-6] id="([^"]+)" class="doc doc-heading"', reference):
        parent, _, name = path.rpartition(".")
        try:
            module = importlib.import_module(parent)
        except ImportError:
            continue  # a member of a class: one entry per class is right
        obj = getattr(module, name, None)
        if isinstance(obj, type) or callable(obj):
            by_object.setdefault(id(obj), []).append(path)
    return [paths for paths in by_object.values() if len(paths) > 1]


def test_a_broken_link_fails_the_strict_build(tmp_path: Path) -> None:
    # A copy of the site's sources with one bad link: the strict build must refuse it.
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    (tmp_path / "src").symlink_to(ROOT / "src")
    # The generated reference is the slow part of a build and has no bearing on links.
    (tmp_path / "docs" / "reference.md").write_text("# API reference\n")
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text() + "\nSee [the missing page](no-such-page.md).\n")
    out = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert out.returncode != 0
    assert "no-such-page.md" in out.stdout + out.stderr


#: issue 27: the README is what a person reads in three minutes; the manual is the site.
README_MAX_LINES = 300


def test_the_readme_stays_a_three_minute_read() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move the detail to "
        "a page under docs/ and link it"
    )
