"""FastAPI, natively: real FastAPI applications called through httpx's ASGI transport
and served by a real uvicorn (in a thread, and as a subprocess for the logging test),
their records in a SQLite file."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Annotated, Any

import httpx
import pytest
import uvicorn
from fastapi import (
    BackgroundTasks,
    Depends,
    FastAPI,
    Form,
    Header,
    HTTPException,
    Query,
    Request,
    Response,
)
from pydantic import BaseModel

import idemlock
import idemlock.aio
from idemlock.integrations.asgi import json_fields
from idemlock.integrations.fastapi import Idempotency

from .servers._proc import popen

ROOT = Path(__file__).resolve().parent.parent
USERS = {"tok-alice": "alice", "tok-bob": "bob"}


class Order(BaseModel):
    tag: str
    sku: str
    quantity: int


async def caller(authorization: str | None = Header(None)) -> str | None:
    """The identity dependency: the user behind a bearer token, None without one."""
    if authorization is None:
        return None
    user = USERS.get(authorization.removeprefix("Bearer "))
    if user is None:
        raise HTTPException(403, "unknown token")  # the dependency's own refusal
    return user


def make_app(
    url: str,
    calls: Counter[str],
    gate: asyncio.Event | None = None,
    entered: asyncio.Event | None = None,
) -> FastAPI:
    idem = Idempotency(url, identity=caller)
    app = FastAPI(lifespan=idem.lifespan)
    idem.install(app)

    @app.post("/orders", status_code=201)
    @idem.protect
    async def create_order(order: Order) -> dict[str, Any]:
        calls[order.tag] += 1
        return {"order": uuid.uuid4().hex, "run": calls[order.tag], "sku": order.sku}

    @app.post("/refunds", status_code=201)
    @idem.protect(spec=idemlock.IdempotencySpec("refunds"), ttl=120, lease=5)
    async def refund(order: Order) -> dict[str, Any]:
        calls[order.tag] += 1
        if entered is not None:
            entered.set()
        if gate is not None:
            await gate.wait()
        return {"refund": uuid.uuid4().hex}

    @app.post("/quotes")
    @idem.protect(fingerprint=json_fields("sku", "quantity"), identity=None)
    def quote(order: Order) -> dict[str, Any]:  # a sync endpoint, run in the threadpool
        calls[order.tag] += 1
        return {"quote": uuid.uuid4().hex}

    @app.post("/stripe")
    @idem.protect(allow_unquoted_key=True, identity=None)
    async def stripe_like(order: Order) -> dict[str, Any]:
        calls[order.tag] += 1
        return {"id": uuid.uuid4().hex}

    @app.post("/strict-mismatch")
    @idem.protect(mismatch_status=400, identity=None)
    async def strict_mismatch(order: Order) -> dict[str, Any]:
        calls[order.tag] += 1
        return {"id": uuid.uuid4().hex}

    @app.post("/sf-only")
    @idem.protect(require_key=True, allow_unquoted_key=False, identity=None)
    async def sf_only(order: Order) -> dict[str, Any]:
        calls[order.tag] += 1
        return {"id": uuid.uuid4().hex}

    @app.post("/form")
    @idem.protect(identity=None)
    async def form(tag: str = Form(), note: str = Form("")) -> dict[str, Any]:
        calls[tag] += 1
        return {"id": uuid.uuid4().hex}

    @app.post("/open")
    async def unprotected(order: Order) -> dict[str, Any]:
        calls[order.tag] += 1
        return {"id": uuid.uuid4().hex}

    app.state.idem = idem
    return app


def key() -> str:
    return f'"{uuid.uuid4()}"'


def tag() -> str:
    return uuid.uuid4().hex


def auth(user: str = "tok-alice", k: str | None = None) -> dict[str, str]:
    h = {"Authorization": f"Bearer {user}"}
    if k is not None:
        h["Idempotency-Key"] = k
    return h


def problem(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    doc: dict[str, Any] = r.json()
    assert doc["status"] == status and doc["code"] == code
    return doc


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient, Counter[str]]]:
    """The app through httpx's ASGI transport, inside the lifespan FastAPI was given."""
    calls: Counter[str] = Counter()
    app = make_app(f"sqlite:///{tmp_path / 'idemlock.db'}", calls)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            yield app, client, calls


# ---- OpenAPI -------------------------------------------------------------------------


def test_openapi_documents_the_header_and_the_problem_responses(tmp_path: Path) -> None:
    app = make_app(f"sqlite:///{tmp_path / 'x.db'}", Counter())
    doc = app.openapi()
    op = doc["paths"]["/orders"]["post"]
    header = [p for p in op["parameters"] if p["in"] == "header" and p["name"] == "Idempotency-Key"]
    assert len(header) == 1 and not header[0]["required"]
    assert "Idempotent-Replayed: true" in header[0]["description"]
    for status in ("400", "401", "409", "422", "503"):
        content = op["responses"][status]["content"]
        assert content["application/problem+json"]["schema"] == {
            "$ref": "#/components/schemas/IdempotencyProblem"
        }, status
    # FastAPI's own validation 422 stays documented beside the key-reuse problem.
    assert "application/json" in op["responses"]["422"]["content"]
    assert "Validation Error" in op["responses"]["422"]["description"]
    assert doc["components"]["schemas"]["IdempotencyProblem"]["required"][-1] == "code"
    # A route with mismatch_status=400 documents no 422 of its own; no identity, no 401.
    strict = doc["paths"]["/strict-mismatch"]["post"]["responses"]
    assert "idempotency_key_reused" in strict["400"]["description"]
    assert "401" not in strict
    # The replay marker is a documented header of the success responses.
    replayed = op["responses"]["201"]["headers"]["Idempotent-Replayed"]
    assert replayed["schema"] == {"type": "string", "enum": ["true"]}
    assert "Idempotent-Replayed" not in op["responses"]["409"].get("headers", {})
    # Unprotected routes are untouched.
    open_op = doc["paths"]["/open"]["post"]
    assert all(p["name"] != "Idempotency-Key" for p in open_op.get("parameters", []))
    assert set(open_op["responses"]) == {"200", "422"}
    assert "x-idemlock" not in repr(doc)  # the marker that found the routes is gone


def test_openapi_marks_the_key_required_with_require_key(tmp_path: Path) -> None:
    doc = make_app(f"sqlite:///{tmp_path / 'x.db'}", Counter()).openapi()

    def key_param(path: str) -> dict[str, Any]:
        params = doc["paths"][path]["post"]["parameters"]
        (param,) = [p for p in params if p["in"] == "header" and p["name"] == "Idempotency-Key"]
        return param

    assert key_param("/sf-only")["required"] is True
    assert "quoted string" in key_param("/sf-only")["description"]
    assert key_param("/orders")["required"] is False
    assert "order-A18" in key_param("/orders")["description"]
    ok = doc["paths"]["/sf-only"]["post"]["responses"]["200"]
    assert "Idempotent-Replayed" in ok["headers"]


# ---- the table, through the ASGI transport ---------------------------------------------


async def test_replay_identity_from_the_dependency_and_401_without_one(served: Any) -> None:
    _, c, calls = served
    t, k = tag(), key()
    order = {"tag": t, "sku": "A1", "quantity": 2}
    first = await c.post("/orders", json=order, headers=auth(k=k))
    again = await c.post("/orders", json=order, headers=auth(k=k))
    assert first.status_code == 201 and again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    other = await c.post("/orders", json=order, headers=auth("tok-bob", k))
    assert other.status_code == 201 and "idempotent-replayed" not in other.headers
    assert calls[t] == 2  # alice once, bob once
    # The dependency said None: 401, not a shared anonymous key space.
    anon = await c.post("/orders", json=order, headers={"Idempotency-Key": k})
    problem(anon, 401, "idempotency_identity_missing")
    # The dependency's own refusal is FastAPI's answer, never recorded or claimed.
    bad = await c.post("/orders", json=order, headers=auth("tok-eve", k))
    assert bad.status_code == 403
    assert calls[t] == 2


async def test_validation_errors_are_not_recorded_and_the_key_can_be_reused(
    served: Any,
) -> None:
    _, c, calls = served
    t, k = tag(), key()
    broken = await c.post("/orders", json={"tag": t, "sku": "B"}, headers=auth(k=k))
    assert broken.status_code == 422 and broken.headers["content-type"] == "application/json"
    assert "quantity" in broken.text  # FastAPI's own validation error
    fixed = await c.post("/orders", json={"tag": t, "sku": "B", "quantity": 1}, headers=auth(k=k))
    assert fixed.status_code == 201 and "idempotent-replayed" not in fixed.headers
    again = await c.post("/orders", json={"tag": t, "sku": "B", "quantity": 1}, headers=auth(k=k))
    assert again.headers["idempotent-replayed"] == "true" and again.content == fixed.content
    assert calls[t] == 1


async def test_json_bodies_are_compared_canonically(served: Any) -> None:
    _, c, calls = served
    t, k = tag(), key()
    h = {**auth(k=k), "Content-Type": "application/json"}
    first = await c.post(
        "/orders", content=f'{{"tag": "{t}", "sku": "C", "quantity": 3}}', headers=h
    )
    assert first.status_code == 201
    reordered = f'{{ "quantity":3,\n  "sku":"C","tag":"{t}" }}'
    again = await c.post("/orders", content=reordered, headers=h)
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    changed = await c.post("/orders", content=reordered.replace("3", "4"), headers=h)
    problem(changed, 422, "idempotency_key_reused")
    assert calls[t] == 1


async def test_a_custom_fingerprint_chooses_the_fields(served: Any) -> None:
    _, c, calls = served
    t, k = tag(), key()
    first = await c.post(
        "/quotes", json={"tag": t, "sku": "D", "quantity": 1}, headers={"Idempotency-Key": k}
    )
    # Another tag is outside the chosen fields: the same request, replayed.
    other_tag = tag()
    again = await c.post(
        "/quotes",
        json={"tag": other_tag, "sku": "D", "quantity": 1},
        headers={"Idempotency-Key": k},
    )
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    more = await c.post(
        "/quotes", json={"tag": t, "sku": "D", "quantity": 2}, headers={"Idempotency-Key": k}
    )
    problem(more, 422, "idempotency_key_reused")
    assert calls[t] == 1 and calls[other_tag] == 0


async def test_unquoted_keys_and_the_mismatch_status_are_separate_options(served: Any) -> None:
    _, c, calls = served
    t, raw = tag(), f"stripe-{uuid.uuid4().hex}"
    order = {"tag": t, "sku": "E", "quantity": 1}
    first = await c.post("/stripe", json=order, headers={"Idempotency-Key": raw})
    assert first.status_code == 200
    changed = await c.post(
        "/stripe", json={**order, "quantity": 5}, headers={"Idempotency-Key": raw}
    )
    problem(changed, 422, "idempotency_key_reused")  # unquoted keys alone keep 422
    k = key()
    assert (await c.post("/strict-mismatch", json=order, headers={"Idempotency-Key": k})).is_success
    mismatch = await c.post(
        "/strict-mismatch", json={**order, "quantity": 9}, headers={"Idempotency-Key": k}
    )
    problem(mismatch, 400, "idempotency_key_reused")
    assert calls[t] == 2


async def test_unquoted_keys_are_accepted_by_default_and_refused_when_strict(
    served: Any,
) -> None:
    _, c, calls = served
    t, raw = tag(), f"order-A18-{uuid.uuid4().hex}"
    order = {"tag": t, "sku": "U", "quantity": 1}
    h = {"Idempotency-Key": raw}
    first = await c.post("/strict-mismatch", json=order, headers=h)
    again = await c.post("/strict-mismatch", json=order, headers=h)
    quoted = await c.post("/strict-mismatch", json=order, headers={"Idempotency-Key": f'"{raw}"'})
    assert first.status_code == 200 and "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert quoted.headers["idempotent-replayed"] == "true"  # the same key, quoted
    strict = await c.post("/sf-only", json=order, headers=h)
    problem(strict, 400, "idempotency_key_malformed")
    assert calls[t] == 1


async def test_form_endpoints_are_fingerprinted_by_their_bytes(served: Any) -> None:
    _, c, calls = served
    t, k = tag(), key()
    first = await c.post("/form", data={"tag": t, "note": "x"}, headers={"Idempotency-Key": k})
    again = await c.post("/form", data={"tag": t, "note": "x"}, headers={"Idempotency-Key": k})
    assert first.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    changed = await c.post("/form", data={"tag": t, "note": "y"}, headers={"Idempotency-Key": k})
    problem(changed, 422, "idempotency_key_reused")
    assert calls[t] == 1


async def test_a_route_carries_its_own_spec(tmp_path: Path) -> None:
    calls: Counter[str] = Counter()
    gate, entered = asyncio.Event(), asyncio.Event()
    app = make_app(f"sqlite:///{tmp_path / 'idemlock.db'}", calls, gate, entered)
    async with app.router.lifespan_context(app):
        coord = app.state.idem.coordinator
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            t, k = tag(), key()
            order = {"tag": t, "sku": "F", "quantity": 1}
            running = asyncio.create_task(c.post("/refunds", json=order, headers=auth(k=k)))
            await asyncio.wait_for(entered.wait(), 10)
            [held] = [r for r in await coord.keys() if r.spec == "refunds"]
            now = datetime.now(timezone.utc)
            assert held.state == "in_flight"
            assert held.expires_at <= now + timedelta(seconds=5)  # this route's lease: 5 s
            busy = await c.post("/refunds", json=order, headers=auth(k=k))
            problem(busy, 409, "idempotency_key_in_use")
            gate.set()
            assert (await running).status_code == 201
            [done] = [r for r in await coord.keys() if r.spec == "refunds"]
            assert done.state == "completed"
            assert done.expires_at <= now + timedelta(seconds=125)  # ttl 120 s, not 24 h
            assert done.expires_at >= now + timedelta(seconds=60)
    # The lifespan closed the coordinator it opened.
    with pytest.raises(idemlock.ConfigurationError, match="lifespan"):
        app.state.idem.coordinator  # noqa: B018


async def test_a_protected_endpoint_without_install_is_a_configuration_error() -> None:
    idem = Idempotency(coordinator=idemlock.aio.connect("memory://"))
    app = FastAPI()

    @app.post("/x")
    @idem.protect
    async def x() -> dict[str, str]:
        return {}

    transport = httpx.ASGITransport(app=app, raise_app_exceptions=True)
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
        with pytest.raises(idemlock.ConfigurationError, match=r"idem\.install\(app\)"):
            await c.post("/x", headers={"Idempotency-Key": key()})
    with pytest.raises(idemlock.ConfigurationError, match="does not apply"):
        Idempotency(coordinator=idem.coordinator, routes=["/x"])
    await idem.coordinator.close()


# ---- under a real uvicorn ---------------------------------------------------------------


@contextmanager
def uvicorn_thread(app: Any) -> Iterator[str]:
    """``app`` under uvicorn (lifespan on) in a thread on a free loopback port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, lifespan="on", log_level="critical", access_log=False)
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


def test_under_uvicorn_concurrent_duplicates_run_once_and_the_lifespan_opens_and_closes(
    tmp_path: Path,
) -> None:
    calls: Counter[str] = Counter()
    app = make_app(f"sqlite:///{tmp_path / 'idemlock.db'}", calls)
    t, k = tag(), key()
    order = {"tag": t, "sku": "G", "quantity": 1}
    with uvicorn_thread(app) as base:
        assert app.state.idem.coordinator is not None  # opened by uvicorn's lifespan
        with httpx.Client(base_url=base, timeout=20) as c, ThreadPoolExecutor(6) as pool:
            got = list(
                pool.map(lambda _: c.post("/orders", json=order, headers=auth(k=k)), range(6))
            )
            statuses = Counter(r.status_code for r in got)
            assert set(statuses) <= {201, 409} and statuses[201] >= 1
            final = c.post("/orders", json=order, headers=auth(k=k))
            assert final.headers["idempotent-replayed"] == "true"
            invalid = c.post("/orders", json={"tag": t}, headers=auth(k=key()))
            assert (
                invalid.status_code == 422 and invalid.headers["content-type"] == "application/json"
            )
    assert calls[t] == 1
    with pytest.raises(idemlock.ConfigurationError):
        app.state.idem.coordinator  # noqa: B018  (closed at uvicorn's shutdown)


def test_under_uvicorn_unquoted_keys_and_re_encoded_numbers(tmp_path: Path) -> None:
    calls: Counter[str] = Counter()
    app = make_app(f"sqlite:///{tmp_path / 'idemlock.db'}", calls)
    t, raw = tag(), f"order-A18-{uuid.uuid4().hex}"
    h = {**auth(k=raw), "Content-Type": "application/json"}
    with uvicorn_thread(app) as base, httpx.Client(base_url=base, timeout=20) as c:
        first = c.post("/orders", content=f'{{"tag":"{t}","sku":"N","quantity":2}}', headers=h)
        again = c.post("/orders", content=f'{{"quantity":2.0,"sku":"N","tag":"{t}"}}', headers=h)
        strict = c.post("/sf-only", content=f'{{"tag":"{t}","sku":"N","quantity":2}}', headers=h)
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    problem(strict, 400, "idempotency_key_malformed")  # allow_unquoted_key=False
    assert calls[t] == 1


def dead_store_app() -> FastAPI:
    """``uvicorn --factory tests.test_fastapi:dead_store_app``: a store nobody listens on."""
    idem = Idempotency(os.environ["FASTAPI_TEST_STORE"])
    app = FastAPI(lifespan=idem.lifespan)
    idem.install(app)

    @app.post("/charges")
    @idem.protect
    async def charges() -> dict[str, bool]:
        return {"ran": True}

    return app


def test_warnings_reach_stderr_under_uvicorns_default_logging(tmp_path: Path) -> None:
    """uvicorn's default logging configures its own loggers only: idemlock's warning
    about a store that is down (answered 503) must still be seen."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "FASTAPI_TEST_STORE": f"redis://127.0.0.1:{dead}/0?timeout=0.5"}
    err = tmp_path / "stderr"
    with err.open("wb") as stderr:
        proc = popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--factory",
                "tests.test_fastapi:dead_store_app",
                "--port",
                str(port),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=False,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    r = httpx.post(
                        f"http://127.0.0.1:{port}/charges",
                        headers={"Idempotency-Key": key()},
                        timeout=10,
                    )
                    break
                except httpx.TransportError:
                    assert proc.poll() is None, err.read_text()
                    assert time.monotonic() < deadline, "uvicorn did not start"
                    time.sleep(0.1)
            problem(r, 503, "idempotency_store_unavailable")
        finally:
            proc.terminate()
            proc.wait(20)
    logged = err.read_text()
    assert "WARNING idemlock.http: idempotency store failed; answering 503" in logged, logged
    assert "Application startup complete" in logged  # uvicorn's own logging kept working


def test_the_fallback_stays_silent_once_the_application_configures_logging(
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    # caplog's handler on the root logger is an application handler: it gets the record,
    # and idemlock's fallback writes nothing.
    with caplog.at_level(logging.WARNING):
        logging.getLogger("idemlock.http").warning("seen by the application's handler")
    assert "seen by the application's handler" in caplog.text
    assert "seen by the application" not in capsys.readouterr().err


async def test_routers_and_a_second_lifespan(tmp_path: Path) -> None:
    """A protected endpoint of an included APIRouter is documented and served; after the
    lifespan ended and started again (a new coordinator), it works on the new one."""
    from fastapi import APIRouter

    idem = Idempotency(f"sqlite:///{tmp_path / 'idemlock.db'}")
    app = FastAPI(lifespan=idem.lifespan)
    idem.install(app)
    router = APIRouter(prefix="/v1")
    runs: Counter[str] = Counter()

    @router.post("/items/{item}")
    @idem.protect(ttl=60)
    async def item(item: str) -> dict[str, Any]:
        runs[item] += 1
        return {"item": item, "id": uuid.uuid4().hex}

    app.include_router(router)
    op = app.openapi()["paths"]["/v1/items/{item}"]["post"]
    assert any(p["name"] == "Idempotency-Key" for p in op["parameters"])
    assert "application/problem+json" in op["responses"]["409"]["content"]
    k, name = key(), tag()
    bodies = []
    for _ in range(2):
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
                r = await c.post(f"/v1/items/{name}", headers={"Idempotency-Key": k})
                assert r.status_code == 200
                bodies.append(r.content)
    assert bodies[0] == bodies[1] and runs[name] == 1  # the second run replayed


# ---- @idem.protect above the route decorator (issue 21, item 6) ------------------------


def above_app(idem: Idempotency, runs: Counter[str], *, install: bool = True) -> FastAPI:
    """An app whose endpoints are protected from ABOVE their route decorators: on the
    app, on a router included after install(), by a second Idempotency instance."""
    from fastapi import APIRouter

    app = FastAPI(lifespan=idem.lifespan)
    if install:
        idem.install(app)

    @idem.protect
    @app.post("/charges", status_code=201)
    async def charge(order: Order) -> dict[str, Any]:
        runs[order.tag] += 1
        return {"id": uuid.uuid4().hex}

    router = APIRouter(prefix="/v1")

    @idem.protect(ttl=60)
    @router.post("/items/{item}")
    def item(item: str) -> dict[str, Any]:  # sync, in a router included after install
        runs[item] += 1
        return {"id": uuid.uuid4().hex}

    app.include_router(router)
    other = Idempotency(coordinator=idem.coordinator) if idem.url is None else None
    if other is not None:

        @other.protect(require_key=True)
        @app.post("/other")
        async def by_other(order: Order) -> dict[str, Any]:
            runs[order.tag] += 1
            return {"id": uuid.uuid4().hex}

    return app


async def run_twice(c: httpx.AsyncClient, path: str, body: Any = None) -> list[httpx.Response]:
    k = key()
    return [await c.post(path, json=body, headers={"Idempotency-Key": k}) for _ in range(2)]


async def test_protect_above_the_route_decorator_still_protects_the_route(
    tmp_path: Path,
) -> None:
    runs: Counter[str] = Counter()
    # With the lifespan: it finds the routes registered with the bare functions.
    idem = Idempotency(f"sqlite:///{tmp_path / 'idemlock.db'}")
    app = above_app(idem, runs)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            t, name = tag(), tag()
            first, again = await run_twice(c, "/charges", {"tag": t, "sku": "A", "quantity": 1})
            assert first.status_code == again.status_code == 201
            assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
            first, again = await run_twice(c, f"/v1/items/{name}")
            assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert runs[t] == 1 and runs[name] == 1
    op = app.openapi()["paths"]["/v1/items/{item}"]["post"]
    assert any(p["name"] == "Idempotency-Key" for p in op["parameters"])
    # Without the lifespan (a coordinator of one's own), a second Idempotency on the same
    # app: the layer install() added puts the routes right before the first request.
    coord = idemlock.aio.connect(f"sqlite:///{tmp_path / 'other.db'}")
    try:
        app = above_app(Idempotency(coordinator=coord), runs)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            for path in ("/charges", "/other"):
                t = tag()
                first, again = await run_twice(c, path, {"tag": t, "sku": "B", "quantity": 1})
                assert again.headers["idempotent-replayed"] == "true", (path, again.text)
                assert runs[t] == 1, path
            keyless = await c.post("/other", json={"tag": tag(), "sku": "B", "quantity": 1})
            problem(keyless, 400, "idempotency_key_missing")  # the second instance's option
    finally:
        await coord.close()


def test_under_uvicorn_protect_above_the_route_decorator_runs_once(tmp_path: Path) -> None:
    runs: Counter[str] = Counter()
    app = above_app(Idempotency(f"sqlite:///{tmp_path / 'idemlock.db'}"), runs)
    t, name = tag(), tag()
    calls = [("/charges", {"tag": t, "sku": "U", "quantity": 1}), (f"/v1/items/{name}", None)]
    with (
        uvicorn_thread(app) as base,
        httpx.Client(base_url=base, timeout=20) as c,
        ThreadPoolExecutor(4) as pool,
    ):
        for path, body in calls:
            h = {"Idempotency-Key": key()}
            got = list(
                pool.map(lambda _, p=path, b=body, h=h: c.post(p, json=b, headers=h), range(4))
            )
            assert {r.status_code for r in got} <= {200, 201, 409}, [r.text for r in got]
            final = c.post(path, json=body, headers=h)
            assert final.headers["idempotent-replayed"] == "true", final.text
    assert runs[t] == 1 and runs[name] == 1


async def test_the_lifespan_refuses_endpoints_it_cannot_protect(tmp_path: Path) -> None:
    from fastapi import APIRouter

    url = f"sqlite:///{tmp_path / 'idemlock.db'}"
    # Protected from above, and install() forgotten: the app does not start.
    idem = Idempotency(url)
    app = above_app(idem, Counter(), install=False)
    with pytest.raises(idemlock.ConfigurationError, match=r"charge\(\).*idem\.install\(app\)"):
        async with app.router.lifespan_context(app):
            pass
    # A protected endpoint of a router never included: named, with the fix.
    idem = Idempotency(url)
    app = FastAPI(lifespan=idem.lifespan)
    idem.install(app)
    forgotten = APIRouter()

    @forgotten.post("/lost")
    @idem.protect
    async def lost_refund() -> dict[str, Any]:
        return {}

    with pytest.raises(idemlock.ConfigurationError, match=r"lost_refund\(\).*include_router"):
        async with app.router.lifespan_context(app):
            pass
    app.include_router(forgotten)
    async with app.router.lifespan_context(app):
        pass  # once included, it starts


# ---- any endpoint signature FastAPI accepts (issue 21, item 7) --------------------------


class Payment(BaseModel):
    amount: int


async def account(x_account: Annotated[str, Header()]) -> str:
    return x_account


async def payer(request: Request) -> str | None:
    """An identity dependency that takes the Request too."""
    return request.headers.get("x-account")


def signature_app(url: str, runs: Counter[str], tasks: list[str]) -> FastAPI:
    idem = Idempotency(url)
    app = FastAPI(lifespan=idem.lifespan)
    idem.install(app)

    @app.post("/pay/{shop}", status_code=201)
    @idem.protect(identity=payer)
    async def pay(
        shop: str,
        payment: Payment,
        request: Request,
        response: Response,
        background: BackgroundTasks,
        acct: Annotated[str, Depends(account)],
        note: str = "",
        *,
        currency: Annotated[str, Query(max_length=3)] = "EUR",
    ) -> dict[str, Any]:
        runs[shop] += 1
        response.headers["X-Client"] = "seen" if request.client else "none"
        background.add_task(tasks.append, shop)
        return {
            "shop": shop,
            "amount": payment.amount,
            "path": request.url.path,
            "acct": acct,
            "note": note,
            "currency": currency,
            "id": uuid.uuid4().hex,
        }

    @app.post("/sync/{shop}")
    @idem.protect(identity=None)
    def pay_sync(
        shop: str,
        payment: Payment,
        request: Request,
        acct: Annotated[str, Depends(account)],
        *,
        currency: str = "EUR",
    ) -> dict[str, Any]:
        runs[shop] += 1
        return {"shop": shop, "amount": payment.amount, "acct": acct, "host": request.url.path}

    return app


async def test_endpoint_parameter_names_never_collide_with_the_wrappers(tmp_path: Path) -> None:
    runs: Counter[str] = Counter()
    idem = Idempotency(f"sqlite:///{tmp_path / 'idemlock.db'}")
    app = FastAPI(lifespan=idem.lifespan)
    idem.install(app)

    @app.post("/names")
    @idem.protect
    async def names(
        request: str = "r",  # the names the wrapper injects, or injected before
        key: str = "k",
        identity: str = "i",
        idemlock__: str = "q1",
        idemlock_: str = "q2",
        idemlock_request__: str = "q3",
        idemlock_key__: str = "q4",
    ) -> list[str]:
        runs["names"] += 1
        return [request, key, identity, idemlock__, idemlock_, idemlock_request__, idemlock_key__]

    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            h = {"Idempotency-Key": key()}
            q = "/names?request=a&key=b&identity=c&idemlock__=d&idemlock_key__=e"
            first, again = [await c.post(q, headers=h) for _ in range(2)]
            assert first.json() == ["a", "b", "c", "d", "q2", "q3", "e"], first.text
            assert again.headers["idempotent-replayed"] == "true" and runs["names"] == 1


async def test_endpoints_keep_their_own_request_response_and_dependencies(tmp_path: Path) -> None:
    runs: Counter[str] = Counter()
    tasks: list[str] = []
    app = signature_app(f"sqlite:///{tmp_path / 'idemlock.db'}", runs, tasks)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as c:
            shop, k = tag(), key()
            h = {"Idempotency-Key": k, "X-Account": "acct-7"}
            url = f"/pay/{shop}?note=hi&currency=USD"
            first = await c.post(url, json={"amount": 5}, headers=h)
            assert first.status_code == 201, first.text
            doc = first.json()
            assert doc["shop"] == shop and doc["amount"] == 5 and doc["acct"] == "acct-7"
            assert doc["path"] == f"/pay/{shop}" and doc["note"] == "hi"
            assert doc["currency"] == "USD"
            assert first.headers["x-client"] == "seen" and tasks == [shop]
            again = await c.post(url, json={"amount": 5}, headers=h)
            assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
            assert again.headers["x-client"] == "seen"  # the Response parameter's header
            assert runs[shop] == 1 and tasks == [shop]
            # The identity dependency (it takes the Request too): another account runs.
            other = await c.post(url, json={"amount": 5}, headers={**h, "X-Account": "acct-8"})
            assert other.status_code == 201 and "idempotent-replayed" not in other.headers
            assert runs[shop] == 2
            # Validation of the endpoint's own parameters still answers first.
            bad = await c.post(f"/pay/{shop}?currency=EURO", json={"amount": 5}, headers=h)
            assert bad.status_code == 422 and "currency" in bad.text
            # A sync endpoint with its own Request.
            shop = tag()
            first, again = [
                await c.post(f"/sync/{shop}", json={"amount": 3}, headers=h) for _ in range(2)
            ]
            assert first.status_code == 200, first.text
            assert first.json() == {
                "shop": shop,
                "amount": 3,
                "acct": "acct-7",
                "host": f"/sync/{shop}",
            }
            assert again.headers["idempotent-replayed"] == "true" and runs[shop] == 1
    # The OpenAPI document has the endpoint's parameters and the key header, once.
    op = app.openapi()["paths"]["/pay/{shop}"]["post"]
    names = [p["name"] for p in op["parameters"]]
    assert names.count("Idempotency-Key") == 1
    assert {"shop", "note", "currency", "x-account"} <= set(names)


# ---- protect is typed (issue 21, item 9) -------------------------------------------------


def docs_app_example() -> str:
    """The application of docs/fastapi.md, as its reader copies it."""
    text = (ROOT / "docs" / "fastapi.md").read_text()
    start = text.index("```python\n# app.py") + len("```python\n")
    return text[start : text.index("```", start)]


#: A program that misspells an option of protect() (``requier_key``).
MISSPELT = """
from fastapi import FastAPI

from idemlock.integrations.fastapi import Idempotency

idem = Idempotency("memory://")
app = FastAPI(lifespan=idem.lifespan)


@app.post("/x")
@idem.protect(ttl=60, requier_key=True)
async def x() -> dict[str, int]:
    return {}
"""


def test_protect_is_typed_for_users_strict_mypy(tmp_path: Path) -> None:
    """The docs' application passes ``mypy --strict`` as it stands (protect keeps the
    endpoint's type: no "untyped decorator"), and a misspelt option is a type error."""
    (tmp_path / "app.py").write_text(docs_app_example())
    typed = """
from collections.abc import Awaitable, Callable

from app import Charge, create_charge, refund

charge: Callable[[Charge], Awaitable[dict[str, object]]] = create_charge
again: Callable[[Charge], Awaitable[dict[str, object]]] = refund
"""
    (tmp_path / "uses.py").write_text(typed)
    (tmp_path / "misspelt.py").write_text(MISSPELT)
    files = ["app.py", "uses.py", "misspelt.py"]
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", *files],
        cwd=tmp_path,  # outside the repository: none of its mypy configuration applies
        env={**os.environ, "MYPYPATH": str(ROOT / "src")},  # this tree's idemlock
        capture_output=True,
        text=True,
        check=False,
    )
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert all(line.startswith("misspelt.py:") for line in errors), out.stdout + out.stderr
    assert any('Unexpected keyword argument "requier_key"' in e for e in errors), out.stdout


def test_a_misspelt_option_is_a_type_error_at_runtime() -> None:
    idem = Idempotency(coordinator=idemlock.aio.connect("memory://"))
    with pytest.raises(TypeError, match="requier_key"):
        idem.protect(requier_key=True)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="routes"):
        idem.protect(routes=["/x"])  # type: ignore[call-overload]
