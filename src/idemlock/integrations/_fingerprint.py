"""What makes two requests with one Idempotency-Key "the same request".

The default fingerprint is the method, the path, the raw query string, the values of
``fingerprint_headers`` and the body. A JSON body (``application/json`` or any
``+json`` type) counts by its *meaning*: it is parsed and written again canonically
(sorted keys, no whitespace), so the same document with other spacing or key order is
the same request. Any other body, or JSON that does not parse, counts by its bytes.

``fingerprint=`` replaces the query, headers and body part with your own function of a
:class:`RequestView` (for example :func:`json_fields`, which keeps chosen fields of a
JSON body). The method and the path always count, so a key reused on another route is
always refused. Only SHA-256 digests reach the store.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .._errors import ConfigurationError

__all__ = ["Fingerprint", "RequestView", "fingerprint_of", "json_fields"]

_ABSENT: Any = object()


@dataclass(frozen=True)
class RequestView:
    """The parts of a keyed request a fingerprint function may look at."""

    method: str
    path: str
    query: str
    #: every request header, lowercase name and value, in request order
    headers: Sequence[tuple[str, str]]
    body: bytes

    @property
    def content_type(self) -> str:
        for name, value in self.headers:
            if name == "content-type":
                return value.split(";", 1)[0].strip().lower()
        return ""

    def is_json(self) -> bool:
        ctype = self.content_type
        return ctype == "application/json" or (
            ctype.startswith("application/") and ctype.endswith("+json")
        )

    def json(self) -> Any:
        """The body as JSON if it is declared and parses as JSON, else a marker no JSON
        value equals (see :func:`json_fields`)."""
        if not self.is_json():
            return _ABSENT
        try:
            return json.loads(self.body)
        except (ValueError, UnicodeDecodeError):
            return _ABSENT


#: a fingerprint function: any JSON-serialisable value standing for the request
Fingerprint = Callable[[RequestView], Any]


def _digest(value: Any) -> str:
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"the fingerprint function must return JSON data (dicts, lists, str, numbers), "
            f"got {type(value).__name__}: {exc}"
        ) from None
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _body_digest(req: RequestView) -> str:
    doc = req.json()
    if doc is _ABSENT:
        # The digest alone, as before JSON was read: such records stay comparable.
        return hashlib.sha256(req.body).hexdigest()
    return "json:" + _digest(doc)


def fingerprint_of(
    req: RequestView, header_names: frozenset[str], custom: Fingerprint | None
) -> dict[str, Any]:
    """The payload stored with a claim: a request with the same key and another
    fingerprint is refused."""
    fp: dict[str, Any] = {"method": req.method.upper(), "path": req.path}
    if custom is not None:
        fp["custom"] = _digest(custom(req))
        return fp
    headers = [[k, v] for k, v in req.headers if k in header_names]
    headers.sort(key=lambda kv: kv[0])  # stable: keeps repeated headers in order
    fp.update(query=req.query, headers=headers, body=_body_digest(req))
    return fp


def json_fields(*names: str) -> Fingerprint:
    """A fingerprint of the query string and the top-level fields ``names`` of a JSON
    body (a missing field counts as missing); a body that is not JSON counts by its
    bytes. Requests that differ only in other fields (a client timestamp, a trace id)
    are then the same request."""
    if not names or not all(isinstance(n, str) for n in names):
        raise ConfigurationError("json_fields needs one or more field names (str)")

    def fingerprint(req: RequestView) -> Any:
        doc = req.json()
        if not isinstance(doc, dict):
            return {"query": req.query, "body": _body_digest(req)}
        return {"query": req.query, "fields": {n: doc[n] for n in names if n in doc}}

    return fingerprint
