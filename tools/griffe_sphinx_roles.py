"""A griffe extension for the docs site (mkdocs.yml): idemlock's docstrings use Sphinx
roles (``:class:`Coordinator```, ``:func:`idemlock.aio.connect```), which Markdown would
show as raw text. Each role becomes inline code; ``~`` (Sphinx's "last part only") keeps
the last dotted part."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|attr|exc|data|obj|const):`~?([^`]+)`")


def _plain(match: re.Match[str]) -> str:
    target = match.group(1)
    if match.group(0).split("`", 1)[1].startswith("~"):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_plain, obj.docstring.value)
