"""No password of a store URL is ever shown (issue 10, item 17): not in ``coord.url``,
not in an error message (bad URL, unreachable store, failed authentication), not in
the CLI's output or its ``--help``. One helper, ``idemlock._urls.redact``, masks the
userinfo password and every secret-looking query parameter."""

from __future__ import annotations

import asyncio
import os
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
