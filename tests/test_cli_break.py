"""``idemlock unlock KEY --force`` breaks a lock another process holds, for real: the
holder is an ``idemlock run --lock`` in its own process on a SQLite file, and it learns
of the break (its renewal fails, CMD is ended, exit 77)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from .test_cli import HOLD, cli, finish, procs, script, start, url, wait_for

__all__ = ["procs", "url"]  # fixtures shared with test_cli


def test_unlock_force_breaks_a_held_lock_and_the_holder_learns_it(
    url: str,
    tmp_path: Path,
    procs: list[subprocess.Popen[str]],
) -> None:
    holder = start(
        url, "run", "--lock", "deploy", "--ttl", "3s", "--", *script(HOLD), str(tmp_path)
    )
    procs.append(holder)
    wait_for(tmp_path / "ready", holder)
    token = int((tmp_path / "ready").read_text().split()[0])

    refused = cli(url, "unlock", "deploy")
    assert refused.returncode == 2, refused.stderr
    assert "--force" in refused.stderr
    assert cli(url, "locks", "--json").stdout.count('"deploy"') == 1  # still held

    guarded = cli(url, "unlock", "deploy", "--force", "--token", str(token + 1))
    assert guarded.returncode == 1, guarded.stderr
    assert f"token {token}" in guarded.stderr and "nothing was changed" in guarded.stderr

    broke = cli(url, "unlock", "deploy", "--force")
    assert broke.returncode == 0, broke.stderr
    assert "broke lock 'deploy'" in broke.stderr and f"token {token}" in broke.stderr
    assert json.loads(cli(url, "locks", "--json").stdout) == []

    # The holder's next renewal finds the lease gone: CMD is ended and it exits 77.
    code, _, err = finish(holder, timeout=30)
    assert code == 77, err
    assert "lost" in err

    # The next holder gets a higher token.
    after = cli(url, "run", "--lock", "deploy", "--", *script(_PRINT_TOKEN))
    assert after.returncode == 0, after.stderr
    assert int(after.stdout.split()[0]) > token

    free = cli(url, "unlock", "deploy", "--force")
    assert free.returncode == 1
    assert "not held" in free.stderr


def test_unlock_force_with_the_holders_token_frees_it(
    url: str,
    tmp_path: Path,
    procs: list[subprocess.Popen[str]],
) -> None:
    holder = start(
        url, "run", "--lock", "job", "--spec", "nightly", "--ttl", "3s", "--",
        *script(HOLD), str(tmp_path),
    )  # fmt: skip
    procs.append(holder)
    wait_for(tmp_path / "ready", holder)
    token = int((tmp_path / "ready").read_text().split()[0])
    # The default spec is the one `run --lock` uses: another spec's lock is left alone.
    assert cli(url, "unlock", "job", "--force").returncode == 1
    done = cli(url, "unlock", "job", "--spec", "nightly", "--force", "--token", str(token))
    assert done.returncode == 0, done.stderr
    assert json.loads(cli(url, "locks", "--json").stdout) == []
    code, _, err = finish(holder, timeout=30)
    assert code == 77, err


def test_help_says_what_unlock_and_forget_do_to_fences(url: str) -> None:
    unlock = cli(url, "unlock", "--help")
    assert unlock.returncode == 0
    text = " ".join(unlock.stdout.split())
    assert "--force" in text and "higher" in text and "fence" in text
    forget = cli(url, "forget", "--help")
    assert forget.returncode == 0
    text = " ".join(forget.stdout.split())
    assert "fence" in text and "higher" in text


_PRINT_TOKEN = "import os; print(os.environ['IDEMLOCK_FENCE_TOKEN'])"
