"""Canonical JSON of payloads and their SHA-256 fingerprint."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import CanonicalizeError
from .jsonfast import dumps_canonical
from .jsontypes import JSONValue


def _check(value: Any, path: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)  # int subclasses (IntEnum) become plain ints
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise CanonicalizeError(
                f"payload{path} is {value!r}; NaN and Infinity have no JSON form, "
                "replace them with null or a string"
            )
        return float(value)
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise CanonicalizeError(
                    f"payload{path} has a key {k!r} of type {type(k).__name__}; "
                    "JSON object keys must be str"
                )
            out[k] = _check(v, f"{path}[{k!r}]")
        return out
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray, memoryview)):
        return [_check(v, f"{path}[{i}]") for i, v in enumerate(value)]
    raise CanonicalizeError(
        f"payload{path} is a {type(value).__name__}, which is not JSON-like; "
        "pass only dict, list, tuple, str, int, float, bool and None "
        "(convert dates, decimals, bytes and objects to strings first)"
    )


def _plain(value: Any) -> bool:
    """Whether ``value`` is built only of exact JSON types with str keys: then it can be
    encoded as it is. Anything else takes the slow path, which normalizes subclasses
    (mappings, sequences, IntEnum) or names what is wrong."""
    t = type(value)
    if t is str or t is int or t is bool or value is None:
        return True
    if t is float:
        return math.isfinite(value)
    if t is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    if t is list or t is tuple:
        return all(_plain(v) for v in value)
    return False


def canonicalize(payload: JSONValue) -> bytes:
    """Return the canonical JSON bytes of a JSON-like payload.

    Keys sorted, compact separators, UTF-8, tuples as lists. NaN, Infinity and
    non-JSON types raise :class:`~idemlock.CanonicalizeError`.
    """
    try:
        if not _plain(payload):
            payload = _check(payload, "")
        return dumps_canonical(payload).encode("utf-8")
    except RecursionError:
        raise CanonicalizeError("payload is nested too deeply (or contains itself)") from None
    except UnicodeEncodeError as exc:
        bad = exc.object[exc.start : exc.end]
        raise CanonicalizeError(
            f"payload contains a lone surrogate ({bad!r}), which UTF-8 cannot hold; "
            "pass valid Unicode (decode bytes with errors='replace' or keep them as base64)"
        ) from None
    except ValueError as exc:
        # An int of thousands of digits: Python refuses to write it as text.
        raise CanonicalizeError(
            f"payload holds an int too large to write as JSON ({exc}); pass it as a string"
        ) from None


def fingerprint(payload: JSONValue) -> str:
    """SHA-256 (hex) of :func:`canonicalize` of ``payload``."""
    import hashlib  # here: loading OpenSSL's hashes is a good part of `import idemlock`

    return hashlib.sha256(canonicalize(payload)).hexdigest()
