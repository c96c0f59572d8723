"""Views that count their runs (one line per run in a file, so every worker is seen)."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseBase,
    JsonResponse,
    StreamingHttpResponse,
)
from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import ValidationError
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from idemlock.integrations.django import IdempotencyMixin, idempotent_view


@dataclass
class HeaderUser:
    pk: str
    is_authenticated: bool = True


class HeaderUserMiddleware:
    """Sets ``request.user`` from ``X-User`` (what an authentication middleware does)."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponseBase]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponseBase:
        name = request.headers.get("X-User")
        if name:  # else request.user stays Django's (AuthenticationMiddleware)
            request.user = HeaderUser(name)
        return self.get_response(request)


def _run(request: HttpRequest) -> HttpResponse:
    data = json.loads(request.body)
    runs = Path(os.environ["DJANGO_TEST_RUNS"])
    with runs.open("a") as f:
        f.write(f"{data['tag']}\n")
    time.sleep(float(data.get("sleep", 0)))
    if data.get("raise"):
        raise RuntimeError("the view failed")
    status = int(data.get("status", 201))
    return JsonResponse({"tag": data["tag"], "id": uuid.uuid4().hex}, status=status)


def charges(request: HttpRequest) -> HttpResponse:
    return _run(request)


def stream(request: HttpRequest) -> StreamingHttpResponse:
    _run(request)
    run = uuid.uuid4().hex.encode()
    return StreamingHttpResponse(iter([b"part-1-", b"part-2-", run]), status=201)


@idempotent_view(identity="header:X-Api-Key", spec={"name": "single", "ttl": 60, "lease": 10})
def single(request: HttpRequest) -> HttpResponse:
    return _run(request)


@idempotent_view(identity="header:X-Api-Key")  # no key: 401, the default with an identity
def strict(request: HttpRequest) -> HttpResponse:
    return _run(request)


@idempotent_view(url=os.environ.get("DJANGO_TEST_DEAD_STORE", "memory://"), allow_anonymous=True)
def down(request: HttpRequest) -> HttpResponse:
    return _run(request)


class HeaderAuthentication(BaseAuthentication):  # type: ignore[misc]
    """DRF authentication from ``X-Token: <name>`` (what a token scheme does)."""

    def authenticate(self, request: Any) -> tuple[HeaderUser, None] | None:
        name = request.headers.get("X-Token")
        return (HeaderUser("drf:" + name), None) if name else None

    def authenticate_header(self, request: Any) -> str:
        return "Token"


class DrfCharges(IdempotencyMixin, APIView):  # type: ignore[misc]
    idempotency: ClassVar[dict[str, Any]] = {"identity": "user"}
    authentication_classes: ClassVar[list[type]] = [HeaderAuthentication]
    permission_classes: ClassVar[list[type]] = [IsAuthenticated]

    def post(self, request: Any) -> Response:
        tag = request.data["tag"]
        runs = Path(os.environ["DJANGO_TEST_RUNS"])
        with runs.open("a") as f:
            f.write(f"{tag}\n")
        if request.data.get("invalid"):
            raise ValidationError({"tag": "rejected"})
        time.sleep(float(request.data.get("sleep", 0)))
        return Response({"tag": tag, "id": uuid.uuid4().hex}, status=201)
