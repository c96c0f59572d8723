"""The responses the Idempotency-Key middleware gives itself: ``application/problem+json``
documents (RFC 9457) for every refusal, and the :class:`Answer` type that carries them
(and replays) to a server adapter.

Without ``docs_url`` a problem's ``type`` is ``about:blank`` and its title the status
phrase, as RFC 9457 asks; with it the type is ``<docs_url>#<code>`` and a ``Link:
<docs_url>; rel="describedby"`` header points to the documentation. Every document has
the extension member ``code``, a stable machine-readable name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

__all__ = ["PROBLEM_CODES", "Answer", "Problem", "Problems"]

#: the status and stable ``code`` of every problem the middleware can answer, for the
#: OpenAPI documentation of a protected route
PROBLEM_CODES: dict[int, tuple[str, ...]] = {
    400: ("idempotency_key_missing", "idempotency_key_malformed", "idempotency_key_reused"),
    401: ("idempotency_identity_missing",),
    409: ("idempotency_key_in_use", "idempotency_response_unavailable"),
    413: ("idempotency_body_too_large",),
    422: ("idempotency_key_reused",),
    503: ("idempotency_store_unavailable",),
}


@dataclass(frozen=True)
class Answer:
    """A whole response the middleware sends itself (a problem or a replay)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass(frozen=True)
class Problem:
    status: int
    code: str
    title: str
    detail: str
    headers: tuple[tuple[bytes, bytes], ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


class Problems:
    """The middleware's problem documents, worded for its ``header`` name."""

    def __init__(
        self,
        *,
        header: str,
        docs_url: str | None,
        www_authenticate: str,
        max_body: int,
        mismatch_status: int,
    ) -> None:
        self.header = header
        self.docs_url = docs_url
        self.www_authenticate = www_authenticate
        self.max_body = max_body
        self.mismatch_status = mismatch_status

    def answer(self, p: Problem) -> Answer:
        if self.docs_url is None:
            ptype, title = "about:blank", HTTPStatus(p.status).phrase
        else:
            ptype, title = f"{self.docs_url}#{p.code}", p.title
        doc = {
            "type": ptype,
            "title": title,
            "status": p.status,
            "detail": p.detail,
            "code": p.code,
            **p.extra,
        }
        body = json.dumps(doc, ensure_ascii=True).encode("ascii")
        headers = [
            (b"content-type", b"application/problem+json"),
            (b"content-length", str(len(body)).encode("ascii")),
            (b"content-language", b"en"),
            *p.headers,
        ]
        if self.docs_url is not None:
            headers.append((b"link", f'<{self.docs_url}>; rel="describedby"'.encode("latin-1")))
        return Answer(p.status, headers, body)

    def missing(self) -> Answer:
        return self.answer(
            Problem(
                400,
                "idempotency_key_missing",
                "Idempotency-Key is missing",
                f"This operation requires an {self.header} header with a unique quoted "
                f'value, for example {self.header}: "8e03978e-40d5-43e8-bc93-6894a57f9324".',
            )
        )

    def malformed(self, why: str) -> Answer:
        return self.answer(
            Problem(
                400,
                "idempotency_key_malformed",
                "Idempotency-Key is malformed",
                f"The {self.header} header is not a valid key: {why}.",
            )
        )

    def unauthenticated(self) -> Answer:
        return self.answer(
            Problem(
                401,
                "idempotency_identity_missing",
                "Authentication required",
                f"Requests with an {self.header} must identify their caller.",
                headers=((b"www-authenticate", self.www_authenticate.encode("latin-1")),),
            )
        )

    def too_large(self) -> Answer:
        return self.answer(
            Problem(
                413,
                "idempotency_body_too_large",
                "Request body too large",
                f"Requests with an {self.header} may have at most {self.max_body} bytes of body.",
            )
        )

    def mismatch(self) -> Answer:
        return self.answer(
            Problem(
                self.mismatch_status,
                "idempotency_key_reused",
                "Idempotency-Key is already used",
                f"This {self.header} was already used with a different request (method, "
                "path, query, body or headers). A retry must repeat the request exactly; a "
                "new request needs a new key.",
            )
        )

    def in_flight(self) -> Answer:
        return self.answer(
            Problem(
                409,
                "idempotency_key_in_use",
                "A request is outstanding for this Idempotency-Key",
                f"A request with the same {self.header} is still being processed; retry "
                "later to receive its response.",
                headers=((b"retry-after", b"1"),),
            )
        )

    def unreplayable(self, status: int) -> Answer:
        return self.answer(
            Problem(
                409,
                "idempotency_response_unavailable",
                "The response cannot be replayed",
                f"The request with this {self.header} already completed with status "
                f"{status}, but its response was too large to record. It will not run "
                "again; fetch the result another way.",
                extra={"original_status": status},
            )
        )

    def unreadable(self) -> Answer:
        return self.answer(
            Problem(
                500,
                "idempotency_record_invalid",
                "Recorded response cannot be read",
                f"The response recorded for this {self.header} cannot be read (another "
                "program wrote it, or it was sealed with another key).",
            )
        )

    def unavailable(self) -> Answer:
        return self.answer(
            Problem(
                503,
                "idempotency_store_unavailable",
                "Idempotency store unavailable",
                "The request was not processed because its idempotency could not be "
                "checked; retry with the same key.",
                headers=((b"retry-after", b"1"),),
            )
        )
