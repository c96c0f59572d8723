"""The Flask extension (idemlock.integrations.flask): an app factory with ``init_app``
and ``@idem.protect`` served by a real gunicorn with several workers and concurrent
duplicates, and Flask's test client for the configuration paths; records in SQLite."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from flask import Flask, abort, request

import idemlock
from idemlock.integrations.flask import Idempotency, IdempotencyState

from .test_wsgi import ROOT, Gunicorn, problem, start_gunicorn

# ---- the application gunicorn serves ---------------------------------------------------

idem = Idempotency()


def create_app() -> Flask:
    """The gunicorn entry point (``tests.test_flask:create_app()``): an app factory."""
    import time

    runs = Path(os.environ["WSGI_TEST_RUNS"])
    app = Flask(__name__)
    app.config["IDEMLOCK_URL"] = os.environ["WSGI_TEST_STORE"]
    app.config["IDEMLOCK_IDENTITY"] = "header:X-Client"
    app.config["IDEMLOCK_ALLOW_ANONYMOUS"] = True
    app.config["IDEMLOCK_SPEC"] = {"name": "flask", "ttl": 3600, "lease": 30}
    idem.init_app(app)

    @app.post("/charges")
    @idem.protect
    def charges() -> Any:
        data = request.get_json()
        with runs.open("a") as f:  # O_APPEND: one whole line per run, any worker
            f.write(f"{data['tag']}\n")
        time.sleep(float(data.get("sleep", 0)))
        return {"tag": data["tag"], "pid": os.getpid(), "id": uuid.uuid4().hex}, 201

    return app


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gunicorn]:
    tmp = tmp_path_factory.mktemp("flask")
    yield from start_gunicorn(
        f"sqlite:///{tmp / 'idemlock.db'}", tmp / "runs", app="tests.test_flask:create_app()"
    )


def test_concurrent_duplicates_under_gunicorn_run_the_view_once(server: Gunicorn) -> None:
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
        else:
            assert r.headers["idempotent-replayed"] == "true"
            assert r.content == firsts[0].content
    again = server.post(key, body, client="a")
    assert again.headers["idempotent-replayed"] == "true" and again.content == firsts[0].content
    # Another caller has its own key space; another body under the key is 422.
    assert server.post(key, body, client="b").status_code == 201
    problem(server.post(key, {"tag": tag, "x": 1}, client="a"), 422, "idempotency_key_reused")
    assert server.count(tag) == 2


def test_an_unquoted_key_and_re_encoded_numbers_under_gunicorn(server: Gunicorn) -> None:
    tag, raw = uuid.uuid4().hex, f"order-A18-{uuid.uuid4().hex}"
    h = {"Idempotency-Key": raw, "Content-Type": "application/json", "X-Client": "a"}
    url = f"{server.url}/charges"
    first = httpx.post(url, content=f'{{"tag":"{tag}","amount":1200}}', headers=h)
    again = httpx.post(url, content=f'{{"amount":1200.0,"tag":"{tag}"}}', headers=h)
    assert first.status_code == 201 and "idempotent-replayed" not in first.headers
    assert again.headers["idempotent-replayed"] == "true" and again.content == first.content
    assert server.count(tag) == 1


# ---- configuration, through Flask's test client ----------------------------------------


def make_app(tmp_path: Path, ext: Idempotency | None = None, **config: Any) -> Flask:
    app = Flask(__name__)
    app.config["IDEMLOCK_URL"] = f"sqlite:///{tmp_path / 'idemlock.db'}"
    app.config.update(config)
    ext = ext or Idempotency()
    ext.init_app(app)
    calls: Counter[str] = Counter()
    app.config["CALLS"] = calls

    @app.post("/charges")
    @ext.protect
    def charges() -> Any:
        tag = request.get_json()["tag"]
        calls[tag] += 1
        return {"tag": tag, "run": calls[tag], "id": uuid.uuid4().hex}, 201

    @app.post("/missing")
    @ext.protect(ttl=60, require_key=True, identity=None)
    def missing() -> Any:
        tag = request.get_json()["tag"]
        calls[tag] += 1
        abort(404)

    @app.post("/boom")
    @ext.protect(identity=None)
    def boom() -> Any:
        calls[request.get_json()["tag"]] += 1
        raise RuntimeError("boom")

    @app.post("/stream")
    @ext.protect(identity=None)
    def stream() -> Any:
        tag = request.get_json()["tag"]
        calls[tag] += 1

        def parts() -> Iterator[str]:
            yield "part-1-"
            yield f"run-{calls[tag]}"

        return app.response_class(parts(), status=201, mimetype="text/plain")

    return app


def post(app: Flask, path: str, key: str | None, body: dict[str, Any], **headers: str) -> Any:
    if key is not None:
        headers["Idempotency-Key"] = key
    return app.test_client().post(path, json=body, headers=headers)


def test_init_app_reads_app_config_and_registers_the_extension(tmp_path: Path) -> None:
    app = make_app(tmp_path, IDEMLOCK_IDENTITY="header:X-Api-Key", IDEMLOCK_SPEC="payments")
    state = app.extensions["idemlock"]
    assert isinstance(state, IdempotencyState) and state.owned
    key, tag = f"k-{uuid.uuid4().hex}", uuid.uuid4().hex
    first = post(app, "/charges", key, {"tag": tag}, **{"X-Api-Key": "alice"})
    again = post(app, "/charges", key, {"tag": tag}, **{"X-Api-Key": "alice"})
    assert first.status_code == 201 and "Idempotent-Replayed" not in first.headers
    assert again.headers["Idempotent-Replayed"] == "true" and again.data == first.data
    # IDEMLOCK_IDENTITY is set: a request without the header is 401, not anonymous.
    anon = post(app, "/charges", key, {"tag": tag})
    assert anon.status_code == 401 and anon.json["code"] == "idempotency_identity_missing"
    assert app.config["CALLS"][tag] == 1
    # The records are under the configured spec.
    with idemlock.connect(app.config["IDEMLOCK_URL"]) as coord:
        records = coord.keys()
    assert {r.spec for r in records} == {"payments"}


def test_a_misspelt_setting_says_which_was_meant(tmp_path: Path) -> None:
    with pytest.raises(idemlock.ConfigurationError, match=r"IDEMLOCK_REQUIER_KEY.*REQUIRE_KEY"):
        make_app(tmp_path, IDEMLOCK_REQUIER_KEY=True)
    with pytest.raises(idemlock.ConfigurationError, match="max_body must be a positive int"):
        make_app(tmp_path, IDEMLOCK_MAX_BODY=0)
    with pytest.raises(idemlock.ConfigurationError, match="IDEMLOCK_URL"):
        Idempotency(Flask(__name__))
    with pytest.raises(idemlock.ConfigurationError, match="did you mean 'require_key'"):
        Idempotency().protect(requier_key=True)  # type: ignore[call-overload]


def test_one_extension_serves_several_apps_with_their_own_config(tmp_path: Path) -> None:
    ext = Idempotency()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    strict = make_app(tmp_path / "a", ext, IDEMLOCK_ALLOW_UNQUOTED_KEY=False)
    liberal = make_app(tmp_path / "b", ext)
    tag, raw = uuid.uuid4().hex, f"order-A18-{uuid.uuid4().hex}"
    refused = post(strict, "/charges", raw, {"tag": tag})
    assert refused.status_code == 400 and refused.json["code"] == "idempotency_key_malformed"
    assert post(strict, "/charges", f'"{raw}"', {"tag": tag}).status_code == 201
    first = post(liberal, "/charges", raw, {"tag": tag})
    again = post(liberal, "/charges", f'"{raw}"', {"tag": tag})
    assert first.status_code == 201 and again.headers["Idempotent-Replayed"] == "true"
    assert strict.config["CALLS"][tag] == 1 and liberal.config["CALLS"][tag] == 1
    assert strict.extensions["idemlock"] is not liberal.extensions["idemlock"]
    ext.close()


def test_view_options_abort_exceptions_and_streams(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    tag = uuid.uuid4().hex
    # require_key for this view only; abort(404) is recorded as the 404 it answers.
    problem_missing = post(app, "/missing", None, {"tag": tag})
    assert problem_missing.status_code == 400
    assert problem_missing.json["code"] == "idempotency_key_missing"
    key = f"k-{uuid.uuid4().hex}"
    assert post(app, "/missing", key, {"tag": tag}).status_code == 404
    replay = post(app, "/missing", key, {"tag": tag})
    assert replay.status_code == 404 and replay.headers["Idempotent-Replayed"] == "true"
    assert app.config["CALLS"][tag] == 1
    # A view that raises records nothing: the retry runs again.
    app.config["PROPAGATE_EXCEPTIONS"] = False
    key, tag = f"k-{uuid.uuid4().hex}", uuid.uuid4().hex
    assert post(app, "/boom", key, {"tag": tag}).status_code == 500
    assert post(app, "/boom", key, {"tag": tag}).status_code == 500
    assert app.config["CALLS"][tag] == 2
    # A streamed response is recorded whole and replayed.
    key, tag = f"k-{uuid.uuid4().hex}", uuid.uuid4().hex
    first = post(app, "/stream", key, {"tag": tag})
    assert first.status_code == 201 and first.data == b"part-1-run-1"
    again = post(app, "/stream", key, {"tag": tag})
    assert again.headers["Idempotent-Replayed"] == "true" and again.data == first.data
    assert app.config["CALLS"][tag] == 1


def test_an_applications_own_coordinator_closes_with_it(tmp_path: Path) -> None:
    import gc

    ext = Idempotency()
    app = make_app(tmp_path, ext)
    coordinator = app.extensions["idemlock"].coordinator
    coordinator.idempotency("x").status("k")  # open
    del app
    gc.collect()
    with pytest.raises(idemlock.StoreUnavailable, match="closed"):
        coordinator.idempotency("x").status("k")
    given = idemlock.connect(f"sqlite:///{tmp_path / 'given.db'}")
    app = Flask(__name__)
    app.config["IDEMLOCK_COORDINATOR"] = given
    ext.init_app(app)
    assert not app.extensions["idemlock"].owned
    del app
    gc.collect()
    assert given.idempotency("x").status("k") is None  # yours: left open
    given.close()


def test_a_protected_view_without_the_extension_says_so(tmp_path: Path) -> None:
    ext = Idempotency()
    app = Flask(__name__)
    app.config["PROPAGATE_EXCEPTIONS"] = True

    @app.post("/x")
    @ext.protect
    def x() -> Any:
        return "ok"

    with pytest.raises(idemlock.ConfigurationError, match="init_app"):
        app.test_client().post("/x", headers={"Idempotency-Key": "k"})


def test_a_claim_whose_view_gave_no_response_is_freed(tmp_path: Path) -> None:
    ext = Idempotency()
    app = make_app(tmp_path, ext)
    key, tag = f"k-{uuid.uuid4().hex}", uuid.uuid4().hex

    @app.post("/interrupted")
    @ext.protect(identity=None)
    def interrupted() -> Any:
        app.config["CALLS"][tag] += 1
        raise KeyboardInterrupt  # ends the request without a response or an exception page

    with pytest.raises(KeyboardInterrupt):
        post(app, "/interrupted", key, {"tag": tag})
    with pytest.raises(KeyboardInterrupt):
        post(app, "/interrupted", key, {"tag": tag})  # not 409: the claim was freed
    assert app.config["CALLS"][tag] == 2
    ext.close()


MYPY_APP = """
from typing import Any

from flask import Flask

from idemlock.integrations.flask import Idempotency

idem = Idempotency()
app = Flask(__name__)
idem.init_app(app)


@app.post("/charges")
@idem.protect
def charge() -> dict[str, int]:
    return {"amount": 1}


@app.post("/refunds")
@idem.protect(ttl=60, require_key=True)
def refund(order_id: int) -> tuple[dict[str, Any], int]:
    return {"id": order_id}, 201


kept: dict[str, int] = charge()
also: tuple[dict[str, Any], int] = refund(3)
"""


def test_protect_is_typed_for_users_strict_mypy(tmp_path: Path) -> None:
    (tmp_path / "app.py").write_text(MYPY_APP)
    (tmp_path / "misspelt.py").write_text(
        "from idemlock.integrations.flask import Idempotency\n\n"
        "@Idempotency().protect(requier_key=True)\ndef view() -> str:\n    return ''\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "app.py", "misspelt.py"],
        cwd=tmp_path,  # outside the repository: none of its mypy configuration applies
        env={**os.environ, "MYPYPATH": str(ROOT / "src")},  # this tree's idemlock
        capture_output=True,
        text=True,
        check=False,
    )
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert all(line.startswith("misspelt.py:") for line in errors), out.stdout + out.stderr
    assert any("requier_key" in e for e in errors), out.stdout
