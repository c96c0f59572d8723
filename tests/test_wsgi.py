"""The WSGI Idempotency-Key middleware on a Flask app served by a real gunicorn with
several worker processes, its records in a shared SQLite file; the handler counts its
runs in a file, so runs in any worker are seen."""

from __future__ import annotations

import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from .servers._proc import popen
from .servers.proxy import TcpProxy

ROOT = Path(__file__).resolve().parent.parent


def create_app() -> Any:
    """The gunicorn entry point (``tests.test_wsgi:create_app()``)."""
    from datetime import timedelta

    from flask import Flask, request

    import idemlock
    from idemlock.integrations.wsgi import IdempotencyMiddleware, environ_header_identity

    runs = Path(os.environ["WSGI_TEST_RUNS"])
    app = Flask(__name__)

    @app.post("/charges")
    def charges() -> Any:
        data = request.get_json()
        with runs.open("a") as f:  # O_APPEND: one whole line per run, any worker
            f.write(f"{data['tag']}\n")
        time.sleep(float(data.get("sleep", 0)))
        status = int(data.get("status", 201))
        return {"tag": data["tag"], "pid": os.getpid(), "id": uuid.uuid4().hex}, status

    @app.post("/stream")
    def stream() -> Any:
        data = request.get_json()
        with runs.open("a") as f:
            f.write(f"{data['tag']}\n")
        size = int(data["size"])

        def chunks() -> Iterator[bytes]:
            for _ in range(size // 1000):
                yield b"x" * 1000

        return app.response_class(chunks(), status=201, mimetype="text/plain")

    spec = idemlock.IdempotencySpec("http", ttl=timedelta(hours=1), lease=timedelta(seconds=30))
    flask_app = app.wsgi_app

    def dispatch(environ: dict[str, Any], start_response: Any) -> Any:
        if environ["PATH_INFO"] != "/raw-write":
            return flask_app(environ, start_response)
        # A plain WSGI app using PEP 3333's legacy write() before its iterable.
        tag = environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"])).decode()
        with runs.open("a") as f:
            f.write(f"{tag}\n")
        write = start_response("201 Created", [("Content-Type", "text/plain")])
        write(b"written-")
        return [b"iterated-", uuid.uuid4().hex.encode()]

    app.wsgi_app = IdempotencyMiddleware(  # type: ignore[method-assign]
        dispatch,
        coordinator=idemlock.connect(os.environ["WSGI_TEST_STORE"]),
        spec=spec,
        identity=environ_header_identity("x-client"),
        allow_anonymous=True,  # requests without X-Client share the anonymous space
        max_body=64 * 1024,
        max_response_body=16 * 1000,
    )
    return app


@dataclass
class Gunicorn:
    url: str
    runs: Path

    def count(self, tag: str) -> int:
        if not self.runs.exists():
            return 0
        return self.runs.read_text().split().count(tag)

    def post(
        self, key: str | None, body: dict[str, Any], client: str | None = None
    ) -> httpx.Response:
        headers = {} if client is None else {"x-client": client}
        if key is not None:
            headers["Idempotency-Key"] = f'"{key}"'
        return httpx.post(f"{self.url}/charges", json=body, headers=headers, timeout=20)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_gunicorn(
    store: str,
    runs: Path,
    workers: int = 3,
    preload: bool = False,
    app: str = "tests.test_wsgi:create_app()",
) -> Iterator[Gunicorn]:
    port = free_port()
    env = dict(os.environ, WSGI_TEST_STORE=store, WSGI_TEST_RUNS=str(runs))
    proc = popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            str(workers),
            "--threads",
            "4",
            "--log-level",
            "warning",
            *(["--preload"] if preload else []),
            app,
        ],
        cwd=ROOT,
        env=env,
        start_new_session=False,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        assert proc.poll() is None, "gunicorn exited"
        try:
            httpx.get(f"{url}/", timeout=1)
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline, "gunicorn did not start"
            time.sleep(0.1)
    try:
        yield Gunicorn(url, runs)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="module", params=["app-per-worker", "preload"])
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Gunicorn]:
    # "preload": the app and its coordinator are made in the master, then forked.
    tmp = tmp_path_factory.mktemp("wsgi")
    yield from start_gunicorn(
        f"sqlite:///{tmp / 'idemlock.db'}", tmp / "runs", preload=request.param == "preload"
    )


def problem(response: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/problem+json"
    doc: dict[str, Any] = response.json()
    assert doc["status"] == status and doc["code"] == code
    return doc


def test_concurrent_duplicates_across_workers_run_the_handler_once(server: Gunicorn) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    body = {"tag": tag, "sleep": 1.0}
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: server.post(key, body, client="a"), range(8)))
    assert server.count(tag) == 1
    firsts = [
        r for r in responses if r.status_code == 201 and "idempotent-replayed" not in r.headers
    ]
    assert len(firsts) == 1
    for r in responses:
        if r is firsts[0]:
            continue
        if r.status_code == 409:
            problem(r, 409, "idempotency_key_in_use")
            assert r.headers["retry-after"] == "1"
        else:
            assert r.status_code == 201 and r.headers["idempotent-replayed"] == "true"
            assert r.content == firsts[0].content
    assert any(r.status_code == 409 for r in responses)
    # After completion every retry is the replay, byte for byte.
    again = server.post(key, body, client="a")
    assert again.status_code == 201 and again.headers["idempotent-replayed"] == "true"
    assert again.content == firsts[0].content
    assert server.count(tag) == 1


def test_different_body_with_the_same_key_is_422(server: Gunicorn) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    assert server.post(key, {"tag": tag}, client="a").status_code == 201
    problem(server.post(key, {"tag": tag, "extra": 1}, client="a"), 422, "idempotency_key_reused")
    assert server.count(tag) == 1


def test_keys_are_per_identity(server: Gunicorn) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    a = server.post(key, {"tag": tag}, client="a")
    b = server.post(key, {"tag": tag}, client="b")
    assert a.status_code == b.status_code == 201
    assert "idempotent-replayed" not in b.headers and a.json()["id"] != b.json()["id"]
    assert server.count(tag) == 2


def test_an_unquoted_key_is_the_same_key_as_its_quoted_form(server: Gunicorn) -> None:
    # Idempotency-Key: order-A18, as Stripe's SDKs and most clients send it.
    tag, raw = uuid.uuid4().hex, f"order-A18-{uuid.uuid4().hex}"
    sent = [
        httpx.post(f"{server.url}/charges", json={"tag": tag}, headers={"Idempotency-Key": k})
        for k in (raw, raw, f'"{raw}"')
    ]
    assert sent[0].status_code == 201 and "idempotent-replayed" not in sent[0].headers
    for again in sent[1:]:
        assert again.headers["idempotent-replayed"] == "true"
        assert again.content == sent[0].content
    assert server.count(tag) == 1


def test_5xx_is_not_recorded_and_a_retry_runs_again(server: Gunicorn) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    body = {"tag": tag, "status": 500}
    assert server.post(key, body).status_code == 500
    assert server.post(key, body).status_code == 500
    assert server.count(tag) == 2


def test_malformed_key_is_400_and_no_key_passes_through(server: Gunicorn) -> None:
    tag = uuid.uuid4().hex
    bad = httpx.post(
        f"{server.url}/charges", json={"tag": tag}, headers={"Idempotency-Key": '"unterminated'}
    )
    problem(bad, 400, "idempotency_key_malformed")
    assert server.count(tag) == 0
    assert server.post(None, {"tag": tag}).status_code == 201
    assert server.post(None, {"tag": tag}).status_code == 201
    assert server.count(tag) == 2


def test_a_store_that_is_down_is_503_and_the_handler_does_not_run(tmp_path: Path) -> None:
    # A Redis URL on a port nobody listens on: every store call fails.
    store = f"redis://127.0.0.1:{free_port()}/0?timeout=0.5"
    for srv in start_gunicorn(store, tmp_path / "runs", workers=1):
        tag = uuid.uuid4().hex
        r = srv.post(uuid.uuid4().hex, {"tag": tag})
        problem(r, 503, "idempotency_store_unavailable")
        assert r.headers["retry-after"] == "1"
        assert srv.count(tag) == 0


def test_a_streamed_response_is_replayed_whole_and_one_over_the_limit_is_not(
    server: Gunicorn,
) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    url = f"{server.url}/stream"
    headers = {"Idempotency-Key": f'"{key}"'}
    first = httpx.post(url, json={"tag": tag, "size": 10_000}, headers=headers)
    again = httpx.post(url, json={"tag": tag, "size": 10_000}, headers=headers)
    assert first.status_code == again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true" and again.content == b"x" * 10_000
    big_key, big = uuid.uuid4().hex, uuid.uuid4().hex
    headers = {"Idempotency-Key": f'"{big_key}"'}
    first = httpx.post(url, json={"tag": big, "size": 20_000}, headers=headers)
    assert first.status_code == 201 and first.content == b"x" * 20_000  # delivered whole
    doc = problem(
        httpx.post(url, json={"tag": big, "size": 20_000}, headers=headers),
        409,
        "idempotency_response_unavailable",
    )
    assert doc["original_status"] == 201
    assert server.count(tag) == server.count(big) == 1


def test_a_failure_to_record_keeps_the_claim_and_the_record_is_written_later(
    tmp_path: Path, redis_server: Any
) -> None:
    with TcpProxy(redis_server.port) as proxy:
        # 2 s: what the blackholed write waits; the calls before it go through the
        # proxy in milliseconds, with a wide margin on a busy machine.
        store = f"redis://127.0.0.1:{proxy.port}/0?timeout=2"
        for srv in start_gunicorn(store, tmp_path / "runs", workers=1):
            key, tag = uuid.uuid4().hex, uuid.uuid4().hex
            body = {"tag": tag, "sleep": 1.0}
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(srv.post, key, body)
                deadline = time.monotonic() + 10
                while srv.count(tag) == 0:  # the handler runs: the claim is taken
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                proxy.blackhole()  # the store goes silent before the record is written
                first = pending.result(timeout=60)
            assert first.status_code == 201  # delivered although not recorded
            problem(srv.post(key, body), 503, "idempotency_store_unavailable")
            proxy.heal()
            deadline = time.monotonic() + 10
            while True:
                r = srv.post(key, body)
                if r.status_code == 201:
                    break
                problem(r, 409, "idempotency_key_in_use")  # the claim is kept meanwhile
                assert time.monotonic() < deadline, "the record was never written"
                time.sleep(0.1)
            assert r.headers["idempotent-replayed"] == "true" and r.content == first.content
            assert srv.count(tag) == 1


def test_an_unknown_option_is_a_configuration_error_naming_the_options() -> None:
    import idemlock
    from idemlock.integrations.wsgi import IdempotencyMiddleware

    coord = idemlock.connect("memory://")
    with pytest.raises(idemlock.ConfigurationError, match=r"max_bdy.*allow_anonymous"):
        IdempotencyMiddleware(lambda e, s: [], coordinator=coord, max_bdy=10)
    with pytest.raises(idemlock.ConfigurationError, match="max_body must be a positive int"):
        IdempotencyMiddleware(lambda e, s: [], coordinator=coord, max_body=0)
    with pytest.raises(idemlock.ConfigurationError, match=r"blocking idemlock\.Coordinator"):
        IdempotencyMiddleware(lambda e, s: [], coordinator=object())  # type: ignore[arg-type]


def test_bytes_sent_with_the_legacy_write_callable_are_recorded(server: Gunicorn) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    headers = {"Idempotency-Key": f'"{key}"', "Content-Type": "text/plain"}
    first = httpx.post(f"{server.url}/raw-write", content=tag, headers=headers)
    assert first.status_code == 201 and first.content.startswith(b"written-iterated-")
    again = httpx.post(f"{server.url}/raw-write", content=tag, headers=headers)
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert server.count(tag) == 1


def test_a_response_closed_before_it_was_iterated_frees_its_key(tmp_path: Path) -> None:
    # What a server does when the client left before the body was read: close() only.
    import io

    import idemlock
    from idemlock.integrations.wsgi import IdempotencyMiddleware

    ran: list[int] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        ran.append(1)
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"done"]

    coord = idemlock.connect(f"sqlite:///{tmp_path / 'idemlock.db'}")
    mw = IdempotencyMiddleware(app, coordinator=coord)

    def call() -> Any:
        environ = {
            "REQUEST_METHOD": "POST",
            "PATH_INFO": "/x",
            "CONTENT_LENGTH": "2",
            "wsgi.input": io.BytesIO(b"{}"),
            "HTTP_IDEMPOTENCY_KEY": '"k"',
        }
        got: list[str] = []
        body = mw(environ, lambda status, headers, exc=None: got.append(status))
        return body, got

    body, _ = call()
    body.close()  # never iterated: the claim must not stay in flight
    body, got = call()
    assert b"".join(body) == b"done" and got == ["201 Created"]
    body.close()
    assert ran == [1]
    body, got = call()
    assert b"".join(body) == b"done" and ran == [1]  # the replay
    coord.close()


def test_the_same_json_in_another_layout_is_the_same_request(server: Gunicorn) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    h = {"Idempotency-Key": f'"{key}"', "Content-Type": "application/json", "X-Client": "a"}

    def post(body: str) -> httpx.Response:
        return httpx.post(f"{server.url}/charges", content=body, headers=h, timeout=20)

    first = post(f'{{"tag":"{tag}","status":201}}')
    again = post(f'{{\n  "status": 201,\n  "tag": "{tag}"\n}}')
    assert first.status_code == 201
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    problem(post(f'{{"tag":"{tag}","status":202}}'), 422, "idempotency_key_reused")
    assert server.count(tag) == 1


def test_with_an_identity_a_request_without_one_is_401_by_default() -> None:
    import io

    import idemlock
    from idemlock.integrations.wsgi import IdempotencyMiddleware, environ_header_identity

    ran: list[int] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        ran.append(1)
        start_response("201 Created", [("Content-Type", "text/plain")])
        return [b"done"]

    coord = idemlock.connect("memory://")
    mw = IdempotencyMiddleware(app, coordinator=coord, identity=environ_header_identity("x-c"))
    got: list[str] = []
    environ = {
        "REQUEST_METHOD": "POST",
        "PATH_INFO": "/x",
        "CONTENT_LENGTH": "2",
        "wsgi.input": io.BytesIO(b"{}"),
        "HTTP_IDEMPOTENCY_KEY": '"k"',
    }
    body = b"".join(mw(environ, lambda status, headers, exc=None: got.append(status)))
    assert got == ["401 Unauthorized"] and b"idempotency_identity_missing" in body
    assert ran == []
    coord.close()
