"""fencekit's canonical JSON and idempotency keys.

The output is byte-for-byte what fencekit produced (sorted keys, compact separators,
ASCII only, no NaN), so keys computed before the migration still name the same job.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence

from .errors import CanonicalizeError

__all__ = ["canonicalize", "dumps_json", "idempotency_key", "loads_json"]


def _plain(value: object) -> object:
    """``value`` as dicts, lists and scalars, or CanonicalizeError naming the culprit."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        raise CanonicalizeError(
            f"{value!r} has no JSON form; idempotency data must use finite floats"
        )
    if isinstance(value, Mapping):
        out: dict[str, object] = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise CanonicalizeError(f"mapping keys must be str, got {type(k).__name__} {k!r}")
            out[k] = _plain(v)
        return out
    if isinstance(value, Sequence) and not isinstance(value, (bytes, bytearray)):
        return [_plain(v) for v in value]
    raise CanonicalizeError(
        f"cannot canonicalize a {type(value).__name__}; pass JSON data (for example "
        "a datetime as an ISO string)"
    )


def dumps_json(value: object) -> str:
    """The canonical JSON text of any JSON value (also used for recorded results)."""
    plain = _plain(value)
    try:
        return json.dumps(
            plain, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        )
    except (TypeError, ValueError, RecursionError) as exc:
        raise CanonicalizeError(f"cannot encode as JSON: {exc}") from exc


def loads_json(text: str) -> object:
    """Parse JSON text written by :func:`dumps_json`."""
    try:
        return json.loads(text)
    except (TypeError, ValueError) as exc:
        raise CanonicalizeError(f"not JSON text: {exc}") from exc


def canonicalize(payload: Mapping[str, object]) -> str:
    """The canonical JSON text of a mapping payload."""
    if not isinstance(payload, Mapping):
        raise CanonicalizeError(f"a payload must be a mapping, got {type(payload).__name__}")
    return dumps_json(dict(payload))


def idempotency_key(payload: Mapping[str, object], *, namespace: str) -> str:
    """``<namespace>:<sha256 of the canonical payload>``."""
    if not isinstance(namespace, str) or not namespace:
        raise CanonicalizeError("namespace must be a non-empty str")
    if ":" in namespace or any(ch.isspace() for ch in namespace):
        raise CanonicalizeError(f"namespace must not contain ':' or whitespace: {namespace!r}")
    digest = hashlib.sha256(canonicalize(payload).encode("utf-8")).hexdigest()
    return namespace + ":" + digest
