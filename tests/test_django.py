"""The Django middleware and view decorator, configured by settings.IDEMLOCK of the
project in tests/django_app: with Django's test client, and under a real gunicorn with
two worker processes and concurrent duplicates; records in a shared SQLite file."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from .servers._proc import mkdtemp, popen

_TMP = mkdtemp("idemlock-django-")  # removed at exit (tests/servers/_proc.py)
os.environ["DJANGO_SETTINGS_MODULE"] = "tests.django_app.settings"
os.environ["DJANGO_TEST_STORE"] = f"sqlite:///{_TMP / 'idemlock.db'}"
os.environ["DJANGO_TEST_RUNS"] = str(_TMP / "runs")
os.environ["DJANGO_TEST_DB"] = str(_TMP / "django.sqlite3")
# A Redis URL on a port nobody listens on (bound, never listening): every call fails.
_DEAD = __import__("socket").socket()
_DEAD.bind(("127.0.0.1", 0))
os.environ["DJANGO_TEST_DEAD_STORE"] = f"redis://127.0.0.1:{_DEAD.getsockname()[1]}/0?timeout=0.5"

import django  # noqa: E402

django.setup()

from django.test import Client  # noqa: E402

from .test_wsgi import free_port  # noqa: E402

RUNS = _TMP / "runs"


def count(tag: str) -> int:
    return RUNS.read_text().split().count(tag) if RUNS.exists() else 0


def post(client: Client, path: str, key: str | None, body: dict[str, Any], **headers: str) -> Any:
    if key is not None:
        headers["Idempotency-Key"] = f'"{key}"'
    return client.post(path, body, content_type="application/json", headers=headers)


def problem(response: Any, status: int, code: str) -> dict[str, Any]:
    assert response.status_code == status, response.content
    assert response["Content-Type"] == "application/problem+json"
    doc: dict[str, Any] = response.json()
    assert doc["status"] == status and doc["code"] == code
    return doc


@pytest.fixture
def client() -> Client:
    return Client()


def test_middleware_replays_and_refuses_another_body(client: Client) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    first = post(client, "/mw/charges", key, {"tag": tag}, x_user="alice")
    assert first.status_code == 201 and "Idempotent-Replayed" not in first
    again = post(client, "/mw/charges", key, {"tag": tag}, x_user="alice")
    assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    problem(
        post(client, "/mw/charges", key, {"tag": tag, "x": 1}, x_user="alice"),
        422,
        "idempotency_key_reused",
    )
    assert count(tag) == 1


def test_an_unquoted_key_is_accepted_as_its_quoted_form(client: Client) -> None:
    raw, tag = f"order-A18-{uuid.uuid4().hex}", uuid.uuid4().hex
    sent = [
        client.post(
            "/mw/charges",
            {"tag": tag},
            content_type="application/json",
            headers={"Idempotency-Key": k, "x_user": "alice"},
        )
        for k in (raw, raw, f'"{raw}"')
    ]
    assert sent[0].status_code == 201 and "Idempotent-Replayed" not in sent[0]
    assert all(r["Idempotent-Replayed"] == "true" for r in sent[1:])
    assert count(tag) == 1


def test_middleware_records_a_streamed_response_and_replays_it_whole(client: Client) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    first = post(client, "/mw/stream", key, {"tag": tag}, x_user="alice")
    body = b"".join(first.streaming_content)
    assert first.status_code == 201 and body.startswith(b"part-1-part-2-")
    again = post(client, "/mw/stream", key, {"tag": tag}, x_user="alice")
    assert again["Idempotent-Replayed"] == "true" and again.content == body
    assert count(tag) == 1


def test_a_streamed_response_closed_unread_frees_its_key(client: Client) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    post(client, "/mw/stream", key, {"tag": tag}, x_user="alice").close()  # never read
    again = post(client, "/mw/stream", key, {"tag": tag}, x_user="alice")
    assert again.status_code == 201 and "Idempotent-Replayed" not in again
    assert b"".join(again.streaming_content).startswith(b"part-1-")
    assert count(tag) == 2


@pytest.fixture(scope="module")
def users() -> list[Any]:
    from django.contrib.auth.models import User
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    return [User.objects.create_user(f"user-{uuid.uuid4().hex[:8]}") for _ in range(2)]


def test_identity_is_the_logged_in_django_user(users: list[Any]) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    alice, bob = Client(), Client()
    alice.force_login(users[0])
    bob.force_login(users[1])
    first = post(alice, "/mw/charges", key, {"tag": tag})
    assert first.status_code == 201
    again = post(alice, "/mw/charges", key, {"tag": tag})
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    other = post(bob, "/mw/charges", key, {"tag": tag})
    assert other.status_code == 201 and "Idempotent-Replayed" not in other
    # With an identity configured, a request without one is refused (no shared
    # anonymous key space by default), and the view does not run.
    anonymous = post(Client(), "/mw/charges", key, {"tag": tag})
    problem(anonymous, 401, "idempotency_identity_missing")
    assert count(tag) == 2


def test_middleware_keys_are_per_request_user(client: Client) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    a = post(client, "/mw/charges", key, {"tag": tag}, x_user="alice")
    b = post(client, "/mw/charges", key, {"tag": tag}, x_user="bob")
    assert a.status_code == b.status_code == 201 and "Idempotent-Replayed" not in b
    assert count(tag) == 2


def test_middleware_does_not_record_5xx_and_passes_routes_outside_its_set(
    client: Client,
) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    for _ in range(2):
        r = post(client, "/mw/charges", key, {"tag": tag, "status": 503}, x_user="alice")
        assert r.status_code == 503
    assert count(tag) == 2
    problem(
        client.post(
            "/mw/charges",
            {},
            content_type="application/json",
            headers={"Idempotency-Key": "no quotes"},
        ),
        400,
        "idempotency_key_malformed",
    )


def test_view_decorator_uses_its_api_key_identity_and_abandons_on_exception(
    client: Client,
) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    first = post(client, "/single", key, {"tag": tag}, x_api_key="k1")
    assert first.status_code == 201
    again = post(client, "/single", key, {"tag": tag}, x_api_key="k1")
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    other = post(client, "/single", key, {"tag": tag}, x_api_key="k2")
    assert "Idempotent-Replayed" not in other
    assert count(tag) == 2
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    client.raise_request_exception = True
    for _ in range(2):
        with pytest.raises(RuntimeError):
            post(client, "/single", key, {"tag": tag, "raise": True}, x_api_key="k1")
    assert count(tag) == 2  # abandoned, so the retry ran


def test_anonymous_is_401_by_default_with_an_identity_and_a_down_store_is_503(
    client: Client,
) -> None:
    tag = uuid.uuid4().hex
    r = post(client, "/strict", uuid.uuid4().hex, {"tag": tag})
    problem(r, 401, "idempotency_identity_missing")
    assert r["WWW-Authenticate"] == "Bearer"
    assert post(client, "/strict", uuid.uuid4().hex, {"tag": tag}, x_api_key="k").status_code == 201
    r = post(client, "/down", uuid.uuid4().hex, {"tag": tag})
    problem(r, 503, "idempotency_store_unavailable")
    assert r["Retry-After"] == "1"
    assert count(tag) == 1  # the 401 and the 503 did not run the view


@pytest.fixture(scope="module")
def gunicorn() -> Iterator[str]:
    import sys
    import time

    port = free_port()
    proc = popen(
        [
            sys.executable,
            "-m",
            "gunicorn",
            "--bind",
            f"127.0.0.1:{port}",
            "--workers",
            "2",
            "--threads",
            "4",
            "--log-level",
            "warning",
            "tests.django_app.wsgi:application",
        ],
        cwd=Path(__file__).resolve().parent.parent,
        env=dict(os.environ),
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
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize(
    ("path", "who"),
    [("/mw/charges", "x-user"), ("/single", "x-api-key"), ("/drf/charges", "x-token")],
)
def test_concurrent_duplicates_under_gunicorn_run_once(gunicorn: str, path: str, who: str) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    headers = {"Idempotency-Key": f'"{key}"', who: "alice"}
    body = {"tag": tag, "sleep": 1.0}

    def send(_: int) -> httpx.Response:
        return httpx.post(gunicorn + path, json=body, headers=headers, timeout=20)

    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(send, range(6)))
    assert count(tag) == 1
    firsts = [
        r for r in responses if r.status_code == 201 and "idempotent-replayed" not in r.headers
    ]
    assert len(firsts) == 1
    assert any(r.status_code == 409 for r in responses)
    for r in responses:
        assert r.status_code in (201, 409)
        if r.status_code == 409:
            assert r.json()["code"] == "idempotency_key_in_use"
        elif r is not firsts[0]:
            assert r.content == firsts[0].content
    after = send(0)
    assert after.headers["idempotent-replayed"] == "true" and after.content == firsts[0].content
    assert count(tag) == 1


# ---- transaction.atomic(): the view's writes and the record commit together --------------


@pytest.fixture(scope="module")
def atomic_path(postgres_server: Any) -> Iterator[str]:
    from urllib.parse import urlsplit

    from django.db import connections
    from django.http import HttpRequest, JsonResponse
    from django.urls import clear_url_caches, path

    from idemlock.integrations.django import idempotent_view

    from .django_app import urls

    dsn = postgres_server.dsn
    parts = urlsplit(dsn)
    connections.settings["pg"] = connections.configure_settings(
        {
            "default": {"ENGINE": "django.db.backends.dummy"},
            "pg": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": parts.path.lstrip("/"),
                "USER": parts.username,
                "HOST": parts.hostname,
                "PORT": parts.port,
            },
        }
    )["pg"]
    with connections["pg"].cursor() as cur:
        cur.execute("CREATE TABLE IF NOT EXISTS django_charges (tag text, run text)")
    spec = {"name": "atomic", "ttl": 600, "lease": 1}

    @idempotent_view(url=dsn, atomic="pg", spec=spec, identity="header:X-Api-Key", heartbeat=False)
    def atomic_charge(request: HttpRequest) -> JsonResponse:
        import json
        import time

        data = json.loads(request.body)
        run = uuid.uuid4().hex
        with connections["pg"].cursor() as cur:
            cur.execute("INSERT INTO django_charges VALUES (%s, %s)", [data["tag"], run])
        with RUNS.open("a") as f:
            f.write(f"{data['tag']}\n")
        time.sleep(float(data.get("sleep", 0)))
        return JsonResponse({"run": run}, status=201)

    urls.urlpatterns.append(path("atomic", atomic_charge))
    clear_url_caches()
    yield "/atomic"
    connections["pg"].close()


def rows(tag: str) -> list[str]:
    from django.db import connections

    with connections["pg"].cursor() as cur:
        cur.execute("SELECT run FROM django_charges WHERE tag = %s", [tag])
        return [r[0] for r in cur.fetchall()]


def test_atomic_view_records_in_its_transaction(client: Client, atomic_path: str) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    first = post(client, atomic_path, key, {"tag": tag}, x_api_key="k")
    assert first.status_code == 201
    again = post(client, atomic_path, key, {"tag": tag}, x_api_key="k")
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    assert rows(tag) == [first.json()["run"]]


def test_atomic_view_whose_claim_was_taken_over_rolls_its_writes_back(
    atomic_path: str,
) -> None:
    # A's lease (1 s, no heartbeat) ends while it sleeps; B takes the key over and runs.
    # A's record is refused in A's transaction, so A's row goes with it: one row, B's.
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    body = {"tag": tag, "sleep": 1.6}
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(post, Client(), atomic_path, key, body, x_api_key="k")
        import time

        deadline = time.monotonic() + 10
        while count(tag) == 0:  # A's view runs: its claim is taken
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(1.2)  # past A's lease
        b = pool.submit(post, Client(), atomic_path, key, body, x_api_key="k")
        ra, rb = a.result(timeout=60), b.result(timeout=60)
    assert count(tag) == 2  # both views ran
    problem(ra, 409, "idempotency_key_in_use")
    assert rb.status_code == 201
    assert rows(tag) == [rb.json()["run"]]
    replay = post(Client(), atomic_path, key, body, x_api_key="k")
    assert replay["Idempotent-Replayed"] == "true" and replay.content == rb.content


def test_atomic_where_it_cannot_record_is_refused_at_setup(
    tmp_path: Path, postgres_server: Any
) -> None:
    # Found in a request, it answered every request 503 after running the view (and
    # rolling its writes back); at setup it is a ConfigurationError before any view runs.
    from django.http import HttpRequest, HttpResponse
    from django.test import RequestFactory, override_settings

    from idemlock import ConfigurationError
    from idemlock.integrations.django import IdempotencyMiddleware, idempotent_view

    sqlite = f"sqlite:///{tmp_path / 'atomic.db'}"
    needs = r"IDEMLOCK\['atomic'\] / atomic=True needs the PostgreSQL store"
    ran: list[HttpRequest] = []

    def view(request: HttpRequest) -> HttpResponse:
        ran.append(request)
        return HttpResponse(status=201)

    # The middleware: when Django loads it, before the first request.
    with (
        override_settings(IDEMLOCK={"url": sqlite, "atomic": True}),
        pytest.raises(ConfigurationError, match=needs) as refused,
    ):
        IdempotencyMiddleware(view)
    assert "the store is sqlite and DATABASES['default'] is django.db.backends.sqlite3" in str(
        refused.value
    )
    # The decorator: at its setup, before its view runs; never an answer.
    request = RequestFactory().post(
        "/x", b"{}", content_type="application/json", headers={"Idempotency-Key": '"k1"'}
    )
    cases = [
        ({"url": sqlite, "atomic": True}, "the store is sqlite and DATABASES['default']"),
        # The PostgreSQL store, but Django's database is not PostgreSQL.
        (
            {"url": postgres_server.dsn, "atomic": True},
            "but DATABASES['default'] is django.db.backends.sqlite3;",
        ),
        ({"url": sqlite, "atomic": "nope"}, "'nope', which is not in DATABASES"),
    ]
    for overrides, found in cases:
        protected = idempotent_view(identity=None, **overrides)(view)
        with pytest.raises(ConfigurationError) as refused:
            protected(request)
        assert found in str(refused.value)
    assert ran == []


# ---- Django REST framework: IdempotencyMixin ----------------------------------------------


def test_drf_mixin_replays_per_drf_user_and_never_records_drfs_own_401(client: Client) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    first = post(client, "/drf/charges", key, {"tag": tag}, x_token="alice")
    assert first.status_code == 201
    again = post(client, "/drf/charges", key, {"tag": tag}, x_token="alice")
    assert again["Idempotent-Replayed"] == "true" and again.content == first.content
    bob = post(client, "/drf/charges", key, {"tag": tag}, x_token="bob")
    assert bob.status_code == 201 and "Idempotent-Replayed" not in bob
    problem(
        post(client, "/drf/charges", key, {"tag": tag, "x": 1}, x_token="alice"),
        422,
        "idempotency_key_reused",
    )
    # DRF refuses before the handler: nothing claimed, nothing recorded.
    assert post(client, "/drf/charges", key, {"tag": tag}).status_code == 401
    assert count(tag) == 2


def test_drf_mixin_records_a_validation_error_raised_by_the_handler(client: Client) -> None:
    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    body = {"tag": tag, "invalid": True}
    first = post(client, "/drf/charges", key, body, x_token="alice")
    assert first.status_code == 400
    again = post(client, "/drf/charges", key, body, x_token="alice")
    assert again.status_code == 400 and again["Idempotent-Replayed"] == "true"
    assert count(tag) == 1


# ---- the app: system checks and manage.py idemlock --------------------------------------


def check(*args: str) -> str:
    """``manage.py check``: what it printed (errors raise SystemCheckError)."""
    import io

    from django.core.management import call_command

    out, err = io.StringIO(), io.StringIO()
    call_command("check", *args, stdout=out, stderr=err)
    return out.getvalue() + err.getvalue()


def conf(**changes: Any) -> dict[str, Any]:
    from django.conf import settings

    return {**settings.IDEMLOCK, **changes}


def test_check_passes_on_a_valid_project() -> None:
    assert "no issues" in check()


def test_check_reports_a_misspelt_or_invalid_setting() -> None:
    from django.core.management.base import SystemCheckError
    from django.test import override_settings

    misspelt_setting = override_settings(IDEMLOCK=conf(requier_key=True))
    with misspelt_setting, pytest.raises(SystemCheckError) as misspelt:
        check()
    assert "idemlock.E003" in str(misspelt.value)
    assert "unknown key 'requier_key' (did you mean 'require_key'?)" in str(misspelt.value)
    with override_settings(IDEMLOCK=conf(max_body=0)), pytest.raises(SystemCheckError) as bad:
        check()
    assert "idemlock.E005" in str(bad.value) and "max_body must be a positive int" in str(bad.value)
    no_url = {k: v for k, v in conf().items() if k != "url"}
    with override_settings(IDEMLOCK=no_url), pytest.raises(SystemCheckError) as missing:
        check()
    assert "idemlock.E004" in str(missing.value)


def test_check_warns_about_a_store_that_does_not_answer() -> None:
    from django.core.management.base import SystemCheckError
    from django.test import override_settings

    with override_settings(IDEMLOCK=conf(url=os.environ["DJANGO_TEST_DEAD_STORE"])):
        out = check()  # a warning: the project still starts
        with pytest.raises(SystemCheckError):
            check("--fail-level", "WARNING")
    assert "idemlock.W001" in out and "does not answer" in out
    assert "redis://127.0.0.1:" in out


def test_check_reports_the_middleware_before_authentication() -> None:
    from django.conf import settings
    from django.core.management.base import SystemCheckError
    from django.test import override_settings

    ours = "idemlock.integrations.django.IdempotencyMiddleware"
    early = [ours, *(m for m in settings.MIDDLEWARE if m != ours)]
    with override_settings(MIDDLEWARE=early), pytest.raises(SystemCheckError) as caught:
        check()
    assert "idemlock.E007" in str(caught.value)
    assert "AuthenticationMiddleware comes after it" in str(caught.value)
    # With another identity the order does not matter.
    with override_settings(MIDDLEWARE=early, IDEMLOCK=conf(identity="header:X-Api-Key")):
        assert "no issues" in check()


def test_manage_py_idemlock_runs_the_cli_on_the_configured_store(client: Client) -> None:
    import io
    import json

    from django.core.management import call_command
    from django.core.management.base import CommandError

    key, tag = uuid.uuid4().hex, uuid.uuid4().hex
    assert post(client, "/mw/charges", key, {"tag": tag}, x_user="alice").status_code == 201
    out = io.StringIO()
    call_command("idemlock", "keys", "--spec", "http", "--json", stdout=out)
    rows = json.loads(out.getvalue())
    assert rows and {r["spec"] for r in rows} == {"http"}
    assert {r["state"] for r in rows} <= {"completed", "in_flight"}
    out = io.StringIO()
    call_command("idemlock", "status", rows[0]["key"], "--spec", "http", stdout=out)
    assert "completed" in out.getvalue()
    out = io.StringIO()
    call_command("idemlock", "purge", stdout=out)
    assert "purged" in out.getvalue().lower() or "deleted" in out.getvalue().lower()
    with pytest.raises(CommandError) as missing:
        call_command("idemlock", "status", "no-such-key", "--spec", "http", stdout=io.StringIO())
    assert missing.value.returncode == 1
    with pytest.raises(CommandError, match="--url is not taken"):
        call_command("idemlock", "keys", "--url", "memory://")


def test_manage_py_idemlock_locks_lists_a_held_lock() -> None:
    import io
    import json

    from django.core.management import call_command

    import idemlock

    def locks(*args: str) -> str:
        out = io.StringIO()
        call_command("idemlock", "locks", "--spec", spec, *args, stdout=out)
        return out.getvalue()

    spec = f"nightly-{uuid.uuid4().hex[:8]}"
    with idemlock.connect(os.environ["DJANGO_TEST_STORE"]) as coord:
        port = coord.lock(idemlock.LockSpec(spec, ttl=60))
        assert json.loads(locks("--json")) == []
        lease = port.acquire("report", owner="cron-host-1")
        assert lease is not None
        rows = json.loads(locks("--json"))
        assert [(r["spec"], r["key"], r["owner"], r["token"]) for r in rows] == [
            (spec, "report", "cron-host-1", lease.token)
        ]
        table = locks()
        assert spec in table and "cron-host-1" in table and "TIME LEFT" in table
        assert port.release(lease)
        assert json.loads(locks("--json")) == []


MANAGE_PY = """\
import os, sys
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.django_app.settings")
from django.core.management import execute_from_command_line
execute_from_command_line(sys.argv)
"""


def _manage_py_test(tmp: Path, *args: str) -> Any:
    """``python manage.py test tests.django_app.runner_checks ARGS`` in a project
    directory of its own, with tests/django_app's settings and a store of its own."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    (tmp / "manage.py").write_text(MANAGE_PY, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("IDEMLOCK_", "PYTEST_"))}
    env.update(
        PYTHONPATH=os.pathsep.join([str(tmp), str(root / "src"), str(root)]),
        DJANGO_SETTINGS_MODULE="tests.django_app.settings",
        DJANGO_TEST_STORE=f"sqlite:///{tmp / 'idemlock.db'}",
        DJANGO_TEST_RUNS=str(tmp / "runs"),
        DJANGO_TEST_DB=str(tmp / "django.sqlite3"),
        PYTHONDONTWRITEBYTECODE="1",
    )
    return subprocess.run(
        [sys.executable, "manage.py", "test", "tests.django_app.runner_checks", *args],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def test_the_app_under_djangos_own_test_runner(tmp_path: Path) -> None:
    # Django's runner runs the system checks before any test, then the app's checks,
    # the middleware and `manage.py idemlock keys|locks|purge` from a django TestCase.
    ok = _manage_py_test(tmp_path, "-v", "2")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "System check identified no issues" in ok.stdout + ok.stderr
    assert "Ran 3 tests" in ok.stderr and "\nOK" in ok.stderr, ok.stderr
    # A misspelt setting stops the runner at its checks: no test runs.
    (tmp_path / "misspelt.py").write_text(
        "from tests.django_app.settings import *  # noqa: F403\n"
        "IDEMLOCK = {**IDEMLOCK, 'requier_key': True}  # noqa: F405\n",
        encoding="utf-8",
    )
    bad = _manage_py_test(tmp_path, "--settings", "misspelt")
    assert bad.returncode != 0
    assert "idemlock.E003" in bad.stderr and "did you mean 'require_key'" in bad.stderr
    assert "Ran " not in bad.stderr
