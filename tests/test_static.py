"""Users' code type-checks against idemlock's public types.

(Linting and ``mypy --strict`` of the library itself are in ``scripts/check``, run
first by .ci/run and as a pre-commit hook; see tests/test_check_script.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
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
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-incremental", "user_program.py"],
        cwd=tmp_path,  # outside the repository: none of its mypy configuration applies
        # this tree's idemlock, whichever one the interpreter has installed
        env={**os.environ, "MYPYPATH": str(ROOT / "src")},
        capture_output=True,
        text=True,
        check=False,
    )


def test_users_strict_mypy_needs_no_asserts_on_public_types(tmp_path: Path) -> None:
    out = _mypy_user(tmp_path, USER_PROGRAM)
    assert out.returncode == 0, out.stdout + out.stderr
    # The check is real: the same program with a type error is refused.
    wrong = USER_PROGRAM.replace("lease.token + 1", 'lease.token + "1"')
    out = _mypy_user(tmp_path, wrong)
    assert out.returncode == 1 and 'Unsupported operand types for + ("int" and "str")' in out.stdout


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


@idem_rq.idempotent_job("charge", key=lambda order_id, amount: order_id)
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
    out = _mypy_user(tmp_path, QUEUES_PROGRAM)
    assert out.returncode == 0, out.stdout + out.stderr
    # The check is real: a lease that is not seconds is refused.
    wrong = QUEUES_PROGRAM.replace("lease=600, delay=1000", 'lease="10 min", delay=1000')
    out = _mypy_user(tmp_path, wrong)
    assert out.returncode == 1 and 'Argument "lease" to "enqueue_once"' in out.stdout, out.stdout
