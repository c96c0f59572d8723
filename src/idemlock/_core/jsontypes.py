"""The type of the JSON-like values users pass as payloads and results."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeAlias, Union

__all__ = ["JSONValue"]

#: A JSON-like value: what a payload or a recorded result may be. ``None``, ``bool``,
#: ``int``, ``float``, ``str``, sequences (lists, tuples) of JSON values and mappings
#: with ``str`` keys of JSON values. A ``dict[str, Any]`` (from ``json.loads`` or a
#: framework's parsed body) fits; dates, decimals, bytes, sets and objects do not:
#: convert them first. NaN and Infinity fit the type but are refused at run time
#: (:class:`~idemlock.CanonicalizeError`, :class:`~idemlock.ResultEncodeError`).
JSONValue: TypeAlias = Union[  # noqa: UP007  (a recursive alias needs the Union form)
    bool, int, float, str, Sequence["JSONValue"], Mapping[str, "JSONValue"], None
]
