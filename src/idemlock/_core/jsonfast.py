"""Compact and canonical JSON without the per-call setup of ``json.dumps``.

``json.dumps`` (and ``JSONEncoder.encode``) build a new C encoder on every call; on the
hot path (a fingerprint per claim, an encode per complete) that setup costs more than
the encoding of a small value. The encoders here are built once.
"""

from __future__ import annotations

import json
import json.encoder as _enc
from collections.abc import Callable
from typing import Any


def _default(value: Any) -> Any:
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _make(sort_keys: bool) -> Callable[[Any], str]:
    c_make = getattr(_enc, "c_make_encoder", None)
    if c_make is None:  # pragma: no cover - interpreters without the C accelerator
        encoder = json.JSONEncoder(
            ensure_ascii=False, allow_nan=False, separators=(",", ":"), sort_keys=sort_keys
        )
        return encoder.encode
    # (markers, default, encoder, indent, key_separator, item_separator, sort_keys,
    #  skipkeys, allow_nan): markers=None skips the cycle check; a cycle ends in
    #  RecursionError, which callers treat like any other unencodable value.
    c_encode = c_make(
        None, _default, _enc.encode_basestring, None, ":", ",", sort_keys, False, False
    )

    def encode(value: Any) -> str:
        return "".join(c_encode(value, 0))

    return encode


#: compact JSON, keys in insertion order, NaN/Infinity refused, non-ASCII kept
dumps_compact = _make(sort_keys=False)
#: compact JSON with sorted keys: the canonical form of payloads
dumps_canonical = _make(sort_keys=True)
#: JSON text to Python values
loads = json.JSONDecoder().decode
