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
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Form, Header, HTTPException
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
    # Unprotected routes are untouched.
    open_op = doc["paths"]["/open"]["post"]
    assert all(p["name"] != "Idempotency-Key" for p in open_op.get("parameters", []))
    assert set(open_op["responses"]) == {"200", "422"}
    assert "x-idemlock" not in repr(doc)  # the marker that found the routes is gone


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
    unquoted = await c.post("/strict-mismatch", json=order, headers={"Idempotency-Key": raw})
    problem(unquoted, 400, "idempotency_key_malformed")  # a 400 mismatch alone keeps quotes
    k = key()
    assert (await c.post("/strict-mismatch", json=order, headers={"Idempotency-Key": k})).is_success
    mismatch = await c.post(
        "/strict-mismatch", json={**order, "quantity": 9}, headers={"Idempotency-Key": k}
    )
    problem(mismatch, 400, "idempotency_key_reused")
    assert calls[t] == 2


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
