"""The Idempotency-Key middleware, served by a real uvicorn and called with real httpx
clients, on Starlette and FastAPI, with its records in a SQLite file."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import idemlock
import idemlock.aio
from idemlock.integrations.asgi import IdempotencyMiddleware, header_identity

from .servers.postgres import PgServer, start_postgres

MAX_BODY = 64 * 1024
MAX_RESPONSE = 16 * 1024
SPEC = idemlock.IdempotencySpec("http", ttl=timedelta(hours=1), lease=timedelta(seconds=30))
DOCS = "https://docs.example.com/idempotency"
# What the server adds per response, and the marker of a replay: not part of a record.
VOLATILE = {b"date", b"server", b"idempotent-replayed"}


# ---- the application under test ----------------------------------------------------------


def handlers(calls: Counter[str]) -> list[tuple[str, str, Callable[..., Any]]]:
    """Endpoints that count their runs per ``tag`` (each test uses fresh tags)."""

    async def tagged(request: Request) -> tuple[dict[str, Any], str, int]:
        data = await request.json()
        tag = data["tag"]
        calls[tag] += 1
        return data, tag, calls[tag]

    async def charges(request: Request) -> Response:
        data, tag, run = await tagged(request)
        if data.get("delay"):
            await asyncio.sleep(data["delay"])
        body = {"tag": tag, "run": run, "amount": data.get("amount"), "id": uuid.uuid4().hex}
        resp = JSONResponse(body, status_code=201, headers={"X-Run": str(run)})
        resp.set_cookie("session", "s1")
        resp.set_cookie("theme", "dark")  # two Set-Cookie fields: order and repeats matter
        return resp

    async def flaky(request: Request) -> Response:
        data, _, run = await tagged(request)
        if run == 1:
            return JSONResponse({"failed": run, "id": uuid.uuid4().hex}, data["fail"])
        return JSONResponse({"ok": run, "id": uuid.uuid4().hex}, 201)

    async def boom(request: Request) -> Response:
        _, _, run = await tagged(request)
        if run == 1:
            raise RuntimeError("the handler failed")
        return JSONResponse({"ok": run, "id": uuid.uuid4().hex}, 201)

    async def big(request: Request) -> Response:
        data, _, _ = await tagged(request)
        return Response(os.urandom(data["size"]), 201, media_type="application/octet-stream")

    async def stream(request: Request) -> Response:
        _, _, run = await tagged(request)
        nonce = uuid.uuid4().hex

        async def chunks() -> Any:
            for i in range(5):
                await asyncio.sleep(0)
                yield f"chunk {i} of run {run} {nonce}\n".encode()

        return StreamingResponse(chunks(), media_type="text/plain")

    async def items(request: Request) -> Response:
        tag = request.query_params["tag"]
        calls[tag] += 1
        return JSONResponse({"run": calls[tag]})

    return [
        ("/charges", "POST", charges),
        ("/flaky", "POST", flaky),
        ("/boom", "POST", boom),
        ("/big", "POST", big),
        ("/stream", "POST", stream),
        ("/items", "GET", items),
        ("/items", "POST", items),
    ]


class Order(BaseModel):
    tag: str
    sku: str
    quantity: int


def starlette_app(calls: Counter[str], **options: Any) -> Starlette:
    routes = [Route(path, fn, methods=[method]) for path, method, fn in handlers(calls)]
    return Starlette(routes=routes, middleware=[Middleware(IdempotencyMiddleware, **options)])


def fastapi_app(calls: Counter[str], **options: Any) -> FastAPI:
    app = FastAPI()
    for path, method, fn in handlers(calls):
        app.add_api_route(path, fn, methods=[method])

    @app.post("/orders", status_code=201)
    async def create_order(order: Order) -> dict[str, Any]:
        calls[order.tag] += 1
        return {"order": uuid.uuid4().hex, "run": calls[order.tag], "sku": order.sku}

    app.add_middleware(IdempotencyMiddleware, **options)
    return app


# ---- a real server -----------------------------------------------------------------------


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """Run ``app`` under uvicorn in a thread on a free loopback port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # bound before the server starts: no port race
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="off", log_level="critical", access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@dataclass
class Server:
    url: str
    calls: Counter[str]
    db: str

    def client(self, **headers: str) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=headers, timeout=10)


@contextmanager
def running(
    factory: Callable[..., Any],
    db: Path,
    spec: idemlock.IdempotencySpec = SPEC,
    **options: Any,
) -> Iterator[Server]:
    url = f"sqlite:///{db}"
    coord = idemlock.aio.connect(url)
    calls: Counter[str] = Counter()
    app = factory(calls, coordinator=coord, spec=spec, **options)
    try:
        with serve(app) as base:
            yield Server(base, calls, url)
    finally:
        asyncio.run(coord.close())


DEFAULTS: dict[str, Any] = {
    "identity": header_identity("x-client"),
    "allow_anonymous": True,  # the requests without X-Client share the anonymous space
    "max_body": MAX_BODY,
    "max_response_body": MAX_RESPONSE,
}


@pytest.fixture(scope="module", params=["starlette", "fastapi"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    factory = starlette_app if request.param == "starlette" else fastapi_app
    db = tmp_path_factory.mktemp(request.param) / "idemlock.db"
    with running(factory, db, **DEFAULTS) as srv:
        yield srv


@pytest.fixture(scope="module")
def stripe(tmp_path_factory: pytest.TempPathFactory) -> Any:
    db = tmp_path_factory.mktemp("stripe") / "idemlock.db"
    with running(
        fastapi_app,
        db,
        stripe_compatible=True,
        require_key=True,
        routes=["/orders", "/charges"],
        identity=header_identity("authorization"),
        allow_anonymous=False,
        docs_url=DOCS,
    ) as srv:
        yield srv


# ---- helpers -----------------------------------------------------------------------------


def new_key() -> str:
    return f'"{uuid.uuid4()}"'


def tag() -> str:
    return uuid.uuid4().hex


def kept(response: httpx.Response) -> list[tuple[bytes, bytes]]:
    return [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in VOLATILE]


def replayed(response: httpx.Response) -> bool:
    return response.headers.get("idempotent-replayed") == "true"


def assert_problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    doc = response.json()
    assert doc["status"] == status
    assert doc["code"] == code
    assert isinstance(doc["type"], str) and doc["type"]
    assert isinstance(doc["title"], str) and doc["title"]
    assert isinstance(doc["detail"], str) and doc["detail"]
    return dict(doc)


# ---- the draft's scenarios ---------------------------------------------------------------


def test_first_request_runs_and_a_retry_replays_it_exactly(server: Server) -> None:
    t, key = tag(), new_key()
    with server.client() as c:
        first = c.post(
            "/charges", json={"tag": t, "amount": 1200}, headers={"Idempotency-Key": key}
        )
        assert first.status_code == 201
        assert not replayed(first)
        for _ in range(2):
            again = c.post(
                "/charges", json={"tag": t, "amount": 1200}, headers={"Idempotency-Key": key}
            )
            assert replayed(again)
            assert again.status_code == first.status_code
            assert again.content == first.content
            assert kept(again) == kept(first)  # same fields, same order, both cookies
    assert server.calls[t] == 1
    assert first.headers["x-run"] == "1"
    assert first.headers.get_list("set-cookie") == again.headers.get_list("set-cookie")


async def test_concurrent_duplicates_run_the_handler_once(server: Server) -> None:
    t, key = tag(), new_key()
    body = {"tag": t, "amount": 5, "delay": 1.0}
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:

        async def attempt() -> httpx.Response:
            return await c.post("/charges", json=body, headers={"Idempotency-Key": key})

        responses = await asyncio.gather(*(attempt() for _ in range(10)))
        originals = [r for r in responses if r.status_code == 201 and not replayed(r)]
        assert len(originals) == 1
        conflicts = [r for r in responses if r.status_code == 409]
        assert conflicts, "no attempt overlapped the running one"
        for r in responses:
            if r.status_code == 409:
                assert_problem(r, 409, "idempotency_key_in_use")
                assert r.headers["retry-after"] == "1"
            elif r is not originals[0]:
                assert replayed(r) and r.content == originals[0].content
        late = await attempt()
    assert server.calls[t] == 1
    assert replayed(late) and late.content == originals[0].content


SHORT = idemlock.IdempotencySpec("http-short", ttl=timedelta(hours=1), lease=timedelta(seconds=0.6))


@pytest.mark.parametrize("heartbeat", [True, False])
def test_handler_slower_than_its_lease_runs_once(tmp_path: Path, heartbeat: bool) -> None:
    """Heartbeats (issue 11): a handler running 3x its claim's lease keeps its key, so
    a duplicate meanwhile gets 409 and the handler runs once. Without heartbeats the
    duplicate takes the key over and the handler runs twice (the test can fail)."""
    db = tmp_path / "idemlock.db"
    with running(starlette_app, db, spec=SHORT, heartbeat=heartbeat, **DEFAULTS) as server:
        t, key = tag(), new_key()
        body = {"tag": t, "amount": 5, "delay": 3 * 0.6}
        h = {"Idempotency-Key": key}
        with server.client() as c1, server.client() as c2, ThreadPoolExecutor(1) as pool:
            first = pool.submit(c1.post, "/charges", json=body, headers=h)
            time.sleep(2 * 0.6)  # two leases into the handler
            duplicate = c2.post("/charges", json=body, headers=h)
            original = first.result(timeout=30)
            late = c2.post("/charges", json=body, headers=h)
        assert original.status_code == 201 and not replayed(original)
        if heartbeat:
            assert_problem(duplicate, 409, "idempotency_key_in_use")
            assert server.calls[t] == 1
            assert replayed(late) and late.content == original.content
        else:
            assert duplicate.status_code == 201 and not replayed(duplicate)
            assert server.calls[t] == 2


def test_same_key_with_a_different_request_is_422(server: Server) -> None:
    t, key = tag(), new_key()
    h = {"Idempotency-Key": key}
    with server.client() as c:
        first = c.post("/charges", json={"tag": t, "amount": 1}, headers=h)
        assert first.status_code == 201
        assert_problem(
            c.post("/charges", json={"tag": t, "amount": 2}, headers=h),
            422,
            "idempotency_key_reused",
        )
        assert_problem(
            c.post("/charges?currency=eur", json={"tag": t, "amount": 1}, headers=h),
            422,
            "idempotency_key_reused",
        )
        assert_problem(
            c.post("/flaky", json={"tag": t, "fail": 500}, headers=h), 422, "idempotency_key_reused"
        )
        raw = json.dumps({"tag": t, "amount": 1}).encode()
        other_type = {**h, "Content-Type": "text/plain"}
        assert_problem(
            c.post("/charges", content=raw, headers=other_type), 422, "idempotency_key_reused"
        )
        again = c.post("/charges", json={"tag": t, "amount": 1}, headers=h)
    assert server.calls[t] == 1
    assert replayed(again) and again.content == first.content


def test_identity_isolates_clients_using_the_same_key(server: Server) -> None:
    t, key = tag(), new_key()
    h, body = {"Idempotency-Key": key}, {"tag": t, "amount": 7}
    with (
        server.client(**{"X-Client": "alice"}) as alice,
        server.client(**{"X-Client": "bob"}) as bob,
        server.client() as anonymous,
    ):
        a1 = alice.post("/charges", json=body, headers=h)
        b1 = bob.post("/charges", json=body, headers=h)  # same key, same request, other caller
        n1 = anonymous.post("/charges", json=body, headers=h)
        assert [r.status_code for r in (a1, b1, n1)] == [201, 201, 201]
        assert not any(replayed(r) for r in (a1, b1, n1))
        assert len({a1.json()["id"], b1.json()["id"], n1.json()["id"]}) == 3
        a2 = alice.post("/charges", json=body, headers=h)
        b2 = bob.post("/charges", json=body, headers=h)
        n2 = anonymous.post("/charges", json=body, headers=h)
    assert server.calls[t] == 3
    assert (a2.content, b2.content, n2.content) == (a1.content, b1.content, n1.content)
    assert all(replayed(r) for r in (a2, b2, n2))


@pytest.mark.parametrize("status", [500, 503, 429, 409, 401])
def test_retryable_failures_are_not_recorded(server: Server, status: int) -> None:
    t, key = tag(), new_key()
    h, body = {"Idempotency-Key": key}, {"tag": t, "fail": status}
    with server.client() as c:
        first = c.post("/flaky", json=body, headers=h)
        assert first.status_code == status and not replayed(first)
        second = c.post("/flaky", json=body, headers=h)  # runs again
        assert second.status_code == 201 and not replayed(second)
        third = c.post("/flaky", json=body, headers=h)
    assert server.calls[t] == 2
    assert replayed(third) and third.content == second.content


def test_client_errors_are_recorded_and_replayed(server: Server) -> None:
    t, key = tag(), new_key()
    h, body = {"Idempotency-Key": key}, {"tag": t, "fail": 400}
    with server.client() as c:
        first = c.post("/flaky", json=body, headers=h)
        again = c.post("/flaky", json=body, headers=h)
    assert first.status_code == again.status_code == 400
    assert replayed(again) and again.content == first.content
    assert server.calls[t] == 1


def test_an_exception_abandons_the_claim(server: Server) -> None:
    t, key = tag(), new_key()
    h, body = {"Idempotency-Key": key}, {"tag": t}
    # After an application exception uvicorn closes the connection although its 500
    # allowed keep-alive: send that request on a connection of its own.
    with server.client() as once:
        assert once.post("/boom", json=body, headers=h).status_code == 500
    with server.client() as c:
        second = c.post("/boom", json=body, headers=h)
        assert second.status_code == 201 and not replayed(second)
        third = c.post("/boom", json=body, headers=h)
    assert server.calls[t] == 2
    assert replayed(third) and third.content == second.content


def test_get_is_untouched(server: Server) -> None:
    t = tag()
    with server.client() as c:
        for value in (new_key(), new_key(), "not-a-structured-string"):
            r = c.get("/items", params={"tag": t}, headers={"Idempotency-Key": value})
            assert r.status_code == 200 and not replayed(r)
        # The same key twice on GET runs twice.
        key = new_key()
        for _ in range(2):
            c.get("/items", params={"tag": t}, headers={"Idempotency-Key": key})
    assert server.calls[t] == 5


def test_without_a_key_requests_pass_through(server: Server) -> None:
    t = tag()
    with server.client() as c:
        for _ in range(2):
            r = c.post("/charges", json={"tag": t, "amount": 1})
            assert r.status_code == 201 and not replayed(r)
    assert server.calls[t] == 2


# ---- the header's syntax -----------------------------------------------------------------

MALFORMED: list[bytes] = [
    b'"unterminated',
    b"order A18",  # unquoted with a space
    b'"bad \\x escape"',
    b'""',  # empty
    b'"' + b"k" * 256 + b'"',  # over max_key_length
    b'"trailing" garbage',
    b'"a";Upper=1',  # parameter keys are lowercase
    b'"a";p=1.2345',  # decimal with 4 fractional digits
    b'"tab\tinside"',
    b'"caf\xc3\xa9"',  # non-ASCII
    b'"a", "b"',  # a list
]


@pytest.mark.parametrize("value", MALFORMED, ids=lambda v: repr(v)[:32])
def test_malformed_keys_are_400(server: Server, value: bytes) -> None:
    t = tag()
    with server.client() as c:
        r = c.post("/charges", json={"tag": t}, headers=[(b"Idempotency-Key", value)])
    assert_problem(r, 400, "idempotency_key_malformed")
    assert r.headers["content-language"] == "en"
    assert r.json()["type"] == "about:blank" and r.json()["title"] == "Bad Request"
    assert server.calls[t] == 0


def test_unquoted_keys_are_accepted_as_their_quoted_form(server: Server) -> None:
    # What Stripe's SDKs and most clients send: Idempotency-Key: order-A18 (no quotes).
    t, raw = tag(), f"order-A18-{uuid.uuid4().hex}"
    with server.client() as c:
        first = c.post("/charges", json={"tag": t}, headers={"Idempotency-Key": raw})
        again = c.post("/charges", json={"tag": t}, headers={"Idempotency-Key": raw})
        quoted = c.post("/charges", json={"tag": t}, headers={"Idempotency-Key": f'"{raw}"'})
    assert first.status_code == 201 and not replayed(first)
    assert replayed(again) and again.content == first.content
    assert replayed(quoted) and quoted.content == first.content  # one key, either form
    assert server.calls[t] == 1


def test_allow_unquoted_key_false_accepts_the_sf_string_only(tmp_path: Path) -> None:
    t, raw = tag(), f"order-A18-{uuid.uuid4().hex}"
    strict = running(starlette_app, tmp_path / "strict.db", allow_unquoted_key=False)
    with strict as srv, srv.client() as c:
        bare = c.post("/charges", json={"tag": t}, headers={"Idempotency-Key": raw})
        quoted = c.post("/charges", json={"tag": t}, headers={"Idempotency-Key": f'"{raw}"'})
        others = [  # a number, a boolean
            c.post("/charges", json={"tag": t}, headers=[(b"Idempotency-Key", value)])
            for value in (b"8e03978e-40d5-43e8-bc93-6894a57f9324", b"?1")
        ]
    assert_problem(bare, 400, "idempotency_key_malformed")
    assert "quoted string" in bare.json()["detail"]
    for r in others:
        assert_problem(r, 400, "idempotency_key_malformed")
    assert quoted.status_code == 201 and not replayed(quoted)
    assert srv.calls[t] == 1


def test_two_key_fields_are_400(server: Server) -> None:
    t = tag()
    headers = [("Idempotency-Key", new_key()), ("Idempotency-Key", new_key())]
    with server.client() as c:
        r = c.post("/charges", json={"tag": t}, headers=headers)
    assert_problem(r, 400, "idempotency_key_malformed")
    assert server.calls[t] == 0


def test_escapes_and_parameters_are_understood(server: Server) -> None:
    t = tag()
    base = uuid.uuid4().hex
    with server.client() as c:

        def send(value: str) -> httpx.Response:
            return c.post("/charges", json={"tag": t}, headers={"Idempotency-Key": value})

        quoted = send(f'"{base}\\"q"')
        backslash = send(f'"{base}\\\\q"')  # another key: no replay
        with_params = send(f'"{base}\\"q";v=1;trace="x";flag')  # same key as the first
    assert not replayed(quoted) and not replayed(backslash)
    assert replayed(with_params) and with_params.content == quoted.content
    assert server.calls[t] == 2


# ---- sizes and streaming -----------------------------------------------------------------


def test_request_body_over_the_limit_is_413(server: Server) -> None:
    t = tag()
    body = {"tag": t, "pad": "x" * MAX_BODY}
    with server.client() as c:
        r = c.post("/charges", json=body, headers={"Idempotency-Key": new_key()})
        assert_problem(r, 413, "idempotency_body_too_large")
        assert server.calls[t] == 0

        # Chunked, without Content-Length: counted as it arrives.
        def chunks() -> Iterator[bytes]:
            data = json.dumps(body).encode()
            for i in range(0, len(data), 4096):
                yield data[i : i + 4096]

        r = c.post("/charges", content=chunks(), headers={"Idempotency-Key": new_key()})
        assert_problem(r, 413, "idempotency_body_too_large")
        # Without a key the middleware does not read the body at all.
        assert c.post("/charges", json=body).status_code == 201
    assert server.calls[t] == 1


def test_response_over_the_limit_is_delivered_but_not_replayed(server: Server) -> None:
    t, key = tag(), new_key()
    h, body = {"Idempotency-Key": key}, {"tag": t, "size": 3 * MAX_RESPONSE}
    with server.client() as c:
        first = c.post("/big", json=body, headers=h)
        assert first.status_code == 201 and len(first.content) == 3 * MAX_RESPONSE
        again = c.post("/big", json=body, headers=h)
    doc = assert_problem(again, 409, "idempotency_response_unavailable")
    assert doc["original_status"] == 201
    assert server.calls[t] == 1  # the side effect did not run again


def test_streamed_response_within_the_limit_is_replayed(server: Server) -> None:
    t, key = tag(), new_key()
    h, body = {"Idempotency-Key": key}, {"tag": t}
    with server.client() as c:
        first = c.post("/stream", json=body, headers=h)
        again = c.post("/stream", json=body, headers=h)
    assert first.status_code == again.status_code == 200
    assert first.text.count("\n") == 5
    assert replayed(again) and again.content == first.content
    assert again.headers["content-length"] == str(len(first.content))
    assert server.calls[t] == 1


def test_the_store_never_sees_raw_keys_or_identities(server: Server) -> None:
    t, raw = tag(), uuid.uuid4().hex
    with server.client(**{"X-Client": "carol"}) as c:
        c.post("/charges", json={"tag": t}, headers={"Idempotency-Key": f'"{raw}"'})
    coord = idemlock.connect(server.db)
    try:
        records = coord.keys()
        keys = [r.key for r in records]
    finally:
        coord.close()
    assert keys and all(len(k) == 64 for k in keys)
    assert not any(raw in k or "carol" in k for k in keys)


# ---- FastAPI models, Stripe-compatible mode, required keys and identity ------------------


def test_fastapi_model_endpoint_is_replayed(stripe: Server) -> None:
    t, key = tag(), new_key()
    auth = {"Authorization": "Bearer tok-1", "Idempotency-Key": key}
    order = {"tag": t, "sku": "A17", "quantity": 2}
    with stripe.client() as c:
        first = c.post("/orders", json=order, headers=auth)
        again = c.post("/orders", json=order, headers=auth)
    assert first.status_code == 201 and first.json()["sku"] == "A17"
    assert replayed(again) and again.content == first.content
    assert stripe.calls[t] == 1


def test_stripe_mode_mismatch_is_400_and_unquoted_keys_work(stripe: Server) -> None:
    t, key = tag(), f"stripe-{uuid.uuid4().hex}"
    h = {"Authorization": "Bearer tok-2", "Idempotency-Key": key}
    with stripe.client() as c:
        first = c.post("/orders", json={"tag": t, "sku": "B", "quantity": 1}, headers=h)
        assert first.status_code == 201
        again = c.post("/orders", json={"tag": t, "sku": "B", "quantity": 1}, headers=h)
        assert replayed(again) and again.content == first.content
        r = c.post("/orders", json={"tag": t, "sku": "B", "quantity": 9}, headers=h)
    doc = assert_problem(r, 400, "idempotency_key_reused")
    assert doc["type"] == f"{DOCS}#idempotency_key_reused"
    assert doc["title"] == "Idempotency-Key is already used"
    assert r.headers["link"] == f'<{DOCS}>; rel="describedby"'
    assert stripe.calls[t] == 1


def test_required_key_missing_is_400(stripe: Server) -> None:
    t = tag()
    with stripe.client(Authorization="Bearer tok-3") as c:
        r = c.post("/orders", json={"tag": t, "sku": "C", "quantity": 1})
        assert_problem(r, 400, "idempotency_key_missing")
        # Outside the configured routes no key is needed.
        assert c.post("/flaky", json={"tag": t, "fail": 201}).status_code == 201
    assert stripe.calls[t] == 1


def test_missing_identity_is_401_when_anonymous_is_refused(stripe: Server) -> None:
    t = tag()
    with stripe.client() as c:
        r = c.post(
            "/orders",
            json={"tag": t, "sku": "D", "quantity": 1},
            headers={"Idempotency-Key": new_key()},
        )
    assert_problem(r, 401, "idempotency_identity_missing")
    assert r.headers["www-authenticate"] == "Bearer"
    assert stripe.calls[t] == 0


# ---- the store restarted in the middle of a request ------------------------------------


@pytest.fixture(scope="module")
def pg() -> Iterator[PgServer]:
    """A PostgreSQL server of this module's own, which a test restarts."""
    server = start_postgres()
    try:
        yield server
    finally:
        server.destroy()


def test_store_restarted_while_recording_keeps_the_key_reserved(
    pg: PgServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The store restarts while the handler runs, so recording its 201 fails: the
    response is delivered, the claim is kept (a retry gets 409, never a second run and
    charge) and the record is written again once the store answers: retries replay."""
    caplog.set_level("INFO", logger="idemlock.http")
    calls: Counter[str] = Counter()
    release = threading.Event()

    async def charge(request: Request) -> Response:
        data = await request.json()
        calls[data["tag"]] += 1
        await asyncio.to_thread(release.wait, 30)
        return JSONResponse({"charged": data["amount"], "run": calls[data["tag"]]}, 201)

    coord = idemlock.aio.connect(pg.dsn)
    app = Starlette(
        routes=[Route("/charge", charge, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, coordinator=coord, spec=SPEC)],
    )

    def new_h() -> dict[str, str]:
        return {"Idempotency-Key": new_key()}

    t, h = tag(), new_h()
    with serve(app) as base, ThreadPoolExecutor(1) as pool:
        release.set()
        with httpx.Client(base_url=base, timeout=30) as c:
            # Warm the pool up so the claim and the record use pooled connections.
            warm = c.post("/charge", json={"tag": tag(), "amount": 1}, headers=new_h())
            assert warm.status_code == 201, warm.text
        release.clear()
        first = pool.submit(
            lambda: httpx.post(f"{base}/charge", json={"tag": t, "amount": 7}, headers=h,
                               timeout=30)
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while calls[t] == 0:
            assert time.monotonic() < deadline, "the handler did not start"
            time.sleep(0.01)
        pg.restart("fast")  # every connection the store had is gone
        release.set()
        response = first.result(timeout=30)
        assert response.status_code == 201 and response.json()["run"] == 1
        with httpx.Client(base_url=base, timeout=30) as c:
            # Until the record is written again, retries get 409; then the replay.
            deadline = time.monotonic() + 20
            while True:
                retry = c.post("/charge", json={"tag": t, "amount": 7}, headers=h)
                if retry.status_code != 409:
                    break
                assert_problem(retry, 409, "idempotency_key_in_use")
                assert time.monotonic() < deadline, "the record was never written again"
                time.sleep(0.05)
        assert retry.status_code == 201 and replayed(retry), retry.text
        assert retry.content == response.content
    assert calls[t] == 1  # charged once
    logged = [r.getMessage() for r in caplog.records if r.name == "idemlock.http"]
    assert any("failed while recording a 201 response" in m for m in logged), logged
    assert any("recorded a 201 response on a later attempt" in m for m in logged), logged
    # (coord is not closed here: its pool lived on uvicorn's loop, which is gone; the
    # connections end with the module's server.)


def test_store_down_is_a_logged_503(pg: PgServer, caplog: pytest.LogCaptureFixture) -> None:
    """A store failure is never hidden: 503 problem+json, the handler does not run, and
    the failure is logged with its cause."""
    calls: Counter[str] = Counter()

    async def charge(request: Request) -> Response:
        calls["runs"] += 1
        return JSONResponse({"ok": True}, 201)

    coord = idemlock.aio.connect(pg.dsn)
    app = Starlette(
        routes=[Route("/charge", charge, methods=["POST"])],
        middleware=[Middleware(IdempotencyMiddleware, coordinator=coord, spec=SPEC)],
    )
    h = {"Idempotency-Key": new_key()}
    with serve(app) as base, httpx.Client(base_url=base, timeout=30) as c:
        pg.stop()
        try:
            with caplog.at_level("WARNING", logger="idemlock.http"):
                down = c.post("/charge", json={}, headers=h)
        finally:
            pg.start()
        doc = assert_problem(down, 503, "idempotency_store_unavailable")
        assert down.headers["retry-after"] == "1" and "retry" in doc["detail"]
        assert calls["runs"] == 0
        assert any(
            "idempotency store failed" in r.getMessage() and "StoreUnavailable" in r.getMessage()
            for r in caplog.records
        ), caplog.text
        # Back up: the same key now runs (nothing was claimed while the store was down).
        assert c.post("/charge", json={}, headers=h).status_code == 201
    assert calls["runs"] == 1


# ---- the defaults of this release ------------------------------------------------------


def test_with_an_identity_a_request_without_one_is_401_by_default(tmp_path: Path) -> None:
    with (
        running(
            starlette_app, tmp_path / "idemlock.db", identity=header_identity("x-client")
        ) as srv,
        srv.client() as c,
    ):
        t = tag()
        r = c.post("/charges", json={"tag": t}, headers={"Idempotency-Key": new_key()})
        assert_problem(r, 401, "idempotency_identity_missing")
        ok = c.post(
            "/charges", json={"tag": t}, headers={"Idempotency-Key": new_key(), "X-Client": "a"}
        )
        assert ok.status_code == 201
        assert srv.calls[t] == 1  # the 401 did not run the handler


def test_a_framework_response_before_the_handler_started_is_not_recorded(
    tmp_path: Path,
) -> None:
    """The rule for plain ASGI: once the application calls expect_handler, a response
    it sends before handler_started (here a framework's validation 422) abandons the
    claim, so the client that fixes its body reuses its key."""
    from idemlock.integrations.asgi import expect_handler, handler_started

    calls: Counter[str] = Counter()

    async def charge(request: Request) -> Response:
        data = await request.json()
        calls[data["tag"]] += 1
        return JSONResponse({"run": calls[data["tag"]], "id": uuid.uuid4().hex}, 201)

    inner = Starlette(routes=[Route("/charge", charge, methods=["POST"])])

    async def framework(scope: Any, receive: Any, send: Any) -> None:
        # A framework that validates the body before it calls the handler.
        expect_handler(scope)
        body = (await receive())["body"]
        if b'"amount"' not in body:
            await JSONResponse({"detail": "amount is required"}, 422)(scope, receive, send)
            return
        handler_started(scope)
        pending = [body]

        async def again() -> Any:
            return {"type": "http.request", "body": pending.pop(), "more_body": False}

        await inner(scope, again, send)

    coord = idemlock.aio.connect(f"sqlite:///{tmp_path / 'idemlock.db'}")
    app = IdempotencyMiddleware(framework, coordinator=coord, spec=SPEC)
    t, k = tag(), new_key()
    with serve(app) as base, httpx.Client(base_url=base, timeout=10) as c:
        bad = c.post("/charge", json={"tag": t}, headers={"Idempotency-Key": k})
        assert bad.status_code == 422 and bad.json() == {"detail": "amount is required"}
        fixed = c.post("/charge", json={"tag": t, "amount": 3}, headers={"Idempotency-Key": k})
        assert fixed.status_code == 201 and not replayed(fixed)
        again = c.post("/charge", json={"tag": t, "amount": 3}, headers={"Idempotency-Key": k})
        assert replayed(again) and again.content == fixed.content
    assert calls[t] == 1
    asyncio.run(coord.close())


def test_the_same_json_with_other_spacing_and_key_order_is_the_same_request(
    server: Server,
) -> None:
    t, key = tag(), new_key()
    h = {"Idempotency-Key": key, "Content-Type": "application/json"}
    with server.client() as c:
        first = c.post("/charges", content=f'{{"tag":"{t}","amount":5}}', headers=h)
        again = c.post("/charges", content=f'{{ "amount": 5,\n "tag": "{t}" }}', headers=h)
        other = c.post("/charges", content=f'{{"tag":"{t}","amount":6}}', headers=h)
    assert first.status_code == 201 and replayed(again) and again.content == first.content
    assert_problem(other, 422, "idempotency_key_reused")
    assert server.calls[t] == 1


def test_an_unknown_option_names_the_known_ones(tmp_path: Path) -> None:
    coord = idemlock.aio.connect("memory://")
    with pytest.raises(idemlock.ConfigurationError, match=r"stripe_compat\b.*allow_unquoted_key"):
        IdempotencyMiddleware(starlette_app(Counter()), coordinator=coord, stripe_compat=True)
    with pytest.raises(idemlock.ConfigurationError, match="mismatch_status must be"):
        IdempotencyMiddleware(starlette_app(Counter()), coordinator=coord, mismatch_status=418)
