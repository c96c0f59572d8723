"""How the Idempotency-Key middleware records a response and replays it.

A record is JSON data, never pickled: ``{"v": 1, "status": ..., "headers": [[name,
value], ...], "body": base64}`` with header bytes as latin-1 strings, or ``{"v": 1,
"status": ..., "replayable": false}`` for a response too large to keep. A replay
carries the recorded status, headers (hop-by-hop headers dropped, Content-Length set to
the body) and body, plus the replay marker header.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from typing import Any

from .problem_json import Answer

__all__ = [
    "RETRYABLE_4XX",
    "ResponseCopy",
    "default_record",
    "parse_record",
    "record_of",
    "replay_answer",
    "unreplayable_record",
]

#: statuses that mean "try again later or differently": never recorded by default
RETRYABLE_4XX = frozenset({401, 403, 408, 409, 423, 425, 429})
#: connection-level headers that must not be replayed on another connection
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
RECORD_VERSION = 1


def default_record(status: int) -> bool:
    """Record 2xx, 3xx and 4xx except 401, 403, 408, 409, 423, 425 and 429."""
    return 200 <= status < 500 and status not in RETRYABLE_4XX


class ResponseCopy:
    """The copy of a response body kept while it totals at most ``limit`` bytes; the
    bytes themselves are forwarded by the adapter, never delayed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.size = 0
        self.chunks: list[bytes] | None = []  # None: over the limit, no longer copied

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.chunks is not None:
            if self.size > self.limit:
                self.chunks = None
            else:
                self.chunks.append(chunk)

    def prepend(self, chunks: Iterable[bytes]) -> None:
        """Bytes that went out before the others (WSGI's legacy ``write``)."""
        early = list(chunks)
        self.size += sum(map(len, early))
        if self.chunks is not None:
            self.chunks[:0] = early
            if self.size > self.limit:
                self.chunks = None


def record_of(
    status: int, headers: Iterable[tuple[bytes, bytes]], chunks: list[bytes] | None
) -> dict[str, Any]:
    """The record of a response (``chunks`` None: over the limit, not replayable)."""
    if chunks is None:
        return unreplayable_record(status)
    return {
        "v": RECORD_VERSION,
        "status": status,
        "headers": [
            [k.decode("latin-1"), v.decode("latin-1")]
            for k, v in headers
            if k.lower() not in HOP_BY_HOP
        ],
        "body": base64.b64encode(b"".join(chunks)).decode("ascii"),
    }


def unreplayable_record(status: int) -> dict[str, Any]:
    return {"v": RECORD_VERSION, "status": status, "replayable": False}


def parse_record(
    rec: Any,
) -> tuple[int, list[tuple[bytes, bytes]], bytes | None] | None:
    """(status, headers, body or None when not replayable), or None if ``rec`` is not a
    response this middleware recorded."""
    if not isinstance(rec, dict) or rec.get("v") != RECORD_VERSION:
        return None
    status = rec.get("status")
    if isinstance(status, bool) or not isinstance(status, int) or not 200 <= status <= 599:
        return None
    if rec.get("replayable") is False:
        return status, [], None
    raw_headers, raw_body = rec.get("headers"), rec.get("body")
    if not isinstance(raw_headers, list) or not isinstance(raw_body, str):
        return None
    headers: list[tuple[bytes, bytes]] = []
    try:
        for pair in raw_headers:
            name, value = pair
            headers.append((name.encode("latin-1"), value.encode("latin-1")))
        body = base64.b64decode(raw_body, validate=True)
    except (TypeError, ValueError, AttributeError):
        return None
    return status, headers, body


def _has_body(status: int) -> bool:
    return status >= 200 and status not in (204, 304)


def replay_answer(
    status: int,
    headers: list[tuple[bytes, bytes]],
    body: bytes,
    marker: tuple[bytes, bytes] | None,
) -> Answer:
    """The replay of a parsed record, with one Content-Length that fits its body."""
    out: list[tuple[bytes, bytes]] = []
    length = str(len(body)).encode("ascii")
    has_length = False
    for name, value in headers:
        if name.lower() == b"content-length":
            if has_length or not _has_body(status):
                continue
            value, has_length = length, True
        out.append((name, value))
    if not has_length and _has_body(status):
        out.append((b"content-length", length))
    if marker is not None:
        out.append(marker)
    return Answer(status, out, body)
