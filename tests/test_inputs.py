"""Input at the edge through the public entry points (issue 10, items 14 and 20 and the
audit after them): every mistake a caller can make is a ConfigurationError (or
InvalidKey) that says what to do, never a raw TypeError, ValueError or OverflowError,
on every scheme, through ``idemlock.connect`` and ``idemlock.aio.connect``."""

from __future__ import annotations

import asyncio
import math
import pickle
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

import idemlock
import idemlock.aio
from idemlock import ConfigurationError, IdemlockError, IdempotencySpec, InvalidKey, LockSpec
from idemlock._core.clock import MAX_SECONDS, duration

SCHEMES = ["memory", "sqlite", "redis", "redis_cluster", "postgres", "etcd"]


def url_of(scheme: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if scheme == "memory":
        return "memory://"
    if scheme == "sqlite":
        return f"sqlite:///{tmp_path / 'inputs.db'}"
    if scheme == "redis":
        return str(request.getfixturevalue("redis_server").url)
    if scheme == "redis_cluster":
        return str(request.getfixturevalue("redis_cluster").url)
    if scheme == "etcd":
        return str(request.getfixturevalue("etcd_server").url)
    return str(request.getfixturevalue("postgres_dsn"))


def with_query(url: str, query: str) -> str:
    return url + ("&" if "?" in url else "?") + query


def open_and_use(url: str, mode: str, **options: Any) -> None:
    """Open a coordinator and make one call: an option a store only trips over when
    it first connects must fail as clearly as one refused at connect()."""
    if mode == "sync":
        with idemlock.connect(url, **options) as coord:
            lease = coord.lock("inputs").acquire("k")
            assert lease is not None
            coord.lock("inputs").release(lease)
        return

    async def run() -> None:
        coord = idemlock.aio.connect(url, **options)
        try:
            lease = await coord.lock("inputs").acquire("k")
            assert lease is not None
            await coord.lock("inputs").release(lease)
        finally:
            await coord.close()

    asyncio.run(run())


# ---- item 20: unknown options --------------------------------------------------------


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_unknown_keyword_option(
    scheme: str, mode: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = url_of(scheme, request, tmp_path)
    with pytest.raises(ConfigurationError) as info:
        open_and_use(url, mode, bogus=1)
    message = str(info.value)
    assert "bogus" in message
    assert "timeout" in message  # names what is accepted (every store takes timeout=)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_unknown_url_option(
    scheme: str, mode: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = with_query(url_of(scheme, request, tmp_path), "bogus=1")
    with pytest.raises(ConfigurationError, match="bogus"):
        open_and_use(url, mode)


def test_option_message_names_coordinator_options_too() -> None:
    with pytest.raises(ConfigurationError, match="key_prefix") as info:
        idemlock.connect("memory://", keyprefix="x")  # a typo of a coordinator option
    assert "max_keys" in str(info.value) and "'keyprefix'" in str(info.value)


def test_client_options_are_checked(postgres_dsn: str) -> None:
    import psycopg_pool

    pool = psycopg_pool.ConnectionPool(postgres_dsn, open=False)
    with pytest.raises(ConfigurationError, match="bogus"):
        idemlock.connect(pool, bogus=1)


# ---- item 14: the store's own durations ----------------------------------------------

BAD_STORE_TIMEOUTS = [math.nan, math.inf, -1.0, 0, 10**400, 1e12, True, "soon"]


@pytest.mark.parametrize(
    "bad",
    BAD_STORE_TIMEOUTS,
    ids=["nan", "inf", "negative", "zero", "huge-int", "past-MAX_TTL", "bool", "word"],
)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_store_timeout_refused(
    scheme: str, bad: float, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = url_of(scheme, request, tmp_path)
    for mode in ("sync", "async"):
        with pytest.raises(ConfigurationError, match="timeout"):
            open_and_use(url, mode, timeout=bad)
        if isinstance(bad, bool):
            continue  # a URL holds text: ?timeout=True is "a word", tested as such
        with pytest.raises(ConfigurationError, match="timeout"):
            open_and_use(with_query(url, f"timeout={bad}"), mode)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_store_timeout_forms_agree(
    scheme: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A timedelta, an int, a float and a numeric string mean the same on every store."""
    url = url_of(scheme, request, tmp_path)
    for given in (timedelta(seconds=2.5), 2.5, "2.5"):
        with idemlock.connect(url, timeout=given) as coord:
            assert coord.store.timeout == 2.5
    with idemlock.connect(url, timeout=3) as coord:
        assert coord.store.timeout == 3.0


@pytest.mark.parametrize("bad", ["nan", "inf", "-1"])
def test_sqlite_busy_timeout_refused(bad: str, tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'b.db'}"
    with pytest.raises(ConfigurationError, match="busy_timeout"):
        idemlock.connect(url, busy_timeout=float(bad))
    with pytest.raises(ConfigurationError, match="busy_timeout"):
        idemlock.connect(with_query(url, f"busy_timeout={bad}"))


# ---- the one validator ---------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [math.nan, math.inf, -math.inf, -0.5, 10**400, -(10**5000), timedelta.max, True, "5", None],
    ids=lambda v: "huge" if isinstance(v, int) and abs(v) > 10**100 else repr(v),
)
def test_duration_refuses(value: Any) -> None:
    with pytest.raises(ConfigurationError):
        duration(value, "wait")


def test_duration_accepts() -> None:
    assert duration(0, "wait") == 0.0
    assert duration(timedelta(milliseconds=5), "wait") == 0.005
    assert duration(idemlock.MAX_TTL, "ttl") == MAX_SECONDS
    assert duration(" 2.5 ", "timeout", text=True) == 2.5
    with pytest.raises(ConfigurationError, match="positive"):
        duration(0, "lease", positive=True)
    assert timedelta(days=36525) == idemlock.MAX_TTL
    assert "MAX_TTL" in idemlock.__all__


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, True, "60", timedelta(0)])
@pytest.mark.parametrize("what", ["ttl", "lease"])
def test_http_protect_durations_use_the_one_validator(what: str, bad: Any) -> None:
    """Flask's and FastAPI's ``protect(ttl=, lease=)`` refuse a bad duration when the
    view is decorated, with the message every duration check gives."""
    from idemlock.integrations.fastapi import Idempotency as FastAPIIdempotency
    from idemlock.integrations.flask import Idempotency as FlaskIdempotency

    fastapi_idem = FastAPIIdempotency(coordinator=idemlock.aio.connect("memory://"))
    for protect in (FlaskIdempotency().protect, fastapi_idem.protect):
        with pytest.raises(ConfigurationError, match=f"^{what} must be a positive number"):
            protect(**{what: bad})
    for protect in (FlaskIdempotency().protect, fastapi_idem.protect):
        assert callable(protect(**{what: timedelta(seconds=90)}))


@pytest.mark.parametrize("bad", [0, -1, math.nan, math.inf, True, "5"])
@pytest.mark.parametrize("what", ["retry_every", "store_retry_backoff", "store_retry_max"])
def test_job_retry_durations_use_the_one_validator(what: str, bad: Any) -> None:
    """The job queues' retry intervals go through the same check (infinity included)."""
    from idemlock.integrations.rq import idempotent_job

    def job() -> None:
        return None

    with pytest.raises(
        ConfigurationError, match=f"^@idempotent_job: {what} must be a positive number"
    ):
        idempotent_job("s", coordinator="memory://", **{what: bad})(job)
    assert callable(idempotent_job("s", coordinator="memory://", **{what: 2})(job))


# ---- audit: other edge inputs at the public entry points -----------------------------

KEY_512 = "k" * 512
KEY_513 = "k" * 513


@pytest.fixture
def coord() -> Any:
    with idemlock.connect("memory://") as c:
        yield c


def test_key_of_exactly_512_bytes(coord: Any) -> None:
    port = coord.idempotency("edge")
    claim = port.claim(KEY_512)
    port.complete(claim.token, 1)
    assert port.status(KEY_512) is not None
    multi = "é" * 256  # 512 bytes of UTF-8 in 256 characters
    assert port.claim(multi).kind == "claimed"
    lease = coord.lock("edge").acquire(KEY_512)
    assert lease is not None


@pytest.mark.parametrize(
    "bad",
    [
        KEY_513,
        "é" * 256 + "x",
        "",
        " ",
        "a b",
        "a\nb",
        "a\x00b",
        "\ud800",
        "ok\udfff",
        5,
        b"k",
        None,
    ],
    ids=lambda v: repr(v)[:20],
)
def test_bad_keys_are_invalid_key(coord: Any, bad: Any) -> None:
    port = coord.idempotency("edge")
    calls: list[Callable[[], Any]] = [
        lambda: port.claim(bad),
        lambda: port.status(bad),
        lambda: port.forget(bad),
        lambda: port.wait(bad, timeout=0),
        lambda: coord.lock("edge").acquire(bad),
        lambda: coord.lock("edge").ttl(bad),
        lambda: coord.fence(bad),
        lambda: IdempotencySpec(bad),
        lambda: LockSpec(bad),
        lambda: coord.for_tenant(bad),
        lambda: idemlock.connect("memory://", key_prefix=bad),
    ]
    if bad is not None:  # None means "generate one" / "no tenant" for these
        calls += [
            lambda: coord.lock("edge").acquire("fine", owner=bad),
            lambda: idemlock.connect("memory://", tenant=bad),
        ]
    for call in calls:
        with pytest.raises(InvalidKey):
            call()
    # Where a spec object or its name is expected, a str is checked as a key and
    # anything else is the wrong type.
    for call in (lambda: coord.lock(bad), lambda: coord.idempotency(bad)):
        with pytest.raises(InvalidKey if isinstance(bad, str) else ConfigurationError):
            call()


@pytest.mark.parametrize(
    "bad",
    [True, 1.0, "1", -1, 2**63, 10**5000],
    ids=lambda v: repr(v)[:20] if not isinstance(v, int) or v < 10**100 else "huge",
)
def test_bad_gate_tokens(coord: Any, bad: Any) -> None:
    gate = coord.fence("edge")
    with pytest.raises(ConfigurationError, match="2\\*\\*63-1"):
        gate.check_and_advance(bad)


@pytest.mark.parametrize(
    "build",
    [
        lambda: IdempotencySpec("s", ttl="1h"),  # type: ignore[arg-type]
        lambda: IdempotencySpec("s", lease=True),  # type: ignore[arg-type]
        lambda: IdempotencySpec("s", ttl=0),  # type: ignore[arg-type]
        lambda: LockSpec("s", ttl=None),  # type: ignore[arg-type]
        lambda: LockSpec("s", ttl=timedelta(0)),
    ],
)
def test_bad_spec_values(build: Callable[[], Any]) -> None:
    with pytest.raises(ConfigurationError):
        build()


@pytest.mark.parametrize(
    "url",
    [
        "",
        "nothing",
        "memory",
        "://",
        "bogus://x",
        "memory://host",
        "memory:///path",
        "redis://[::1",
    ],
)
def test_bad_urls(url: str) -> None:
    with pytest.raises(ConfigurationError):
        idemlock.connect(url)


@pytest.mark.parametrize("url", [b"memory://", 5, object()], ids=["bytes", "int", "object"])
def test_url_of_wrong_type(url: Any) -> None:
    with pytest.raises(ConfigurationError):
        idemlock.connect(url)


@pytest.mark.parametrize(
    "options",
    [
        {"max_keys": 0},
        {"max_keys": True},
        {"max_keys": "5"},
        {"max_result_bytes": -1},
        {"max_result_bytes": "x"},
        {"compress_over": -5},
        {"compress_over": True},
        {"max_result_bytes": 1.5e6},
        {"keyring": "secret"},
    ],
    ids=repr,
)
def test_bad_coordinator_options(options: dict[str, Any]) -> None:
    with pytest.raises(IdemlockError):
        idemlock.connect("memory://", **options)


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    "payload",
    [
        "\ud800",
        {"k": "ok\udfff"},
        {"\udc00": 1},
        10**5000,
        [1, {"n": -(10**5000)}],
        _nested(100_000),
        b"bytes",
        {1: "non-str key"},
        math.nan,
    ],
    ids=[
        "surrogate",
        "surrogate-value",
        "surrogate-key",
        "huge-int",
        "huge-int-inside",
        "deep",
        "bytes",
        "int-key",
        "nan",
    ],
)
def test_bad_payloads_are_canonicalize_errors(coord: idemlock.Coordinator, payload: Any) -> None:
    with pytest.raises(idemlock.CanonicalizeError):
        idemlock.fingerprint(payload)
    with pytest.raises(idemlock.CanonicalizeError):
        coord.idempotency("edge").claim("k", payload=payload)

    @coord.idempotent("edge-fn")
    def fn(x: Any) -> int:
        return 1

    with pytest.raises(idemlock.CanonicalizeError):
        fn(payload)


@pytest.mark.parametrize(
    "build",
    [
        lambda: IdempotencySpec("s", encrypt_result="no"),  # type: ignore[arg-type]
        lambda: IdempotencySpec("s", encrypt_result=1),  # type: ignore[arg-type]
        lambda: LockSpec("s", requires_fencing_token="no"),  # type: ignore[arg-type]
        lambda: LockSpec("s", requires_fencing_token=None),  # type: ignore[arg-type]
    ],
)
def test_spec_flags_are_bools(build: Callable[[], Any]) -> None:
    with pytest.raises(ConfigurationError, match="True or False"):
        build()


@pytest.mark.parametrize(
    "result",
    ["\ud800", {"k": ["ok\udfff"]}, 10**5000, _nested(100_000), b"x", math.inf],
    ids=["surrogate", "surrogate-inside", "huge-int", "deep", "bytes", "inf"],
)
def test_bad_results_are_result_encode_errors(coord: idemlock.Coordinator, result: Any) -> None:
    port = coord.idempotency("edge-result")
    claim = port.claim("k")
    assert isinstance(claim, idemlock.Claimed)
    with pytest.raises(idemlock.ResultEncodeError):
        port.complete(claim.token, result)
    status = port.status("k")  # nothing was recorded: the claim is still in flight
    assert status is not None and status.state == "in_flight"
    port.abandon(claim.token)

    class Odd(Exception):
        pass

    @coord.idempotent("edge-result-fn", key=lambda: "r", replay_errors=(Odd,))
    def fails() -> int:
        raise Odd(result)

    with pytest.raises(Odd):  # cannot be recorded: abandoned, and the error propagates
        fails()
    assert coord.idempotency("edge-result-fn").status("r") is None


def test_cli_durations_past_max_ttl(tmp_path: Path) -> None:
    import argparse
    import subprocess
    import sys

    from idemlock.cli import parse_duration

    assert parse_duration("36525d") == idemlock.MAX_TTL.total_seconds()
    with pytest.raises(argparse.ArgumentTypeError, match="100 years"):
        parse_duration("36526d")
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    base = [sys.executable, "-m", "idemlock", "--url", url, "run", "--lock", "k"]
    for flag in ("--ttl", "--wait"):
        done = subprocess.run(
            [*base, flag, "99999999999d", "--", "true"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2, done.stderr  # a usage error, not a traceback
        assert "100 years" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("bad", [math.inf, math.nan, 10**400, 1e300, True, "1e400"], ids=repr)
def test_redis_counter_ttl_refused(bad: Any) -> None:
    url = "redis://127.0.0.1:1/0"  # nothing is sent: the option is refused first
    with pytest.raises(ConfigurationError, match="counter_ttl"):
        idemlock.connect(url, counter_ttl=bad)
    if not isinstance(bad, bool):
        with pytest.raises(ConfigurationError, match="counter_ttl"):
            idemlock.connect(with_query(url, f"counter_ttl={bad}"))


@pytest.mark.parametrize(
    "bad", [2**63, 10**5000, -1, True, 1.0], ids=["2**63", "huge", "-1", "bool", "float"]
)
def test_postgres_fenced_helpers_check_tokens(postgres_dsn: str, bad: Any) -> None:
    import psycopg

    from idemlock.stores.postgres import fenced_update, fenced_upsert

    with psycopg.connect(postgres_dsn) as conn:
        with pytest.raises(ConfigurationError, match="2\\*\\*63-1"):
            fenced_update(conn, "no_such_table", {"v": 1}, {"id": 1}, bad)
        with pytest.raises(ConfigurationError, match="2\\*\\*63-1"):
            fenced_upsert(conn, "no_such_table", {"id": 1, "v": 1}, ["id"], bad)


@pytest.mark.parametrize("bad", [math.inf, math.nan, 10**400, True, -1, 10_001], ids=repr)
def test_redis_handoff_ms_refused(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="handoff_ms"):
        idemlock.connect("redis://127.0.0.1:1/0", handoff_ms=bad)


# ---- error messages that fit the path that raised them ---------------------------


def test_in_flight_error_names_the_setting_of_the_caller_that_waits(coord: Any) -> None:
    """InFlightError says whether this call waited, and names only a setting the caller
    has: port.run()'s wait=, the decorator's on_in_flight='wait' once it waited. With
    on_in_flight='raise' (as the RQ/arq/Dramatiq integrations wrap) it names none."""
    port = coord.idempotency("busy-msg")
    holder = port.claim("k", payload={})  # the payload of the decorated calls below
    assert isinstance(holder, idemlock.Claimed)

    with pytest.raises(idemlock.InFlightError) as info, port.run("k", payload={}):
        pytest.fail("must not run")  # pragma: no cover
    text = str(info.value)
    assert "'k' is being processed" in text and "wait for it with port.run(key, wait=" in text
    assert "on_in_flight" not in text

    with pytest.raises(idemlock.InFlightError) as info, port.run("k", payload={}, wait=0.05):
        pytest.fail("must not run")  # pragma: no cover
    text = str(info.value)
    assert "after a wait of 0.05s" in text and "heartbeats" in text
    assert "wait longer with port.run(key, wait=" in text and "on_in_flight" not in text

    @coord.idempotent("busy-msg", key=lambda: "k")
    def raising() -> int:  # pragma: no cover - never runs
        return 1

    with pytest.raises(idemlock.InFlightError) as info:
        raising()
    text = str(info.value)
    assert "retry once it ends" in text
    assert "on_in_flight" not in text and "wait=" not in text and "port.run" not in text

    @coord.idempotent("busy-msg", key=lambda: "k", on_in_flight="wait", wait=0.05)
    def waiting() -> int:  # pragma: no cover - never runs
        return 1

    with pytest.raises(idemlock.InFlightError) as info:
        waiting()
    text = str(info.value)
    assert "after a wait of 0.05s" in text and "on_in_flight='wait', wait=" in text
    assert "port.run" not in text
    # The context shapes the message only: the attributes and pickling are unchanged.
    assert vars(info.value) == {"key": "k", "expires_at": holder.token.expires_at}
    back = pickle.loads(pickle.dumps(info.value))
    assert str(back) == text and vars(back) == vars(info.value)
    port.abandon(holder.token)


async def test_async_run_in_flight_error_names_its_wait() -> None:
    async with idemlock.aio.connect("memory://") as coord:
        port = coord.idempotency("busy-msg")
        holder = await port.claim("k", payload={})
        assert isinstance(holder, idemlock.Claimed)
        with pytest.raises(idemlock.InFlightError) as info:
            async with port.run("k", payload={}, wait=0.05):
                pytest.fail("must not run")  # pragma: no cover
        text = str(info.value)
        assert "after a wait of 0.05s" in text and "wait longer with port.run(key, wait=" in text

        @coord.idempotent("busy-msg", key=lambda: "k")
        async def raising() -> int:  # pragma: no cover - never runs
            return 1

        with pytest.raises(idemlock.InFlightError) as info:
            await raising()
        assert "on_in_flight" not in str(info.value) and "port.run" not in str(info.value)


def test_unstorable_result_advice_fits_the_caller(coord: Any) -> None:
    """From the port there is no return type to declare, and the claim stays in flight;
    the decorator is told to declare one, and its claim was abandoned."""
    port = coord.idempotency("enc-msg")
    claim = port.claim("k")
    assert isinstance(claim, idemlock.Claimed)
    for result in ((1, 2), datetime(2030, 1, 1)):
        with pytest.raises(idemlock.ResultEncodeError) as info:
            port.complete(claim.token, result)
        text = str(info.value)
        assert "pass JSON data (lists instead of tuples" in text
        assert "ISO strings instead of datetimes" in text
        assert "use the decorator with a return annotation" in text
        assert "declare the return type" not in text
        assert "claim stays in flight until its lease ends or you abandon it" in text
        assert port.status("k").state == "in_flight"
    port.abandon(claim.token)

    with pytest.raises(idemlock.ResultEncodeError) as info, port.run("r") as attempt:
        attempt.result = (1, 2)
    assert "use the decorator with a return annotation" in str(info.value)
    assert "stays in flight" in str(info.value)
    assert port.status("r").state == "in_flight"  # as the message says

    @coord.idempotent("enc-msg", key=lambda: "d")
    def pair():  # type: ignore[no-untyped-def]
        return (1, 2)

    with pytest.raises(idemlock.ResultEncodeError) as info:
        pair()
    text = str(info.value)
    assert "declare the return type" in text and "pass JSON data" not in text
    assert "claim was abandoned, so a retry runs the call again" in text
    assert port.status("d") is None

    small = idemlock.connect("memory://", max_result_bytes=64)
    big = small.idempotency("enc-msg").claim("big")
    assert isinstance(big, idemlock.Claimed)
    with pytest.raises(idemlock.ResultTooLarge) as too:
        small.idempotency("enc-msg").complete(big.token, "x" * 100)
    assert "stays in flight" in str(too.value)
    small.close()


def test_unreadable_record_names_the_callers_key_and_spec() -> None:
    """The advice to forget a record names it: the caller's key (never the HMAC stored
    under a keyring) and the spec."""
    ring = idemlock.Keyring({"k1": b"\x01" * 32}, "k1", b"L" * 32)
    with idemlock.connect("memory://", keyring=ring) as coord:
        port = coord.idempotency("dec-msg")
        claim = port.claim("order-7")
        assert isinstance(claim, idemlock.Claimed)
        skey = port._skey("order-7")
        assert skey != "order-7"
        # A record this version cannot read (another program wrote it).
        port._store.complete(*port._token_args(claim.token), b"?junk", 60_000)
        with pytest.raises(idemlock.ResultDecodeError) as info:
            port.claim("order-7")
        text = str(info.value)
        assert text.startswith("record of key 'order-7' (spec 'dec-msg'): ")
        assert "port.forget(key)" in text and "new spec name" in text
        assert skey not in text and "forget the key" not in text

        class Odd(Exception):
            pass

        @coord.idempotent("dec-msg", key=lambda: "odd", replay_errors=(Odd,))
        def records() -> int:
            raise Odd("x")

        @coord.idempotent("dec-msg", key=lambda: "odd")
        def replays() -> int:  # pragma: no cover - never runs
            return 1

        with pytest.raises(Odd):
            records()
        with pytest.raises(idemlock.ResultDecodeError) as info:
            replays()
        text = str(info.value)
        assert text.startswith("record of key 'odd' (spec 'dec-msg'): ")
        assert "not in replay_errors of" in text and "port.forget(key)" in text
