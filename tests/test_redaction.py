"""No password of a store URL is ever shown (issue 10, item 17): not in ``coord.url``,
not in an error message (bad URL, unreachable store, failed authentication), not in
the CLI's output or its ``--help``. One helper, ``idemlock._urls.redact``, masks the
userinfo password and every secret-looking query parameter."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import idemlock
import idemlock.aio
from idemlock import IdemlockError
from idemlock._urls import redact, scrub, secrets_in

SECRET = "s3cr3t-Pa55"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://h/0?password=s3cr3t-Pa55&db=1", "redis://h/0?password=***&db=1"),
        ("redis://u:s3cr3t-Pa55@h:6379/0", "redis://u:***@h:6379/0"),
        ("redis://:s3cr3t-Pa55@h", "redis://:***@h"),
        ("rediss+cluster://:s3cr3t-Pa55@a:1,b:2", "rediss+cluster://:***@a:1,b:2"),
        (
            "postgresql://u@h/db?sslpassword=s3cr3t-Pa55&sslmode=require",
            "postgresql://u@h/db?sslpassword=***&sslmode=require",
        ),
        ("postgres://h/db?passwd=s3cr3t-Pa55", "postgres://h/db?passwd=***"),
        ("redis://h?pass=s3cr3t-Pa55;token=abc", "redis://h?pass=***;token=***"),
        (
            "etcd://h:2379?secret=s3cr3t-Pa55&auth=x&api_key=y",
            "etcd://h:2379?secret=***&auth=***&api_key=***",
        ),
        ("redis://h?Pass%77ord=s3cr3t-Pa55", "redis://h?Pass%77ord=***"),
        ("redis://h?ssl_password=s3cr3t-Pa55#frag", "redis://h?ssl_password=***#frag"),
        ("host=h user=u password='s3cr3t Pa55' dbname=d", "host=h user=u password=*** dbname=d"),
        ("redis://u:p%40ss%3Aword@h/0", "redis://u:***@h/0"),
        ("redis://u:pa/ss@h/0", "redis://u:***@h/0"),  # an unescaped / in the password
        ("redis://u:p@ss@h/0?db=1", "redis://u:***@h/0?db=1"),  # an unescaped @
        ("redis://h/0?x=a:b@c", "redis://h/0?x=a:b@c"),  # an @ in the query is no userinfo
        ("sqlite:////tmp/a@b.db", "sqlite:////tmp/a@b.db"),
        ("redis://h:6379/0?socket_timeout=1", "redis://h:6379/0?socket_timeout=1"),
        ("sqlite:////var/lib/app/idemlock.db", "sqlite:////var/lib/app/idemlock.db"),
        ("memory://", "memory://"),
        ("redis://[::1", "redis://[::1"),
        # a password with an unescaped ? or #: the userinfo runs to the @ before the host
        ("redis://:pa#ss@h", "redis://:***@h"),
        ("redis://u:pa?ss@h/0?db=1", "redis://u:***@h/0?db=1"),
        ("etcd://u:pa?ss@h:2379", "etcd://u:***@h:2379"),
        ("postgresql://u:pa#ss@h:5432/db", "postgresql://u:***@h:5432/db"),
        ("rediss+cluster://:p/a?s#s@a:1,b:2", "rediss+cluster://:***@a:1,b:2"),
        ("redis://u:p#a@ss@h/0", "redis://u:***@h/0"),
        # an @ of the query that no host follows is no userinfo
        (
            "postgresql://h:5432/db?user=me@corp&sslmode=require",
            "postgresql://h:5432/db?user=me@corp&sslmode=require",
        ),
        ("redis://h/0#a:b@c", "redis://h/0#a:b@c"),
    ],
)
def test_redact(url: str, shown: str) -> None:
    assert redact(url) == shown
    assert redact(shown) == shown  # idempotent


def test_secrets_and_scrub() -> None:
    url = "redis://u:p%40ss-word@h/0?password=s3cr3t-Pa55"
    assert set(secrets_in(url)) >= {"p%40ss-word", "p@ss-word", "s3cr3t-Pa55"}
    text = "auth failed for 'p@ss-word' (p%40ss-word) and s3cr3t-Pa55"
    assert scrub(text, url) == "auth failed for '***' (***) and ***"


def test_secrets_with_unescaped_query_characters() -> None:
    assert secrets_in("redis://:pa#ss-word@h") == ["pa#ss-word"]
    assert secrets_in("etcd://u:pa?ss-word@h:2379") == ["pa?ss-word"]
    assert scrub("auth failed for 'pa#ss-word'", "redis://u:pa#ss-word@h") == (
        "auth failed for '***'"
    )


def test_a_chained_exception_that_quotes_a_secret_is_dropped() -> None:
    """What open_store does with a store's error: a cause that quotes the password
    would print in the traceback, so the scrubbed copy does not chain it."""
    from idemlock import ConfigurationError
    from idemlock._urls import _scrubbed

    url = f"redis://u:{SECRET}@h/0"
    try:
        try:
            raise ValueError(f"cannot use {SECRET}")
        except ValueError as inner:
            raise ConfigurationError("bad Redis URL") from inner
    except ConfigurationError as exc:
        clean = _scrubbed(exc, url)
    assert clean is not None and str(clean) == "bad Redis URL"
    assert clean.__cause__ is None and clean.__suppress_context__
    try:  # a cause without a secret is kept
        try:
            raise ValueError("no secret here")
        except ValueError as inner:
            raise ConfigurationError(f"bad Redis URL {SECRET}") from inner
    except ConfigurationError as exc:
        kept = _scrubbed(exc, url)
    assert kept is not None and SECRET not in str(kept)
    assert isinstance(kept.__cause__, ValueError)


def _url_params(request: pytest.FixtureRequest, tmp_path: Path, scheme: str) -> str:
    # The test server's default user takes any password; user "nobody" does not
    # exist, so these credentials are refused.
    if scheme == "redis":
        base = str(request.getfixturevalue("redis_server").url)
        return f"{base}?username=nobody&password={SECRET}"
    if scheme == "redis_userinfo":
        base = str(request.getfixturevalue("redis_server").url)
        return base.replace("redis://", f"redis://nobody:{SECRET}@", 1)
    if scheme == "redis_cluster":
        base = str(request.getfixturevalue("redis_cluster").url)
        return base.replace("redis+cluster://", f"redis+cluster://:{SECRET}@", 1)
    if scheme == "etcd":
        base = str(request.getfixturevalue("etcd_server").url)
        return base.replace("etcd://", f"etcd://app:{SECRET}@", 1)
    dsn = str(request.getfixturevalue("postgres_dsn"))
    if scheme == "postgres_userinfo":
        user_host = dsn.split("://", 1)[1]
        user, _, rest = user_host.partition("@")
        return f"postgresql://{user}:{SECRET}@{rest}"
    return f"{dsn}?password={SECRET}"


def _assert_clean(text: str) -> None:
    assert SECRET not in text
    assert SECRET.replace("-", "%2D") not in text


# ---- coord.url -----------------------------------------------------------------


@pytest.mark.parametrize(
    "scheme", ["redis", "redis_userinfo", "redis_cluster", "postgres", "postgres_userinfo", "etcd"]
)
def test_coord_url_is_redacted(scheme: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    url = _url_params(request, tmp_path, scheme)
    try:
        coord = idemlock.connect(url)
    except IdemlockError as exc:  # a cluster client connects at once, and may refuse
        _assert_clean(str(exc))
        return
    try:
        assert coord.url is not None
        _assert_clean(coord.url)
        _assert_clean(repr(coord.url))
        assert "***" in coord.url
    finally:
        coord.close()

    async def run() -> None:
        acoord = idemlock.aio.connect(url)
        try:
            assert acoord.url is not None
            _assert_clean(acoord.url)
            assert "***" in acoord.url
        finally:
            await acoord.close()

    asyncio.run(run())


# ---- error messages ------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        f"memory://?password={SECRET}",
        f"memory://u:{SECRET}@host",
        f"sqlite:////tmp/x.db?password={SECRET}",
        f"sqlite://u:{SECRET}@host/x.db",
        f"bogus://u:{SECRET}@h/?token={SECRET}",
        f"host=h password={SECRET}",
        f"redis://u:{SECRET}@h:notaport/0",
        f"redis://h/0?password={SECRET}&bogus=1",
        f"redis+cluster://:{SECRET}@h:99999",
        f"postgresql://u:{SECRET}@h/db?bogus=1",
        f"postgresql://h/db?password={SECRET}&bogus=1",
        f"etcd://u:{SECRET}@h:notaport",
        f"etcd://h:2379?password={SECRET}&bogus=1",
    ],
)
def test_bad_url_messages_are_redacted(url: str) -> None:
    for opener in (idemlock.connect, idemlock.aio.connect):
        with pytest.raises(IdemlockError) as info:
            opener(url)
        _assert_clean(str(info.value))
        _assert_clean(repr(info.value))
        for arg in info.value.args:
            _assert_clean(str(arg))


#: a password holding every character a URL parser stops at; its pieces must not show
RAW = "Pa55/w0rd?Fo0#Ba7"
RAW_PIECES = ("Pa55", "w0rd", "Fo0", "Ba7")


@pytest.mark.parametrize(
    "url",
    [
        f"redis://:{RAW}@127.0.0.1:6379/0",
        f"redis://u:{RAW}@h",
        "redis://:Qz9#Xk7@h",  # the audit's: "bad port 'pa'"
        "redis://u:Qz9/2Xk7@db:6379/0",  # "the database number, got '2secret@db...'"
        "redis://u:2Qz9?Xk7@h:6379",
        "redis://u:1729#4104@h:6379",  # read as host u, port 12: it would connect there
        f"rediss://u:{RAW}@h:6380/0",
        f"redis+cluster://:{RAW}@a:1,b:2",
        f"etcd://u:{RAW}@h:2379",
        "etcd://u:Qz9#Xk7@h:2379",  # "bad etcd endpoint 'u:pa'"
        "etcd://u:Qz9?Xk7@h:2379",  # "bad query field: 'ss@h:2379'", and in its cause
        f"etcds://u:{RAW}@h:2379,g:2379",
        "postgresql://u:Pa55/w0rd@127.0.0.1:1/db",  # libpq: host u, port Pa55
        "postgres://u:Pa55#Fo0/w0rd@127.0.0.1:1/db",
    ],
)
def test_unencoded_password_is_refused_unseen(url: str) -> None:
    """A password with a raw /, ? or # is read by URL parsers as host, port, path or
    query: the URL is refused, saying to percent-encode it, and no piece of it shows,
    in the message or in what it chains."""
    password = url.partition("://")[2].rpartition("@")[0].partition(":")[2]
    pieces = {p for p in re.split(r"[/?#]", password) if len(p) >= 2} | {password}
    for opener in (idemlock.connect, idemlock.aio.connect):
        with pytest.raises(idemlock.ConfigurationError) as info:
            opener(url)
        text = str(info.value)
        assert "%2F, %3F, %23" in text and "percent-encode" in text, text
        assert ":***@" in text, text
        shown = [text, repr(info.value)]
        link: BaseException | None = info.value
        while link is not None:  # what a traceback would print too
            shown.append(str(link))
            link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)
        after_scheme = "\n".join(t.replace(url.partition("://")[0] + "://", "") for t in shown)
        for piece in pieces:
            assert piece not in after_scheme.replace("***", ""), (piece, shown)


def test_cli_migrate_refuses_an_unencoded_password() -> None:
    done = _cli("--url", "postgresql://u:Pa55/w0rd@127.0.0.1:1/db", "migrate")
    assert done.returncode != 0
    assert "%2F" in done.stderr, done.stderr
    for piece in ("Pa55", "w0rd"):
        assert piece not in done.stdout + done.stderr


def test_postgres_takes_a_raw_question_mark_or_hash_in_a_password(postgres_dsn: str) -> None:
    """libpq reads ? and # in a password (unlike / ), so such a URL is not refused;
    its coord.url masks the whole password."""
    user, _, rest = postgres_dsn.split("://", 1)[1].partition("@")
    url = f"postgresql://{user}:Pa55?w0rd#Fo0@{rest}"
    with idemlock.connect(url, timeout=10) as coord:
        assert coord.url == f"postgresql://{user}:***@{rest}"
        lock = coord.lock("redaction-raw")
        lock.release(lock.acquire("k"))  # the server (trust) took the connection


def test_a_query_at_sign_written_percent_encoded_is_accepted(redis_server: Any) -> None:
    """What the refusal tells one to do with an @ of the query works."""
    base = str(redis_server.url)
    host = base.partition("://")[2].partition("/")[0]
    assert ":" in host  # host:port, so a raw @ later would read as a password's end
    with pytest.raises(idemlock.ConfigurationError, match="%40"):
        idemlock.connect(f"{base}?client_name=app@corp")
    with idemlock.connect(f"{base}?client_name=app%40corp") as coord:
        lock = coord.lock("redaction-at")
        lock.release(lock.acquire("k"))


# ---- other values a message must not quote ------------------------------------


def test_a_keyring_given_as_text_is_not_quoted() -> None:
    """keyring=os.environ["IDEMLOCK_KEYRING"] (the JSON, not a Keyring): the error
    names the type and how to build one, not the keys."""
    key = base64.b64encode(b"s3cr3t-Pa55-s3cr3t-Pa55-s3cr3t-P").decode()  # 32 bytes
    lookup = base64.b64encode(b"lookup-secret-lookup-secret-look").decode()
    text = json.dumps({"primary": "k1", "keys": {"k1": key}, "lookup": lookup})
    with pytest.raises(idemlock.ConfigurationError) as info:
        idemlock.connect("memory://", keyring=text)
    message = str(info.value)
    assert key not in message and lookup not in message and key[:8] not in message
    assert "got a str" in message
    assert "Keyring.from_env()" in message and "Keyring.from_json(text)" in message
    assert idemlock.Keyring.from_json(text) is not None  # the names it gives exist


def test_job_coordinator_callable_returning_a_url(tmp_path: Path) -> None:
    """A callable must return a coordinator, not a URL: the message says so, and
    shows the URL redacted."""
    from idemlock.integrations.rq import idempotent_job

    url = f"redis://u:{SECRET}@127.0.0.1:1/0"

    @idempotent_job("redaction-job", coordinator=lambda: url)
    def job(x: int) -> int:
        return x

    with pytest.raises(idemlock.ConfigurationError) as info:
        job(1)  # called directly: no worker
    message = str(info.value)
    _assert_clean(message)
    assert "not a URL: pass the URL itself" in message
    assert "returning an idemlock.Coordinator" in message
    assert "the callable returned the str 'redis://u:***@127.0.0.1:1/0'" in message

    class Holder:
        def __repr__(self) -> str:
            return f"Holder({SECRET})"

    @idempotent_job("redaction-job", coordinator=Holder())
    def job2(x: int) -> int:
        return x

    with pytest.raises(idemlock.ConfigurationError) as info:
        job2(1)
    _assert_clean(str(info.value))
    assert f"got a {Holder.__module__}.{Holder.__qualname__}" in str(info.value)


def test_celery_coordinator_callable_returning_a_url() -> None:
    from celery import Celery

    from idemlock.integrations.celery import IdempotentTask

    url = f"redis://u:{SECRET}@127.0.0.1:1/0"
    app = Celery("idemlock_redaction", set_as_current=False)

    @app.task(
        base=IdempotentTask,
        name="idemlock_redaction.t",
        idemlock_spec="redaction-task",
        idemlock_coordinator=lambda: url,
    )
    def task(x: int) -> int:
        return x

    with pytest.raises(idemlock.ConfigurationError) as info:
        task(1)  # called directly: no worker, no broker
    message = str(info.value)
    _assert_clean(message)
    assert "returning an idemlock.Coordinator (not a URL: pass the URL itself)" in message
    assert "the callable returned the str 'redis://u:***@127.0.0.1:1/0'" in message


# ---- a driver that fails to import ---------------------------------------------

_NO_PSYCOPG = "import sys\nsys.modules['psycopg'] = None  # import psycopg now raises ImportError\n"


@pytest.mark.parametrize("how", ["connect", "cli"])
def test_postgres_driver_import_failure_says_what_failed(how: str) -> None:
    """psycopg's ImportError (typically "no pq wrapper available": no libpq) is
    quoted, and the hint names libpq and psycopg[binary], which the extra lacks."""
    if how == "connect":
        code = _NO_PSYCOPG + (
            "import idemlock\n"
            "try:\n"
            "    idemlock.connect('postgresql://u@127.0.0.1:1/db')\n"
            "except idemlock.ConfigurationError as exc:\n"
            "    print(exc)\n"
        )
    else:
        code = _NO_PSYCOPG + (
            "sys.argv = ['idemlock', '--url', 'postgresql://u@127.0.0.1:1/db', 'migrate']\n"
            "from idemlock.cli import main\n"
            "sys.exit(main())\n"
        )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    out = done.stdout + done.stderr
    assert "import of psycopg halted" in out, out  # the ImportError's own text
    assert "libpq" in out and "apt-get install libpq5" in out, out
    assert "pip install 'psycopg[binary]'" in out, out
    assert "pip install 'idemlock[postgres]'" in out, out
    assert "needs its driver" not in out


@pytest.mark.parametrize("scheme", ["redis", "redis_userinfo", "postgres", "postgres_userinfo"])
def test_failed_call_messages_are_redacted(
    scheme: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A store that refuses the credentials, or a database that does not exist: the
    StoreUnavailable names the cause without the password."""
    url = _url_params(request, tmp_path, scheme)
    if scheme.startswith("postgres"):
        base, sep, query = url.partition("?")
        url = base.rpartition("/")[0] + "/no_such_db_here" + sep + query
    with pytest.raises(IdemlockError) as info, idemlock.connect(url, timeout=3) as coord:
        coord.lock("l").acquire("k")
    _assert_clean(str(info.value))
    cause: Any = info.value.__cause__
    while cause is not None:  # what a traceback would print too
        _assert_clean(str(cause))
        cause = cause.__cause__


# ---- the CLI -------------------------------------------------------------------


def _cli(*args: str, env_url: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "IDEMLOCK_URL"}
    if env_url is not None:
        env["IDEMLOCK_URL"] = env_url
    return subprocess.run(
        [sys.executable, "-m", "idemlock", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


@pytest.mark.parametrize(
    "env_url",
    [
        f"redis://127.0.0.1:1/0?password={SECRET}",
        f"redis://user:{SECRET}@127.0.0.1:1/0",
        f"postgresql://u@127.0.0.1:1/db?sslpassword={SECRET}",
    ],
)
def test_cli_help_with_a_password_in_idemlock_url(env_url: str) -> None:
    for args in (["--help"], ["keys", "--help"], ["run", "--help"]):
        done = _cli(*args, env_url=env_url)
        assert done.returncode == 0, done.stderr
        _assert_clean(done.stdout + done.stderr)


def test_cli_output_and_errors(request: pytest.FixtureRequest, tmp_path: Path) -> None:
    bad_auth = _url_params(request, tmp_path, "redis")  # the server has no password
    for args in (
        ["--url", f"sqlite:///{tmp_path / 'x.db'}?password={SECRET}", "keys"],
        ["--url", f"memory://?token={SECRET}", "locks"],
        ["--url", bad_auth, "keys"],
        ["--url", bad_auth, "locks"],
    ):
        done = _cli(*args)
        assert done.returncode != 0
        _assert_clean(done.stdout + done.stderr)
    # purge needs no call on Redis (Redis expires keys itself) and names the store.
    done = _cli("--url", bad_auth, "purge")
    assert "***" in done.stdout
    _assert_clean(done.stdout + done.stderr)
    # From the environment too, and on success (purge names the store it purged).
    good = str(request.getfixturevalue("redis_server").url).replace(
        "redis://", f"redis://default:{SECRET}@", 1
    )
    done = _cli("purge", env_url=good)
    _assert_clean(done.stdout + done.stderr)
