"""The type of the JSON-like values users pass as payloads and results."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias, Union

__all__ = ["JSONValue"]

JSONValue: TypeAlias = Union[  # noqa: UP007  (a recursive alias needs the Union form)
    bool, int, float, str, Sequence["JSONValue"], Mapping[str, "JSONValue"], None
]
"""A JSON-like value: what a payload or a result to record may be.

``None``, ``bool``, ``int``, ``float``, ``str``, sequences (lists, tuples) of JSON values
and mappings with ``str`` keys of JSON values. A ``dict[str, Any]`` (from ``json.loads``
or a framework's parsed body) fits; dates, decimals, sets and objects do not: convert
them first. A few values fit the type but not JSON, and are refused at run time
(:class:`~idemlock.CanonicalizeError` for a payload,
:class:`~idemlock.ResultEncodeError` for a result): NaN and Infinity, and ``bytes``
(a sequence of ints to a type checker).

What idemlock gives back (``Completed.result``, ``Attempt.result`` on a replay) is typed
``Any``, as ``json.loads`` is: the decoded JSON of what was recorded, to index without
narrowing a union first."""
