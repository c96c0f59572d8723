"""What makes two requests with one Idempotency-Key "the same request".

The default fingerprint is the method, the path, the raw query string, the values of
``fingerprint_headers`` and the body. A JSON body (``application/json`` or any
``+json`` type) counts by its *meaning*: it is parsed and written again in its RFC 8785
(JCS) form (:mod:`.jcs`: sorted members, no whitespace, numbers as numbers), so the
same document with other spacing, member order or number spelling (``1200`` and
``1200.0``) is the same request, and any language's JCS library computes the same
digest: ``jcs:`` + the hex SHA-256 of those bytes. Any other body, or JSON that does
not parse, counts by its bytes (the hex SHA-256 alone). JSON outside I-JSON (an integer
no double holds, a member given twice, NaN) counts as before JCS (``json:``).

Versions: records stored before JCS hold an older form: 0.1.0 digested every body by
its bytes, and the unreleased form between them digested JSON as ``json:`` (Python's
sorted ``json.dumps``). :func:`older_fingerprints_of` computes those forms, and the
HTTP core compares a request with each of them when the new form mismatches, so such
records still replay (a retry that really differs is refused by every form).

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

from ..._errors import ConfigurationError
from . import jcs as _jcs

__all__ = [
    "Fingerprint",
    "RequestView",
    "fingerprint_of",
    "json_fields",
    "legacy_fingerprint_of",
    "older_fingerprints_of",
]

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
            return _jcs.loads(self.body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return _ABSENT


#: a fingerprint function: any JSON-serialisable value standing for the request
Fingerprint = Callable[[RequestView], Any]


def _digest(value: Any) -> str:
    """``jcs:`` + the SHA-256 of the RFC 8785 form of ``value``; outside I-JSON, the
    digest before JCS."""
    jcs = _jcs.canonical(value)
    if jcs is None:
        return _legacy_digest(value)
    return "jcs:" + hashlib.sha256(jcs).hexdigest()


def _legacy_digest(value: Any) -> str:
    """The digest before JCS: Python's sorted, compact ``json.dumps``."""
    try:
        text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise ConfigurationError(
            f"the fingerprint function must return JSON data (dicts, lists, str, numbers), "
            f"got {type(value).__name__}: {exc}"
        ) from None
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def _body_digest(req: RequestView, legacy: bool = False) -> str:
    doc = req.json()
    if doc is _ABSENT:
        # The digest alone, as before JSON was read: such records stay comparable.
        return hashlib.sha256(req.body).hexdigest()
    if not legacy:
        jcs = _jcs.canonical(doc)
        if jcs is not None:
            return "jcs:" + hashlib.sha256(jcs).hexdigest()
    return "json:" + _legacy_digest(doc)


def fingerprint_of(
    req: RequestView,
    header_names: frozenset[str],
    custom: Fingerprint | None,
    *,
    legacy: bool = False,
) -> dict[str, Any]:
    """The payload stored with a claim: a request with the same key and another
    fingerprint is refused. ``legacy``: the form before JCS (see the module's note)."""
    fp: dict[str, Any] = {"method": req.method.upper(), "path": req.path}
    if custom is not None:
        value = custom(req)
        fp["custom"] = _legacy_digest(value) if legacy else _digest(value)
        return fp
    headers = [[k, v] for k, v in req.headers if k in header_names]
    headers.sort(key=lambda kv: kv[0])  # stable: keeps repeated headers in order
    fp.update(query=req.query, headers=headers, body=_body_digest(req, legacy))
    return fp


def legacy_fingerprint_of(
    req: RequestView, header_names: frozenset[str], custom: Fingerprint | None
) -> dict[str, Any]:
    """The fingerprint as idemlock computed it before JCS (records stored then hold it)."""
    return fingerprint_of(req, header_names, custom, legacy=True)


def older_fingerprints_of(
    req: RequestView, header_names: frozenset[str], custom: Fingerprint | None
) -> list[dict[str, Any]]:
    """The forms records stored by earlier versions may hold, newest first, each only
    where it differs from the current one: the ``json:`` form, then 0.1.0's (every body
    by its bytes; 0.1.0 had no ``fingerprint=`` option)."""
    current = fingerprint_of(req, header_names, custom)
    forms = [legacy_fingerprint_of(req, header_names, custom)]
    if custom is None:
        forms.append({**current, "body": hashlib.sha256(req.body).hexdigest()})
    out: list[dict[str, Any]] = []
    for form in forms:
        if form != current and form not in out:
            out.append(form)
    return out


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
