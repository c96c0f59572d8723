"""idemlock's log records carry structured fields (``extra``: idemlock_spec,
idemlock_store, idemlock_operation, idemlock_outcome, idemlock_kind) for JSON
formatters, and never a key or a payload: not in the fields, not in the message, not
in the traceback. Real records from real failures (a broken hook, a failing
``on_lost``, a stalled store), captured from the ``idemlock`` loggers."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import idemlock
import idemlock.aio
from idemlock import Claimed, IdempotencySpec, LockLost, LockSpec
from idemlock._logfields import FIELDS
from idemlock.integrations.asgi import IdempotencyMiddleware
from idemlock.stores.memory import MemoryStore

#: what must never appear in a record
SECRET_KEY = "order-4111111111111111"
SECRET_PAYLOAD = "alice@example.com"


class Capture(logging.Handler):
    """Every record of the ``idemlock`` logger tree, as logged."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured() -> Iterator[list[logging.LogRecord]]:
    logger = logging.getLogger("idemlock")
    handler = Capture()
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        assert_private(handler.records)


def assert_private(records: list[logging.LogRecord]) -> None:
    """Neither secret appears anywhere a formatter could put it: the message, the
    formatted traceback, or any attribute (``extra`` fields included)."""
    formatter = logging.Formatter("%(message)s")
    for record in records:
        texts = [formatter.format(record), *map(repr, vars(record).values())]
        for text in texts:
            assert SECRET_KEY not in text and SECRET_PAYLOAD not in text, text


def fields_of(record: logging.LogRecord) -> dict[str, str]:
    return {name: getattr(record, name) for name in FIELDS if hasattr(record, name)}


@contextlib.contextmanager
def stalled(store: MemoryStore) -> Iterator[None]:
    """A thread holds the memory store's one lock: every call waits its timeout and
    raises StoreUnavailable (what a hung store does)."""
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with store._lock:
            held.set()
            done.wait(10)

    t = threading.Thread(target=hold, daemon=True)
    t.start()
    held.wait(5)
    try:
        yield
    finally:
        done.set()
        t.join(5)


def test_a_failed_hook_is_logged_with_the_events_fields(
    captured: list[logging.LogRecord],
) -> None:
    def broken(event: idemlock.Event) -> None:
        raise RuntimeError("metrics backend down")

    coord = idemlock.connect("memory://", hooks=[broken])
    claim = coord.idempotency("charge").claim(SECRET_KEY, payload={"email": SECRET_PAYLOAD})
    assert isinstance(claim, Claimed)
    coord.close()
    (first, *_) = [r for r in captured if "event hook" in r.getMessage()]
    assert fields_of(first) == {
        "idemlock_spec": "charge",
        "idemlock_store": "memory",
        "idemlock_operation": "claim",
        "idemlock_outcome": "claimed",
        "idemlock_kind": "idempotency",
    }


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_abandon_that_fails_is_logged_without_the_key(
    mode: str, captured: list[logging.LogRecord]
) -> None:
    spec = IdempotencySpec("charge", lease=timedelta(seconds=30))
    if mode == "sync":
        coord = idemlock.connect("memory://?timeout=0.2")
        port = coord.idempotency(spec)
        # The stall lasts past the block, so the abandon on the way out meets it.
        with (
            contextlib.ExitStack() as stack,
            pytest.raises(ValueError, match="declined"),
            port.run(SECRET_KEY, payload=SECRET_PAYLOAD, heartbeat=False),
        ):
            stack.enter_context(stalled(coord.store))
            raise ValueError("declined")
        coord.close()
    else:

        async def main() -> None:
            acoord = idemlock.aio.connect("memory://?timeout=0.2")
            port = acoord.idempotency(spec)
            with contextlib.ExitStack() as stack, pytest.raises(ValueError, match="declined"):
                async with port.run(SECRET_KEY, payload=SECRET_PAYLOAD, heartbeat=False):
                    stack.enter_context(stalled(acoord.store.sync))
                    raise ValueError("declined")
            await acoord.close()

        asyncio.run(main())
    (record,) = [r for r in captured if "could not abandon" in r.getMessage()]
    assert record.levelno == logging.WARNING and record.exc_info is not None
    assert fields_of(record) == {
        "idemlock_spec": "charge",
        "idemlock_store": "memory",
        "idemlock_operation": "abandon",
        "idemlock_outcome": "error",
        "idemlock_kind": "idempotency",
    }


def test_a_failing_on_lost_is_logged_with_the_locks_fields(
    captured: list[logging.LogRecord],
) -> None:
    def broken(lease: idemlock.Lease) -> None:
        raise RuntimeError("callback bug")

    coord = idemlock.connect("memory://")
    locks = coord.lock(LockSpec("nightly", ttl=timedelta(seconds=0.3)))
    with pytest.raises(LockLost), locks.hold(SECRET_KEY, on_lost=broken) as lease:
        assert locks.break_lock(SECRET_KEY) is True  # freed behind the holder's back
        deadline = time.monotonic() + 5
        while not lease.lost and time.monotonic() < deadline:
            time.sleep(0.01)
    coord.close()
    (record,) = [r for r in captured if "on_lost" in r.getMessage()]
    assert fields_of(record) == {
        "idemlock_spec": "nightly",
        "idemlock_store": "memory",
        "idemlock_operation": "on_lost",
        "idemlock_outcome": "error",
        "idemlock_kind": "lock",
    }


def test_the_http_503_record_has_fields_and_no_key(captured: list[logging.LogRecord]) -> None:
    async def charge(request: Request) -> Response:
        return JSONResponse({"ok": True}, 201)

    async def main() -> int:
        coord = idemlock.aio.connect("memory://?timeout=0.2")
        app = Starlette(
            routes=[Route("/charge", charge, methods=["POST"])],
            middleware=[Middleware(IdempotencyMiddleware, coordinator=coord, spec="payments")],
        )
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            with stalled(coord.store.sync):
                down = await client.post(
                    "/charge",
                    json={"email": SECRET_PAYLOAD},
                    headers={"Idempotency-Key": f'"{SECRET_KEY}"'},
                )
        await coord.close()
        return down.status_code

    assert asyncio.run(main()) == 503
    (record,) = [r for r in captured if "answering 503" in r.getMessage()]
    assert record.name == "idemlock.http"
    assert fields_of(record) == {
        "idemlock_spec": "payments",
        "idemlock_store": "memory",
        "idemlock_operation": "claim",
        "idemlock_outcome": "error",
        "idemlock_kind": "idempotency",
    }


def test_a_corrupt_row_in_a_listing_is_logged_with_the_stores_fields(
    captured: list[logging.LogRecord], tmp_path: Path
) -> None:
    path = tmp_path / "store.db"
    coord = idemlock.connect(f"sqlite:///{path}")
    assert coord.lock("nightly").acquire("report") is not None
    with sqlite3.connect(path) as db:  # a row idemlock never writes: a text token
        db.execute("UPDATE lock_permits SET token = 'x'")
    (row,) = coord.locks()
    assert row.corrupt
    coord.close()
    (record,) = [r for r in captured if "corrupt" in r.getMessage()]
    assert fields_of(record) == {
        "idemlock_store": "sqlite",
        "idemlock_operation": "list",
        "idemlock_outcome": "corrupt",
    }


def test_every_log_call_of_the_package_passes_the_fields() -> None:
    """The rule holds for records no test provokes: each call on an idemlock logger
    passes ``extra=`` (the fields), checked on the source."""
    root = Path(idemlock.__file__).parent
    missing = []
    for path in sorted(root.rglob("*.py")):
        if "_pb" in path.parts:
            continue  # generated protobuf code
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in {"debug", "info", "warning", "error", "exception"}:
                continue
            target = node.func.value
            name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
            is_idemlock_logger = name == "log" or (
                isinstance(target, ast.Call) and ast.unparse(target).startswith("logging.getLogger")
            )
            if is_idemlock_logger and not any(k.arg == "extra" for k in node.keywords):
                missing.append(f"{path.relative_to(root)}:{node.lineno}")
    assert missing == []
