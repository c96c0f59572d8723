"""Users' code type-checks against idemlock's public types.

(Linting and ``mypy --strict`` of the library itself are in ``scripts/check``, run
first by .ci/run and as a pre-commit hook; see tests/test_check_script.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


#: A user's program, type-checked on its own under ``mypy --strict``: the public types
#: must need no asserts or casts (a lease's token is an int; specs take seconds too).
USER_PROGRAM = """
from datetime import timedelta

import idemlock


def main() -> int:
    locks = idemlock.LockSpec("jobs", ttl=30)
    once = idemlock.IdempotencySpec("emails", ttl=timedelta(hours=1), lease=10.5)
    with idemlock.connect("memory://") as coord:
        lease = coord.lock(locks).acquire("nightly")
        assert lease is not None
        next_token: int = lease.token + 1
        port = coord.idempotency(once)
        claim = port.claim("k1", payload={"to": "a@example.com"})
        fence: int = claim.fence if isinstance(claim, idemlock.Claimed) else 0
        return next_token + fence
"""


def _mypy_user(tmp_path: Path, source: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "user_program.py").write_text(source)
    return _mypy(tmp_path, ["user_program.py"])


def _mypy(where: Path, files: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", *files],
        cwd=where,  # outside the repository: none of its mypy configuration applies
        # this tree's idemlock, whichever one the interpreter has installed
        env={**os.environ, "MYPYPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        check=False,
    )


@dataclass(frozen=True)
class Checked:
    """What one ``mypy --strict`` run over a test's programs said (a run per program
    spent most of its time analysing idemlock and the queues or frameworks again)."""

    out: subprocess.CompletedProcess[str]

    def errors(self, name: str) -> list[str]:
        """The error lines of program ``name`` (its file ``name.py``)."""
        return [
            line
            for line in self.out.stdout.splitlines()
            if line.startswith(f"{name}.py:") and ": error:" in line
        ]

    def output(self, name: str) -> str:
        """Program ``name``'s lines of mypy's output (its errors and their notes)."""
        mine = [line for line in self.out.stdout.splitlines() if line.startswith(f"{name}.py:")]
        return "\n".join(mine) + "\n" + self.out.stderr


def _mypy_programs(where: Path, programs: dict[str, str]) -> Checked:
    """One ``mypy --strict`` run over ``programs`` (name -> source), each a module of its
    own: errors (exit 1, never a crash's 2) in the programs only, never in idemlock's files."""
    for name, source in programs.items():
        (where / f"{name}.py").write_text(source)
    out = _mypy(where, [f"{name}.py" for name in programs])
    assert out.returncode == 1, out.stdout + out.stderr
    elsewhere = [
        line
        for line in out.stdout.splitlines()
        if ": error:" in line and not any(line.startswith(f"{n}.py:") for n in programs)
    ]
    assert not elsewhere, out.stdout
    return Checked(out)


def test_users_strict_mypy_needs_no_asserts_on_public_types(tmp_path: Path) -> None:
    wrong = USER_PROGRAM.replace("lease.token + 1", 'lease.token + "1"')
    checked = _mypy_programs(tmp_path, {"user_program": USER_PROGRAM, "user_wrong": wrong})
    assert not checked.errors("user_program"), checked.output("user_program")
    # The check is real: the same program with a type error is refused.
    assert checked.errors("user_wrong"), checked.output("user_wrong")
    assert 'Unsupported operand types for + ("int" and "str")' in checked.output("user_wrong")


#: A user's program sending once through the queues (arq's part: tests/test_arq.py, whose
#: session has arq), the one way each: the
#: queue's handle, the job, ``args=``/``kwargs=``, ``lease=``, the queue's own options,
#: and back the queue's job handle or None.
QUEUES_PROGRAM = """
from __future__ import annotations

from datetime import timedelta
from typing import Any

import dramatiq
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import CurrentMessage
from rq import Queue
from rq.job import Job as RqJob

from idemlock.integrations import celery as idem_celery
from idemlock.integrations import dramatiq as idem_dramatiq
from idemlock.integrations import rq as idem_rq

broker = StubBroker()
broker.add_middleware(CurrentMessage())


@idem_rq.idempotent_job(
    "charge", key=lambda order_id, amount: order_id, retry_every=2.5, max_run=timedelta(minutes=5)
)
def charge(order_id: str, amount: int) -> dict[str, Any]:
    return {"order_id": order_id, "amount": amount}


@dramatiq.actor(broker=broker)
@idem_dramatiq.idempotent("charge", key=lambda order_id, amount: order_id)
def dcharge(order_id: str, amount: int) -> int:
    return amount


def send_rq(queue: Queue) -> RqJob | None:
    return idem_rq.enqueue_once(
        queue, charge, args=("o-7",), kwargs={"amount": 1200}, lease=600, job_timeout=30
    )


def send_dramatiq() -> dramatiq.Message[int] | None:
    return idem_dramatiq.enqueue_once(
        dcharge, args=("o-7",), kwargs={"amount": 1200}, lease=600, delay=1000
    )


def send_celery(task: idem_celery.IdempotentTask) -> bool:
    sent = idem_celery.enqueue_once(task, args=("o-7",), kwargs={"amount": 1200}, lease=600)
    return sent is None


def deprecated_rq(queue: Queue) -> RqJob | None:
    # the 0.1 form still type-checks (and warns when run)
    return idem_rq.enqueue_once(queue, charge, ("o-7",), {"amount": 1200}, lease=600)
"""


def test_users_strict_mypy_accepts_enqueue_once_on_every_queue(tmp_path: Path) -> None:
    programs = {
        "queues_program": QUEUES_PROGRAM,
        "queues_wrong_lease": QUEUES_PROGRAM.replace(
            "lease=600, delay=1000", 'lease="10 min", delay=1000'
        ),
        "queues_misspelt": QUEUES_PROGRAM.replace("retry_every=2.5", "retry_evry=2.5"),
    }
    checked = _mypy_programs(tmp_path, programs)
    assert not checked.errors("queues_program"), checked.output("queues_program")
    # The check is real: a lease that is not seconds is refused.
    out = checked.output("queues_wrong_lease")
    assert checked.errors("queues_wrong_lease") and 'Argument "lease" to "enqueue_once"' in out
    # ... and so is a misspelt job option (the options every queue shares, typed once).
    out = checked.output("queues_misspelt")
    assert checked.errors("queues_misspelt"), out
    assert 'Unexpected keyword argument "retry_evry"' in out, out


#: What a user passes where idemlock once took ``Any``: payloads and results are
#: ``idemlock.JSONValue``, a job's ``coordinator=`` is a coordinator, a URL or a callable
#: returning a coordinator, FastAPI's ``identity=`` returns a str or None, and the HTTP
#: adapters' ``**options`` are the typed dicts of their options. Each line
#: marked ``# refused`` must be an error under ``mypy --strict``; the others must not.
TYPED_PARAMETERS_PROGRAM = """
from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from flask import Flask

import idemlock
import idemlock.aio
from idemlock.compat.ports import IdempotencyPort as CompatPort
from idemlock.integrations import celery as idem_celery
from idemlock.integrations import dramatiq as idem_dramatiq
from idemlock.integrations import rq as idem_rq
from idemlock.integrations import asgi, wsgi
from idemlock.integrations import flask as flask_ext
from idemlock.integrations.fastapi import Idempotency


def sync_side(coord: idemlock.Coordinator, body: dict[str, Any]) -> None:
    port = coord.idempotency(idemlock.IdempotencySpec("emails"))
    port.claim("k1", payload={"to": "a@example.com", "n": [1, 2.5, None, True]})
    port.claim("k2", payload=("order", 7))
    port.claim("k3", payload=body)
    port.claim("k4", payload=json.loads("{}"))
    claim = port.wait("k5", payload=None, timeout=3)
    if isinstance(claim, idemlock.Claimed):
        port.complete(claim.token, {"sent": True, "at": "2026-01-01T00:00:00Z"})
    port.claim("k6", payload={1, 2})  # refused
    port.claim("k7", payload=datetime.now())  # refused
    port.claim("k8", payload={1: "a"})  # refused
    port.wait("k9", payload=Decimal("1.5"))  # refused
    if isinstance(claim, idemlock.Claimed):
        port.complete(claim.token, object())  # refused
    with port.run("k10", payload={"a": 1}) as attempt:
        attempt.result = {"ok": 1}
    with port.run("k11", payload=object()):  # refused
        pass
    idemlock.fingerprint({"amount": 1200})
    idemlock.canonicalize([1, "a"])
    idemlock.fingerprint(Decimal("1200"))  # refused
    idemlock.canonicalize({"k": {1, 2}})  # refused
    compat = CompatPort(coord)
    begun = compat.begin("emails", "k12", {"a": 1})
    compat.begin("emails", "k13", payload=datetime.now())  # refused
    if isinstance(begun, idemlock.Claimed):
        compat.commit(begun, {1, 2})  # refused


async def async_side(coord: idemlock.aio.AsyncCoordinator) -> None:
    port = coord.idempotency("emails")
    claim = await port.claim("k1", payload={"to": "a@example.com"})
    await port.claim("k2", payload={"when": datetime.now()})  # refused
    if isinstance(claim, idemlock.Claimed):
        await port.complete(claim.token, [1, 2, 3])
        await port.complete(claim.token, datetime.now())  # refused
    async with port.run("k3", payload=object()):  # refused
        pass


def make() -> idemlock.Coordinator:
    return idemlock.connect("memory://")


def url() -> str:
    return "memory://"


@idem_rq.idempotent_job("a", coordinator="sqlite:///tmp/idemlock.db")
def rq_a() -> None: ...
@idem_rq.idempotent_job("b", coordinator=make)
def rq_b() -> None: ...
@idem_rq.idempotent_job("c", coordinator=lambda: idemlock.aio.connect("memory://"))
def rq_c() -> None: ...
@idem_rq.idempotent_job("d", coordinator=url)  # refused
def rq_d() -> None: ...
@idem_rq.idempotent_job("e", coordinator=42)  # refused
def rq_e() -> None: ...
@idem_dramatiq.idempotent("f", coordinator=make())
def dq_f() -> None: ...
@idem_dramatiq.idempotent("g", coordinator=idemlock.aio.connect("memory://"))  # refused
def dq_g() -> None: ...


class Task(idem_celery.IdempotentTask):
    idemlock_coordinator = make


class WrongTask(idem_celery.IdempotentTask):
    idemlock_coordinator = 3.5  # refused


def caller(authorization: str | None = None) -> str | None:
    return authorization


async def async_caller() -> str:
    return "user-1"


def numeric_caller() -> int:
    return 7


Idempotency("memory://", identity=caller)
Idempotency("memory://", identity=async_caller)
Idempotency("memory://", identity=numeric_caller)  # refused
Idempotency("memory://", require_key=True, max_body=1 << 16, renew_every=timedelta(seconds=5))
Idempotency("memory://", methods=["POST"])  # refused
Idempotency("memory://", max_body="1 MB")  # refused


def asgi_app(scope: asgi.Scope, receive: asgi.Receive, send: asgi.Send) -> Awaitable[None]:
    raise NotImplementedError


def wsgi_app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
    return []


def middlewares(acoord: idemlock.aio.AsyncCoordinator, coord: idemlock.Coordinator) -> None:
    asgi.IdempotencyMiddleware(
        asgi_app, coordinator=acoord, methods=("POST",), routes="/orders/*", mismatch_status=409
    )
    asgi.IdempotencyMiddleware(asgi_app, coordinator=acoord, require_kye=True)  # refused
    asgi.IdempotencyMiddleware(asgi_app, coordinator=acoord, heartbeat="yes")  # refused
    wsgi.IdempotencyMiddleware(wsgi_app, coordinator=coord, spec="http", max_run=60.0)
    wsgi.IdempotencyMiddleware(wsgi_app, coordinator=coord, record=lambda s: "y")  # refused


def extension(app: Flask) -> None:
    flask_ext.Idempotency(app, url="memory://", spec={"name": "orders", "ttl": 3600})
    flask_ext.Idempotency(app, url="memory://", methods=["POST", "PUT"], require_key=True)
    flask_ext.Idempotency(app, url="memory://", routes="/orders/*")  # refused
    flask_ext.Idempotency(app, url="memory://", replay_header=False)  # refused
"""


def test_users_strict_mypy_refuses_wrong_types_where_idemlock_took_any(tmp_path: Path) -> None:
    checked = _mypy_programs(tmp_path, {"typed_parameters": TYPED_PARAMETERS_PROGRAM})
    # Before these parameters were typed (Any), mypy accepted every line of this program.
    lines = TYPED_PARAMETERS_PROGRAM.splitlines()
    refused = {i for i, line in enumerate(lines, start=1) if line.endswith("# refused")}
    errors = {int(line.split(":")[1]) for line in checked.errors("typed_parameters")}
    assert errors, checked.output("typed_parameters")
    assert errors == refused, (
        f"not refused: {[lines[i - 1].strip() for i in sorted(refused - errors)]}; "
        f"refused but fine: {[lines[i - 1].strip() for i in sorted(errors - refused)]}\n"
        + checked.output("typed_parameters")
    )


def test_the_typed_options_name_every_http_option_once() -> None:
    # The typed dicts only type-check: HttpOptions (checked at run time) is the truth.
    from dataclasses import fields

    from idemlock.integrations import asgi
    from idemlock.integrations import flask as flask_ext
    from idemlock.integrations.http.options import HttpOptions

    every = {f.name for f in fields(HttpOptions)}
    assert set(asgi.IdempotencyOptions.__optional_keys__) == every
    assert set(asgi.RouteOptions.__optional_keys__) == every - {"methods", "routes"}
    assert set(flask_ext.ExtensionOptions.__optional_keys__) == every - {"routes"}
    assert not asgi.IdempotencyOptions.__required_keys__
