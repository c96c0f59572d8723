"""Result encoding. JSON by default, never pickle: stored bytes are data, not code.

Stored form: one format byte, then the body. ``j`` = UTF-8 JSON of ``{"v": value}``
(wrapping keeps a bare ``null`` distinct from a missing result).
"""

from __future__ import annotations

import json
from typing import Any, Protocol


class Codec(Protocol):
    def encode(self, value: Any) -> bytes: ...

    def decode(self, data: bytes) -> Any: ...


class JsonCodec:
    """JSON results: dict, list, str, int, float, bool and None (tuples come back as lists)."""

    def encode(self, value: Any) -> bytes:
        from .._errors import ResultEncodeError

        try:
            body = json.dumps(
                {"v": value}, ensure_ascii=False, allow_nan=False, separators=(",", ":")
            )
        except (TypeError, ValueError) as exc:
            raise ResultEncodeError(
                f"the result ({type(value).__name__}) cannot be stored as JSON: {exc}; "
                "return JSON-like data (dict, list, str, int, float, bool, None) or "
                "convert it before returning; nothing was recorded"
            ) from None
        return b"j" + body.encode("utf-8")

    def decode(self, data: bytes) -> Any:
        from .._errors import ResultDecodeError

        if not data[:1] == b"j":
            raise ResultDecodeError(
                f"stored result has an unknown format marker {bytes(data[:1])!r}; it was "
                "written by another program or version, or is corrupt: forget the key"
            )
        try:
            obj = json.loads(bytes(data[1:]).decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as exc:
            raise ResultDecodeError(
                f"stored result is not valid JSON ({exc}); it is corrupt: forget the key"
            ) from None
        if not isinstance(obj, dict) or set(obj) != {"v"}:
            raise ResultDecodeError("stored result is not an idemlock JSON record")
        return obj["v"]


JSON_CODEC = JsonCodec()
