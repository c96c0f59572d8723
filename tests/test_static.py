"""Users' code type-checks against idemlock's public types.

(Linting and ``mypy --strict`` of the library itself are in ``scripts/check``, run
first by .ci/run and as a pre-commit hook; see tests/test_check_script.py.)"""

from __future__ import annotations

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
