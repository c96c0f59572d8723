"""The ``idemlock`` command line, run for real in subprocesses against a SQLite file."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

import idemlock
from idemlock.cli import parse_duration

from .servers._proc import popen
from .servers.redis import RedisServer, free_port

PY = sys.executable


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'store.db'}"


def cli(url: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "idemlock", "--url", url, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(),
    )


def start(url: str, *args: str) -> subprocess.Popen[str]:
    return popen(
        [PY, "-m", "idemlock", "--url", url, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=False,
    )


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("IDEMLOCK_URL", None)
    return env


def script(code: str) -> list[str]:
    """A child command: a Python one-liner (portable, unlike sh)."""
    return [PY, "-c", code]


def wait_for(path: Path, proc: subprocess.Popen[str] | None = None, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"process exited with {proc.returncode} early: {out}{err}")
        if time.monotonic() > deadline:
            pytest.fail(f"{path} did not appear within {timeout}s")
        time.sleep(0.02)


def finish(proc: subprocess.Popen[str], timeout: float = 20) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[list[subprocess.Popen[str]]]:
    started: list[subprocess.Popen[str]] = []
    yield started
    # First let every HOLD child end: one whose idemlock is killed below would poll for
    # `release` forever, an orphan holding idemlock's stdout and stderr, and the
    # communicate() below would wait for it (a hung suite, after a failed test).
    (tmp_path / "release").touch()
    for p in started:  # never leave a child behind on failure
        if p.poll() is None:
            p.kill()
            p.communicate(timeout=60)


# The child holds until the test creates `release`, after announcing itself in `ready`.
HOLD = (
    "import os, pathlib, sys, time\n"
    "d = pathlib.Path(sys.argv[1])\n"
    # written whole, then renamed: a reader never finds it empty (wait_for sees the name)
    "(d / 'ready.tmp').write_text(os.environ['IDEMLOCK_FENCE_TOKEN'] + ' ' + str(os.getpid()))\n"
    "(d / 'ready.tmp').rename(d / 'ready')\n"
    "while not (d / 'release').exists(): time.sleep(0.02)\n"
)
ECHO_TOKEN = "import os; print(os.environ['IDEMLOCK_FENCE_TOKEN'], os.environ['IDEMLOCK_LOCK_KEY'])"


# ---- durations -----------------------------------------------------------------


def test_parse_duration_units() -> None:
    assert parse_duration("500ms") == 0.5
    assert parse_duration("30s") == 30
    assert parse_duration("5m") == 300
    assert parse_duration("24h") == 86400
    assert parse_duration("1d") == 86400
    assert parse_duration("1.5") == 1.5
    assert parse_duration("0") == 0


def test_bad_durations_are_usage_errors(url: str) -> None:
    for opt, value in [("--ttl", "5x"), ("--wait", "-1s"), ("--ttl", "0"), ("--wait", "ten")]:
        r = cli(url, "run", "--lock", "x", f"{opt}={value}", "--", PY, "-c", "pass")
        assert r.returncode == 2, (opt, value, r.stderr)
        assert "invalid duration" in r.stderr
        assert "Traceback" not in r.stderr


# ---- run --lock ----------------------------------------------------------------


def test_lock_exports_increasing_token_and_passes_status_through(url: str) -> None:
    first = cli(url, "run", "--lock", "job", "--", *script(ECHO_TOKEN + "; raise SystemExit(7)"))
    assert first.returncode == 7, first.stderr
    token1, key = first.stdout.split()
    assert key == "job"
    second = cli(url, "run", "--lock", "job", "--", *script(ECHO_TOKEN))
    assert second.returncode == 0, second.stderr
    assert int(second.stdout.split()[0]) > int(token1)
    # A child killed by a signal exits 128+N, as in a shell.
    killed = cli(url, "run", "--lock", "job", "--", *script("import os; os.kill(os.getpid(), 15)"))
    assert killed.returncode == 128 + signal.SIGTERM
    missing = cli(url, "run", "--lock", "job", "--", "no-such-command-idemlock")
    assert missing.returncode == 127
    assert "command not found" in missing.stderr


def test_lock_is_exclusive_and_listed(
    url: str, tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    holder = start(url, "run", "--lock", "deploy", "--", *script(HOLD), str(tmp_path))
    procs.append(holder)
    wait_for(tmp_path / "ready", holder)
    token_a = int((tmp_path / "ready").read_text().split()[0])

    busy = cli(url, "run", "--lock", "deploy", "--wait", "0", "--", *script("print('ran')"))
    assert busy.returncode == 75, busy.stderr
    assert "ran" not in busy.stdout
    assert "is held" in busy.stderr and "not run" in busy.stderr

    listed = cli(url, "locks")
    assert listed.returncode == 0
    header, row = listed.stdout.strip().splitlines()
    assert header.split() == ["TENANT", "SPEC", "KEY", "OWNER", "TOKEN", "TIME", "LEFT"]
    assert row.split()[:3] == ["-", "cli-lock", "deploy"] and row.split()[4] == str(token_a)
    (entry,) = json.loads(cli(url, "locks", "--json").stdout)
    assert entry["spec"] == "cli-lock" and entry["key"] == "deploy"
    assert entry["token"] == token_a and 0 < entry["time_left_s"] <= 30
    assert str(holder.pid) in entry["owner"]

    # A waiter gets the lock as soon as the holder is done, with a higher token.
    waiter = start(url, "run", "--lock", "deploy", "--wait", "20s", "--", *script(ECHO_TOKEN))
    procs.append(waiter)
    time.sleep(0.5)
    assert waiter.poll() is None  # still waiting
    (tmp_path / "release").touch()
    assert finish(holder)[0] == 0
    code, out, err = finish(waiter)
    assert code == 0, err
    assert int(out.split()[0]) > token_a
    assert json.loads(cli(url, "locks", "--json").stdout) == []


def test_semaphore_admits_n_runs_and_permits_lists_them(
    url: str, tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    holders = []
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        p = start(
            url, "run", "--semaphore", "exports:2", "--key", "t42", "--", *script(HOLD), str(d)
        )
        procs.append(p)
        holders.append((p, d))
    for p, d in holders:
        wait_for(d / "ready", p)
    tokens = sorted(int((d / "ready").read_text().split()[0]) for _, d in holders)
    assert tokens[0] < tokens[1]

    full = cli(
        url,
        "run",
        "--semaphore",
        "exports:2",
        "--key",
        "t42",
        "--wait",
        "0",
        "--",
        *script("print('ran')"),
    )
    assert full.returncode == 75, full.stderr
    assert "ran" not in full.stdout and "every permit stayed held" in full.stderr
    # Another key of the same semaphore has its own permits.
    other = cli(url, "run", "--semaphore", "exports:2", "--key", "t7", "--", *script(ECHO_TOKEN))
    assert other.returncode == 0, other.stderr
    assert other.stdout.split()[1] == "t7"

    listed = json.loads(cli(url, "permits", "exports", "t42", "--json").stdout)
    assert sorted(r["token"] for r in listed) == tokens
    pids = {str(p.pid) for p, _ in holders}
    assert {r["owner"].split(":")[1] for r in listed} == pids
    table = cli(url, "permits", "exports", "t42").stdout.strip().splitlines()
    assert table[0].split() == ["OWNER", "TOKEN", "TIME", "LEFT", "VALUE"] and len(table) == 3

    (tmp_path / "a" / "release").touch()
    (tmp_path / "b" / "release").touch()
    assert [finish(p)[0] for p, _ in holders] == [0, 0]
    assert json.loads(cli(url, "permits", "exports", "t42", "--json").stdout) == []
    assert "no permit" in cli(url, "permits", "exports", "t42").stderr


def test_leader_runs_one_at_a_time_and_leader_shows_it(
    url: str, tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    assert json.loads(cli(url, "leader", "scheduler", "eu-west", "--json").stdout) is None
    lead = start(
        url,
        "run",
        "--leader",
        "scheduler",
        "--key",
        "eu-west",
        "--value",
        "host-a:8080",
        "--",
        *script(HOLD),
        str(tmp_path),
    )
    procs.append(lead)
    wait_for(tmp_path / "ready", lead)
    term = int((tmp_path / "ready").read_text().split()[0])
    shown = json.loads(cli(url, "leader", "scheduler", "eu-west", "--json").stdout)
    assert (shown["value"], shown["term"]) == ("host-a:8080", term)
    assert "host-a:8080" in cli(url, "leader", "scheduler", "eu-west").stdout

    busy = cli(
        url,
        "run",
        "--leader",
        "scheduler",
        "--key",
        "eu-west",
        "--wait",
        "0",
        "--",
        *script("print('ran')"),
    )
    assert busy.returncode == 75, busy.stderr
    assert "host-a:8080" in busy.stderr and "ran" not in busy.stdout

    # A second candidate (waiting until elected) takes over when the leader is done.
    nxt = start(url, "run", "--leader", "scheduler", "--key", "eu-west", "--", *script(ECHO_TOKEN))
    procs.append(nxt)
    time.sleep(0.3)
    assert nxt.poll() is None
    (tmp_path / "release").touch()
    assert finish(lead)[0] == 0
    code, out, err = finish(nxt)
    assert code == 0, err
    assert int(out.split()[0]) > term
    assert "has no leader" in cli(url, "leader", "scheduler", "eu-west").stderr


def test_semaphore_and_leader_arguments_are_checked(url: str) -> None:
    for bad in ("exports", "exports:0", "exports:x", ":3"):
        r = cli(url, "run", "--semaphore", bad, "--", *script("pass"))
        assert r.returncode == 2 and "NAME:N" in r.stderr, bad
    r = cli(url, "run", "--lock", "x", "--key", "k", "--", *script("pass"))
    assert r.returncode == 2 and "--key applies" in r.stderr
    r = cli(url, "run", "--semaphore", "x:2", "--value", "v", "--", *script("pass"))
    assert r.returncode == 2 and "--value applies to --leader" in r.stderr


def test_lost_lease_terminates_the_child(
    url: str, tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    holder = start(url, "run", "--lock", "l", "--ttl", "1s", "--", *script(HOLD), str(tmp_path))
    procs.append(holder)
    wait_for(tmp_path / "ready", holder)
    child_pid = int((tmp_path / "ready").read_text().split()[1])
    # Pause idemlock itself (not the child) past the ttl, as a long GC or VM pause
    # would: the lease expires and another run takes the lock meanwhile.
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        time.sleep(1.3)
        other = cli(url, "run", "--lock", "l", "--wait", "0", "--", *script("pass"))
        assert other.returncode == 0, other.stderr
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    code, _, err = finish(holder)
    assert code == 77, err
    assert "lost the lease" in err
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)  # the child was terminated (and reaped)


def test_sigterm_is_forwarded_to_the_child(
    url: str, tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    child = (
        "import pathlib, signal, sys, time\n"
        "d = pathlib.Path(sys.argv[1])\n"
        "def bye(*a):\n"
        "    (d / 'got-term').touch(); sys.exit(5)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "(d / 'ready').touch()\n"
        "time.sleep(30)\n"
    )
    proc = start(url, "run", "--lock", "sig", "--", *script(child), str(tmp_path))
    procs.append(proc)
    wait_for(tmp_path / "ready", proc)
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc)
    assert code == 5, err
    assert (tmp_path / "got-term").exists()


# CMD is a shell whose own child (the "grandchild") records its pid, then the shell waits.
GRANDCHILD = 'sleep 100 & echo $! > "$1/grandchild"; touch "$1/ready"; wait'


def running_pid(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie whose reaper is slow has finished)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def gone_within(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while running_pid(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.fixture
def grandchildren(tmp_path: Path) -> Iterator[list[int]]:
    pids: list[int] = []
    yield pids
    written = tmp_path / "grandchild"
    if written.exists():
        pids.append(int(written.read_text()))
    for pid in pids:  # never leave one behind when a test fails
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_lost_lease_terminates_the_whole_process_group(
    url: str, tmp_path: Path, procs: list[subprocess.Popen[str]], grandchildren: list[int]
) -> None:
    holder = start(
        url, "run", "--lock", "g", "--ttl", "1s", "--grace", "2s",
        "--", "sh", "-c", GRANDCHILD, "sh", str(tmp_path),
    )  # fmt: skip
    procs.append(holder)
    wait_for(tmp_path / "ready", holder)
    grandchild = int((tmp_path / "grandchild").read_text())
    grandchildren.append(grandchild)
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        # Takes the lock once the paused holder's lease (ttl 1 s) has lapsed.
        other = cli(url, "run", "--lock", "g", "--wait", "20s", "--", *script("pass"))
        assert other.returncode == 0, other.stderr
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    code, _, err = finish(holder)
    assert code == 77, err
    # idemlock returned only once nothing of CMD ran anymore.
    assert not running_pid(grandchild), err
    assert "CMD was terminated (SIGTERM)" in err


def test_forwarded_sigterm_reaches_the_whole_process_group(
    url: str, tmp_path: Path, procs: list[subprocess.Popen[str]], grandchildren: list[int]
) -> None:
    proc = start(url, "run", "--once", "k-term", "--", "sh", "-c", GRANDCHILD, "sh", str(tmp_path))
    procs.append(proc)
    wait_for(tmp_path / "ready", proc)
    grandchild = int((tmp_path / "grandchild").read_text())
    grandchildren.append(grandchild)
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc)
    assert code == 128 + signal.SIGTERM, err
    assert gone_within(grandchild, 5), "the forwarded SIGTERM did not reach CMD's child"
    # A failed run frees the key.
    assert cli(url, "status", "k-term").returncode == 1


def test_processes_left_behind_by_cmd_are_ended_before_the_lock_is_released(
    url: str, tmp_path: Path, grandchildren: list[int]
) -> None:
    # The shell exits at once; its background child would run on without the lock.
    left_behind = 'trap "" TERM; sleep 100 & echo $! > "$1/grandchild"'
    r = cli(url, "run", "--lock", "bg", "--grace", "1s", "--", "sh", "-c", left_behind, "sh",
            str(tmp_path))  # fmt: skip
    grandchild = int((tmp_path / "grandchild").read_text())
    grandchildren.append(grandchild)
    assert r.returncode == 0, r.stderr
    assert not running_pid(grandchild), r.stderr
    assert "processes it started still run" in r.stderr
    assert "SIGKILL" in r.stderr  # it ignored SIGTERM (inherited from the trap)


# ---- run --once ----------------------------------------------------------------


def test_once_runs_once_then_skips(url: str, tmp_path: Path) -> None:
    log = tmp_path / "log"
    append = script(
        "import os, sys; open(sys.argv[1], 'a').write(os.environ['IDEMLOCK_FENCE_TOKEN'] + '\\n')"
    )
    cmd = ["run", "--once", "backup-2024", "--", *append, str(log)]
    first = cli(url, *cmd)
    assert first.returncode == 0, first.stderr
    again = cli(url, *cmd)
    assert again.returncode == 0
    assert "already ran" in again.stderr and "ran at" in again.stderr
    assert len(log.read_text().splitlines()) == 1

    status = cli(url, "status", "backup-2024")
    assert status.returncode == 0
    header, row = status.stdout.strip().splitlines()
    assert header.split() == ["TENANT", "SPEC", "KEY", "STATE", "FENCE", "EXPIRES"]
    assert row.split()[:4] == ["-", "cli-once", "backup-2024", "completed"]
    record = json.loads(cli(url, "status", "backup-2024", "--json").stdout)
    assert record["state"] == "completed" and record["key"] == "backup-2024"
    assert 86000 < record["expires_in_s"] <= 86400
    (listed,) = json.loads(cli(url, "keys", "--json").stdout)
    assert listed == {**record, "expires_in_s": listed["expires_in_s"]}
    assert "backup-2024" in cli(url, "keys").stdout

    # --url and --prefix also work after the command; another prefix sees nothing.
    other = subprocess.run(
        [PY, "-m", "idemlock", "keys", "--json", "--url", url, "--prefix", "other"],
        capture_output=True,
        text=True,
        env=_env(),
    )
    assert json.loads(other.stdout) == []

    forgot = cli(url, "forget", "backup-2024")
    assert forgot.returncode == 0 and "forgot" in forgot.stderr
    missing = cli(url, "status", "backup-2024")
    assert missing.returncode == 1 and "no live record" in missing.stderr
    assert cli(url, "status", "backup-2024", "--json").stdout.strip() == "null"
    third = cli(url, *cmd)
    assert third.returncode == 0
    fences = [int(x) for x in log.read_text().split()]
    assert len(fences) == 2 and fences[1] > fences[0]


def test_once_failure_frees_the_key_for_a_retry(url: str, tmp_path: Path) -> None:
    log, fail = tmp_path / "log", tmp_path / "fail"
    fail.touch()
    flaky = script(
        "import pathlib, sys\n"
        "d = pathlib.Path(sys.argv[1])\n"
        "open(d / 'log', 'a').write('run\\n')\n"
        "sys.exit(3 if (d / 'fail').exists() else 0)\n"
    )
    cmd = ["run", "--once", "migrate-42", "--", *flaky, str(tmp_path)]
    failed = cli(url, *cmd)
    assert failed.returncode == 3
    assert "retry" in failed.stderr
    assert cli(url, "status", "migrate-42").returncode == 1
    fail.unlink()
    assert cli(url, *cmd).returncode == 0
    assert cli(url, *cmd).returncode == 0  # skipped
    assert log.read_text().splitlines() == ["run", "run"]


def test_once_key_reused_for_another_command_is_refused(url: str, tmp_path: Path) -> None:
    assert cli(url, "run", "--once", "k", "--", *script("print('a')")).returncode == 0
    other = cli(url, "run", "--once", "k", "--", *script("print('b')"))
    assert other.returncode == 65
    assert "different command" in other.stderr
    assert "b" not in other.stdout


def test_once_in_flight_elsewhere(
    url: str, tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    cmd = ["run", "--once", "report", "--", *script(HOLD), str(tmp_path)]
    first = start(url, *cmd)
    procs.append(first)
    wait_for(tmp_path / "ready", first)
    busy = cli(url, *cmd)
    assert busy.returncode == 76
    assert "being run elsewhere" in busy.stderr
    (in_flight,) = json.loads(cli(url, "keys", "--json").stdout)
    assert in_flight["state"] == "in_flight"
    # --wait waits for the run in flight and then skips, since it succeeded.
    waiter = start(url, "run", "--once", "report", "--wait", "20s", "--", *cmd[4:])
    procs.append(waiter)
    time.sleep(0.3)
    (tmp_path / "release").touch()
    assert finish(first)[0] == 0
    code, _, err = finish(waiter)
    assert code == 0 and "already ran" in err


def test_once_cmd_running_three_leases_runs_once_and_exits_0(
    url: str, tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    """Heartbeats (issue 11): the claim is renewed while CMD runs, so a CMD taking 3x
    --lease keeps KEY; a second run meanwhile is refused (76), and CMD runs once."""
    log = tmp_path / "log"
    slow = script(
        "import pathlib, sys, time\n"
        "d = pathlib.Path(sys.argv[1])\n"
        "(d / 'ready').touch()\n"
        "time.sleep(3.0)\n"
        # and on until the test has seen the second run refused: a loaded machine
        # may start that run late, after a CMD of a fixed length had finished
        "while not (d / 'release').exists(): time.sleep(0.02)\n"
        "open(d / 'log', 'a').write('ran\\n')\n"
    )
    cmd = ["run", "--once", "long-job", "--lease", "1s", "--", *slow, str(tmp_path)]
    first = start(url, *cmd)
    procs.append(first)
    wait_for(tmp_path / "ready", first)
    time.sleep(1.5)  # past the lease: only the renewals keep the key
    busy = cli(url, *cmd)
    (tmp_path / "release").touch()
    assert busy.returncode == 76, busy.stderr
    code, _, err = finish(first)
    assert code == 0, err
    assert log.read_text().splitlines() == ["ran"]
    again = cli(url, *cmd)
    assert again.returncode == 0 and "already ran" in again.stderr
    assert log.read_text().splitlines() == ["ran"]


def test_once_lost_claim_terminates_the_process_group_and_exits_77(
    url: str, tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    """idemlock paused past --lease: another run takes KEY over; when idemlock resumes
    it learns the claim is lost, terminates CMD's group and exits 77, recording nothing."""
    cmd = [*script(HOLD), str(tmp_path)]
    holder = start(url, "run", "--once", "paused", "--lease", "1s", "--", *cmd)
    procs.append(holder)
    wait_for(tmp_path / "ready", holder)
    child_pid = int((tmp_path / "ready").read_text().split()[1])
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        time.sleep(1.5)
        with idemlock.connect(url) as coord:
            port = coord.idempotency(
                idemlock.IdempotencySpec("cli-once", lease=timedelta(seconds=30))
            )
            taken = port.claim("paused", payload={"argv": cmd})
            assert isinstance(taken, idemlock.Claimed)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    code, _, err = finish(holder)
    assert code == 77, err
    assert "lost the claim" in err and "CMD was terminated" in err
    assert gone_within(child_pid, 5)
    with idemlock.connect(url) as coord:
        status = coord.idempotency("cli-once").status("paused")
        # Nothing recorded: the attempt that took over still holds it.
        assert status is not None and (status.state, status.fence) == (
            "in_flight",
            taken.token.fence,
        )


# ---- other commands and errors -------------------------------------------------


def test_errors_are_messages_with_documented_statuses(url: str) -> None:
    bad_url = cli("bogus://nowhere", "keys")
    assert bad_url.returncode == 78
    assert bad_url.stderr.startswith("idemlock: error: unknown store URL scheme")
    bad_key = cli(url, "run", "--once", "has space", "--", PY, "-c", "pass")
    assert bad_key.returncode == 2
    assert bad_key.stderr.startswith("idemlock: error: key 'has space'")
    no_cmd = cli(url, "run", "--lock", "x")
    assert no_cmd.returncode == 2
    for r in (bad_url, bad_key, no_cmd):
        assert "Traceback" not in r.stderr
    helptext = cli(url, "--help").stdout
    assert "exit statuses:" in helptext and "75" in helptext and "128+N" in helptext


def test_status_steps_lists_the_recorded_steps(url: str) -> None:
    with idemlock.connect(url) as coord:
        port = coord.idempotency("cli-steps")
        with port.run("order-1") as attempt:
            attempt.step("charge", lambda: {"id": "ch_1"})
            attempt.step("wire", lambda: None, once=True)  # recorded: None is a result
            attempt.result = 1
        fence = attempt.fence
    shown = cli(url, "status", "order-1", "--spec", "cli-steps", "--steps", "--json")
    assert shown.returncode == 0, shown.stderr
    steps = json.loads(shown.stdout)["steps"]
    assert [(s["name"], s["state"], s["fence"]) for s in steps] == [
        ("charge", "done", fence),
        ("wire", "done", fence),
    ]
    assert all(s["size"] > 0 for s in steps)
    table = cli(url, "status", "order-1", "--spec", "cli-steps", "--steps").stdout
    assert "STEP" in table and "charge" in table and "wire" in table
    plain = cli(url, "status", "order-1", "--spec", "cli-steps", "--json")
    assert "steps" not in json.loads(plain.stdout)


def test_empty_listings_purge_and_migrate(url: str) -> None:
    assert json.loads(cli(url, "keys", "--json").stdout) == []
    assert json.loads(cli(url, "locks", "--json").stdout) == []
    assert "no held locks" in cli(url, "locks").stderr
    purged = cli(url, "purge", "--json")
    assert purged.returncode == 0 and json.loads(purged.stdout) == {"purged": 0}
    migrated = cli(url, "migrate")
    assert migrated.returncode == 0 and "nothing to migrate" in migrated.stdout


def test_migrate_takes_the_stores_url_and_its_schema(postgres_dsn: str) -> None:
    # The app's own URL (idemlock's ?timeout= in it) and the schema= the store opens.
    url = postgres_dsn + "?timeout=3"
    default = cli(url, "migrate")
    assert default.returncode == 0, default.stderr
    assert "migrated schema idemlock of" in default.stdout
    schema = "cli_" + uuid.uuid4().hex[:10]
    migrated = cli(url, "migrate", "--schema", schema)
    assert migrated.returncode == 0, migrated.stderr
    assert f"migrated schema {schema} of" in migrated.stdout
    coord = idemlock.connect(url, schema=schema, auto_migrate=False)
    try:
        assert coord.idempotency("once").status("k") is None
    finally:
        coord.close()
    bad = cli(url, "migrate", "--schema", "no-such; schema")
    assert bad.returncode == 78 and "plain PostgreSQL identifier" in bad.stderr


# ---- the demo ------------------------------------------------------------------


def test_demo_measures_duplicates_and_idemlock_has_none(tmp_path: Path) -> None:
    r = subprocess.run(
        [PY, "-m", "idemlock", "demo", "--jobs", "40", "--workers", "3", "--seed", "7", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**_env(), "TMPDIR": str(tmp_path)},
    )
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    plain, protected = report["runs"]["plain"], report["runs"]["idemlock"]
    for run in (plain, protected):
        assert run["jobs_done"] == 40 and run["jobs_missing_effect"] == 0
        assert run["deliveries"] >= 40
        assert run["effects"] == 40 + run["duplicate_effects"]
    assert protected["duplicate_effects"] == 0
    assert protected["jobs_run_twice_or_more"] == 0
    # Its own throwaway store in a temporary directory, removed afterwards.
    assert report["idemlock_url"].startswith(f"sqlite:///{report['dir']}")
    assert not Path(report["dir"]).exists()


# ---- listings: tenants, corrupt values ---------------------------------------------


def test_listings_name_tenants_and_status_forget_act_on_them(url: str) -> None:
    with idemlock.connect(url) as coord:
        root = coord.idempotency("cli-once")
        acme = coord.for_tenant("acme")
        claim = acme.idempotency("cli-once").claim("job-1", payload={"argv": ["x"]})
        assert isinstance(claim, idemlock.Claimed)
        acme.idempotency("cli-once").complete(claim.token, {"exit_status": 0})
        mine = root.claim("job-0", payload={"argv": ["y"]})
        assert isinstance(mine, idemlock.Claimed)
        lease = acme.lock("cli-lock").acquire("nightly")
        assert lease is not None

        listed = json.loads(cli(url, "keys", "--json").stdout)
        assert {(r["tenant"], r["key"], r["state"]) for r in listed} == {
            ("acme", "job-1", "completed"),
            (None, "job-0", "in_flight"),
        }
        table = cli(url, "keys").stdout.splitlines()
        assert table[0].split()[:3] == ["TENANT", "SPEC", "KEY"]
        assert sorted(line.split()[0] for line in table[1:]) == ["-", "acme"]
        only = json.loads(cli(url, "keys", "--tenant", "acme", "--json").stdout)
        assert [(r["tenant"], r["key"]) for r in only] == [("acme", "job-1")]
        (held,) = json.loads(cli(url, "locks", "--json").stdout)
        assert (held["tenant"], held["key"], held["token"]) == ("acme", "nightly", lease.token)

        # What is listed can be acted on: the tenant's record, through --tenant.
        assert cli(url, "status", "job-1").returncode == 1  # not the root's
        status = cli(url, "status", "job-1", "--tenant", "acme", "--json")
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["tenant"] == "acme"
        forgot = cli(url, "forget", "job-1", "--tenant", "acme")
        assert forgot.returncode == 0 and "forgot key 'job-1'" in forgot.stderr
        assert acme.idempotency("cli-once").status("job-1") is None
        assert root.status("job-0") is not None  # the root's record is untouched
        bad = cli(url, "keys", "--tenant", "has space")
        assert bad.returncode == 2 and "Traceback" not in bad.stderr


def _foreign_sqlite_rows(db: Path) -> None:
    """Rows under the prefix that idemlock did not write: a state and numbers it
    cannot read."""
    with sqlite3.connect(db) as conn:
        conn.execute(
            "INSERT INTO claims (ns, key, state, token, fence, fp, expires_ms, result) "
            "VALUES ('idemlock:cli-once', 'foreign', 'weird', 't', "
            "'not a number', NULL, 99999999999999, NULL)"
        )
        conn.execute(
            "INSERT INTO locks VALUES ('idemlock:cli-lock', 'foreign', 5, 'x', 99999999999999)"
        )


def _assert_corrupt_listed(url: str, good_key: str) -> None:
    keys = cli(url, "keys")
    assert keys.returncode == 0, keys.stderr
    rows = {line.split()[2]: line.split() for line in keys.stdout.splitlines()[1:]}
    assert rows["foreign"][3] == "CORRUPT"
    assert rows[good_key][3] == "completed"  # the rest is listed as usual
    assert "1 record(s) under the prefix could not be read" in keys.stderr
    listed = json.loads(cli(url, "keys", "--json").stdout)
    states = {r["key"]: r["state"] for r in listed}
    assert states == {"foreign": "corrupt", good_key: "completed"}
    locks = cli(url, "locks")
    assert locks.returncode == 0, locks.stderr
    assert any(line.split()[2:4] == ["foreign", "CORRUPT"] for line in locks.stdout.splitlines())
    assert "1 lock(s) under the prefix could not be read" in locks.stderr
    (lock,) = [h for h in json.loads(cli(url, "locks", "--json").stdout) if h["key"] == "foreign"]
    assert lock["corrupt"] is True and lock["token"] is None


def test_a_corrupt_sqlite_value_is_listed_not_fatal(url: str, tmp_path: Path) -> None:
    ran = cli(url, "run", "--once", "good", "--", *script("pass"))
    assert ran.returncode == 0, ran.stderr
    _foreign_sqlite_rows(tmp_path / "store.db")
    _assert_corrupt_listed(url, "good")


def test_a_foreign_redis_value_is_listed_not_fatal(redis_server: RedisServer) -> None:
    from idemlock.stores.redis import _common

    prefix = "cli" + uuid.uuid4().hex[:8]
    url = redis_server.url
    ran = cli(url, "--prefix", prefix, "run", "--once", "good", "--", *script("pass"))
    assert ran.returncode == 0, ran.stderr
    names = _common.names(f"{prefix}:cli-once", "foreign")
    locks = _common.names(f"{prefix}:cli-lock", "foreign")
    client: Any = redis_server.client()
    with client:
        client.set(names.claim, b"written by another program")
        # The store's own field names (owner, token, expiry), values it cannot read.
        fields = dict(zip(_common.LOCK_FIELDS, (b"x", b"not a number", b"y"), strict=True))
        client.hset(locks.lock, mapping=fields)
    try:
        _assert_corrupt_listed_prefixed(url, prefix)
    finally:
        with client:
            client.delete(names.claim, locks.lock)


def _assert_corrupt_listed_prefixed(url: str, prefix: str) -> None:
    keys = cli(url, "--prefix", prefix, "keys", "--json")
    assert keys.returncode == 0, keys.stderr
    states = {r["key"]: r["state"] for r in json.loads(keys.stdout)}
    assert states == {"foreign": "corrupt", "good": "completed"}
    assert "1 record(s) under the prefix could not be read" in keys.stderr
    locks = cli(url, "--prefix", prefix, "locks", "--json")
    assert locks.returncode == 0, locks.stderr
    assert [(h["key"], h["corrupt"]) for h in json.loads(locks.stdout)] == [("foreign", True)]


# ---- secrets in store URLs ------------------------------------------------------


def test_a_password_in_the_url_is_never_printed(tmp_path: Path) -> None:
    secret = "s3cretPW" + uuid.uuid4().hex[:6]
    server = RedisServer(tmp_path / "redis", free_port())
    server.start()
    try:
        admin: Any = server.client()
        with admin:
            admin.config_set("requirepass", secret)  # after start: the fixture PINGs
        url = f"{server.url}?password={secret}"
        outputs = []
        purged = cli(url, "purge")
        assert purged.returncode == 0, purged.stderr
        assert "purged 0" in purged.stdout
        outputs.append(purged)
        empty = cli(url, "keys")
        assert empty.returncode == 0 and "no live records" in empty.stderr
        outputs.append(empty)
        wrong = cli(f"{server.url}?password=wrong{secret}", "keys")
        assert wrong.returncode == 69, wrong.stderr  # refused: a store error, still no secret
        outputs.append(wrong)
        closed = f"redis://:{secret}@127.0.0.1:{free_port()}/0?password={secret}"
        down = cli(closed, "keys")
        assert down.returncode == 69, down.stderr
        outputs.append(down)
        bogus = cli(f"bogus://user:{secret}@host/?password={secret}", "keys")
        assert bogus.returncode == 78, bogus.stderr
        outputs.append(bogus)
        env = {**_env(), "IDEMLOCK_URL": url}
        helped = subprocess.run(
            [PY, "-m", "idemlock", "--help"], capture_output=True, text=True, env=env, timeout=30
        )
        assert helped.returncode == 0 and "store URL" in helped.stdout
        outputs.append(helped)
        for out in outputs:
            assert secret not in out.stdout + out.stderr, out.args
    finally:
        server.stop()


def test_once_success_that_cannot_be_recorded_keeps_the_key_reserved(
    url: str, tmp_path: Path, procs: list[subprocess.Popen[str]]
) -> None:
    """The store fails (here: the SQLite file is locked by another writer) when CMD's
    success is recorded: exit 69 saying so, and the key stays reserved, so a retry does
    not run CMD again at once."""
    wait_go = (
        "import pathlib, sys, time\n"
        "d = pathlib.Path(sys.argv[1])\n"
        "(d / 'ready').touch()\n"
        "while not (d / 'go').exists(): time.sleep(0.02)\n"
        "open(d / 'ran', 'a').write('x')\n"
    )
    short = f"{url}?timeout=0.5"
    proc = start(short, "run", "--once", "k-rec", "--", *script(wait_go), str(tmp_path))
    procs.append(proc)
    wait_for(tmp_path / "ready", proc)
    blocker = sqlite3.connect(tmp_path / "store.db", isolation_level=None)
    try:
        blocker.execute("BEGIN EXCLUSIVE")
        (tmp_path / "go").touch()
        code, _, err = finish(proc)
    finally:
        blocker.rollback()
        blocker.close()
    assert code == 69, err
    assert "CMD succeeded, but the store failed to record it" in err
    assert "stays reserved" in err
    status = json.loads(cli(url, "status", "k-rec", "--json").stdout)
    assert status["state"] == "in_flight"  # not abandoned
    again = cli(url, "run", "--once", "k-rec", "--", *script(wait_go), str(tmp_path))
    assert again.returncode == 76, again.stderr
    assert (tmp_path / "ran").read_text() == "x"  # CMD ran once


def test_on_a_terminal_cmd_is_the_foreground_group(url: str, tmp_path: Path) -> None:
    """Run from a terminal, CMD's process group is made the foreground one: CMD can
    prompt on the terminal, and Ctrl-C reaches it and its children (once, directly)."""
    import pty
    import select

    child = (
        "import os, pathlib, subprocess, sys, time\n"
        "d = pathlib.Path(sys.argv[1])\n"
        "fg = os.tcgetpgrp(0) == os.getpgrp() != os.getsid(0)\n"
        "g = subprocess.Popen(['sleep', '100'])\n"
        "(d / 'grandchild').write_text(str(g.pid))\n"
        "print('foreground' if fg else 'not foreground', flush=True)\n"
        "print('got ' + input('name? '), flush=True)\n"
        "time.sleep(100)\n"
    )
    argv = [PY, "-m", "idemlock", "--url", url, "run", "--lock", "tty", "--",
            *script(child), str(tmp_path)]  # fmt: skip
    pid, master = pty.fork()
    if pid == 0:  # the child: a session leader whose terminal is the pty
        os.execve(PY, argv, _env())
    seen = b""

    def read_until(text: bytes, timeout: float = 20) -> None:
        nonlocal seen
        deadline = time.monotonic() + timeout
        while text not in seen:
            left = deadline - time.monotonic()
            assert left > 0, f"{text!r} did not appear in {seen!r}"
            if select.select([master], [], [], left)[0]:
                try:
                    seen += os.read(master, 4096)
                except OSError:  # the terminal closed
                    break
        assert text in seen, seen

    try:
        read_until(b"name? ")
        assert b"not foreground" not in seen and b"foreground" in seen
        os.write(master, b"alice\n")
        read_until(b"got alice")
        grandchild = int((tmp_path / "grandchild").read_text())
        os.write(master, b"\x03")  # Ctrl-C, from the terminal
        deadline = time.monotonic() + 20
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() < deadline, seen
            if select.select([master], [], [], 0.05)[0]:
                with contextlib.suppress(OSError):
                    seen += os.read(master, 4096)
        assert os.waitstatus_to_exitcode(status) == 128 + signal.SIGINT, seen
        assert gone_within(grandchild, 5)
    finally:
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(master)
        written = tmp_path / "grandchild"
        if written.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(written.read_text()), signal.SIGKILL)


def _pty_run(argv: list[str]) -> tuple[int, int]:
    """Start ``argv`` with a pseudo-terminal as its stdin, stdout and stderr."""
    import pty

    pid, master = pty.fork()
    if pid == 0:  # the child: a session leader whose terminal is the pty
        os.execve(PY, argv, _env())
    return pid, master


def test_a_wait_on_a_terminal_says_once_whom_it_waits_for(url: str) -> None:
    import select

    import idemlock

    with idemlock.connect(url) as coord:
        lock = coord.lock("cli-lock")
        lease = lock.acquire("nightly", owner="vm:32193:3eb0eb")
        assert lease is not None
        argv = [PY, "-m", "idemlock", "--url", url, "run", "--lock", "nightly", "--wait", "60s",
                "--", *script("print('ran')")]  # fmt: skip
        pid, master = _pty_run(argv)
        seen = b""
        try:
            deadline = time.monotonic() + 30
            while b"ran" not in seen:
                assert time.monotonic() < deadline, seen
                if b"waiting for lock" in seen and lease is not None:
                    lock.release(lease)  # seen waiting: now let it run
                    lease = None
                if select.select([master], [], [], 0.05)[0]:
                    try:
                        seen += os.read(master, 4096)
                    except OSError:
                        break
            _, status = os.waitpid(pid, 0)
        finally:
            with contextlib.suppress(ChildProcessError, ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            os.close(master)
    text = seen.decode("utf-8", "replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert text.count("waiting for lock") == 1
    assert "waiting for lock 'nightly' held by vm:32193:3eb0eb (" in text
    assert "s left on its lease), up to --wait 1m00s\u2026" in text


def test_a_wait_off_a_terminal_prints_nothing_extra(url: str) -> None:
    import idemlock

    with idemlock.connect(url) as coord:
        lock = coord.lock("cli-lock")
        assert lock.acquire("nightly", owner="elsewhere") is not None
        r = cli(url, "run", "--lock", "nightly", "--wait", "0.3s", "--", *script("print(1)"))
    assert r.returncode == 75
    assert "waiting" not in r.stderr and "is held by elsewhere" in r.stderr


def _pty_output(argv: list[str], timeout: float = 60) -> tuple[int, str]:
    """Run ``argv`` on a pseudo-terminal to its end: its exit code and all it wrote."""
    import select

    pid, master = _pty_run(argv)
    seen = b""
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert time.monotonic() < deadline, seen
            if select.select([master], [], [], 0.05)[0]:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # the child closed the terminal: it has ended
                    break
                if not chunk:
                    break
                seen += chunk
        _, status = os.waitpid(pid, 0)
    finally:
        with contextlib.suppress(ChildProcessError, ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(master)
    return os.waitstatus_to_exitcode(status), seen.decode("utf-8", "replace")


@pytest.mark.parametrize("dry_run", [False, True], ids=["purge", "dry-run"])
def test_a_purge_on_a_terminal_shows_a_progress_line_then_its_result(
    url: str, dry_run: bool
) -> None:
    extra = ["--dry-run"] if dry_run else []
    code, text = _pty_output([PY, "-m", "idemlock", "--url", url, "purge", *extra])
    assert code == 0, text
    doing = "counting" if dry_run else "purging"
    # drawn in place (carriage return), erased before the result line
    assert f"\ridemlock: {doing} expired records and locks in " in text, text
    assert "\r\x1b[K" in text, text
    assert ("would purge 0" if dry_run else "purged 0") in text, text


def test_a_purge_off_a_terminal_prints_only_its_result(url: str) -> None:
    for extra in ([], ["--dry-run"]):
        r = cli(url, "purge", *extra)
        assert r.returncode == 0, r.stderr
        assert r.stderr == "", r.stderr
        assert "purge" in r.stdout and "\r" not in r.stdout


def test_a_once_wait_on_a_terminal_says_what_it_waits_for(url: str) -> None:
    import select

    import idemlock

    with idemlock.connect(url) as coord:
        port = coord.idempotency("cli-once")
        # The same command, started elsewhere first (the payload is the command).
        claim = port.claim("nightly", payload={"argv": script("print('ran')")})
        assert isinstance(claim, idemlock.Claimed)
        argv = [PY, "-m", "idemlock", "--url", url, "run", "--once", "nightly", "--wait", "60s",
                "--", *script("print('ran')")]  # fmt: skip
        pid, master = _pty_run(argv)
        seen, freed = b"", False
        try:
            deadline = time.monotonic() + 30
            while b"ran" not in seen:
                assert time.monotonic() < deadline, seen
                if b"waiting for 'nightly'" in seen and not freed:
                    port.abandon(claim.token)  # the run elsewhere failed: ours may run
                    freed = True
                if select.select([master], [], [], 0.05)[0]:
                    try:
                        seen += os.read(master, 4096)
                    except OSError:
                        break
            _, status = os.waitpid(pid, 0)
        finally:
            with contextlib.suppress(ChildProcessError, ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            os.close(master)
    text = seen.decode("utf-8", "replace")
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert text.count("waiting for 'nightly', being run elsewhere (") == 1, text


# ---- purge --dry-run -----------------------------------------------------------------


@pytest.fixture
def fresh_pg_db(postgres_dsn: str) -> Iterator[str]:
    """A database of its own: purge covers the store's whole tables, so a dry run's count
    must not see other tests' expired rows on the session's server."""
    from urllib.parse import urlsplit, urlunsplit

    import psycopg

    name = "purge_" + uuid.uuid4().hex[:10]
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield urlunsplit(urlsplit(postgres_dsn)._replace(path="/" + name))
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE {name} WITH (FORCE)")


def _store_url(store: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A store of its own (or an etcd root of its own) that the CLI opens by URL."""
    if store == "sqlite":
        return f"sqlite:///{tmp_path / 'purge.db'}"
    if store == "postgres":
        return str(request.getfixturevalue("fresh_pg_db"))
    if store == "redis":
        return str(request.getfixturevalue("redis_server").url)
    if store == "redis_cluster":
        return str(request.getfixturevalue("redis_cluster").url)
    assert store == "etcd"
    base = str(request.getfixturevalue("etcd_server").url)
    assert "?" not in base
    return f"{base}?prefix=purge-{uuid.uuid4().hex[:8]}/"


def _record_keys(coord: Any) -> set[str]:
    records = coord.keys()
    return {r.key for r in records}


def _wait_until(condition: Any, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


#: expired records and locks that a purge removes, per store: the SQL stores keep every
#: expired row until a purge; Redis expires keys by itself; etcd's locks and completed
#: records go with their etcd leases, its in-flight claims wait for a purge.
_PURGEABLE = {"sqlite": 4, "postgres": 4, "redis": 0, "redis_cluster": 0, "etcd": 2}


@pytest.mark.parametrize("store", list(_PURGEABLE))
def test_purge_dry_run_counts_what_purge_removes_and_removes_nothing(
    store: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    import asyncio

    import idemlock.aio

    url = _store_url(store, request, tmp_path)
    prefix = "dry" + uuid.uuid4().hex[:8]
    with idemlock.connect(url, key_prefix=prefix) as coord:
        short = coord.idempotency(idemlock.IdempotencySpec("short", ttl=0.3, lease=0.3))
        long = coord.idempotency(idemlock.IdempotencySpec("long", ttl=3600, lease=120))
        # Expired: two in-flight claims whose lease ended, one completed record whose
        # ttl ended, one lock whose lease ended. Live: one of each, far from expiring.
        for key in ("gone-1", "gone-2"):
            assert isinstance(short.claim(key), idemlock.Claimed)
        done = short.claim("gone-done")
        assert isinstance(done, idemlock.Claimed)
        short.complete(done.token, {"ok": 1})
        assert coord.lock(idemlock.LockSpec("short-lock", ttl=0.3)).acquire("gone") is not None
        assert isinstance(long.claim("live-1"), idemlock.Claimed)
        kept = long.claim("live-done")
        assert isinstance(kept, idemlock.Claimed)
        long.complete(kept.token, {"ok": 2})
        assert coord.lock(idemlock.LockSpec("long-lock", ttl=120)).acquire("held") is not None
        _wait_until(
            lambda: (
                _record_keys(coord) == {"live-1", "live-done"}
                and [h.key for h in coord.locks()] == ["held"]
            ),
            "the short ones to expire",
        )
    if store == "etcd":
        # etcd ends its leases in its own time (whole seconds): end the due ones now,
        # so what is left to purge does not change between the dry run and the purge.
        from .servers.etcd import expire_due

        base, _, query = url.partition("?")
        expire_due(base, root=query.removeprefix("prefix=").encode())
    expected = _PURGEABLE[store]

    dry = cli(url, "--prefix", prefix, "purge", "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout) == {"would_purge": expected, "dry_run": True}
    text = cli(url, "--prefix", prefix, "purge", "--dry-run")
    assert text.returncode == 0, text.stderr
    assert f"would purge {expected} expired record(s)" in text.stdout
    assert "nothing was removed" in text.stdout

    async def async_dry_run() -> int:
        async with idemlock.aio.connect(url, key_prefix=prefix) as acoord:
            return await acoord.purge(dry_run=True)

    assert asyncio.run(async_dry_run()) == expected  # the asyncio port counts the same

    purged = cli(url, "--prefix", prefix, "purge", "--json")
    assert purged.returncode == 0, purged.stderr
    assert json.loads(purged.stdout) == {"purged": expected}  # the dry runs removed nothing
    again = cli(url, "--prefix", prefix, "purge", "--dry-run", "--json")
    assert json.loads(again.stdout) == {"would_purge": 0, "dry_run": True}
    with idemlock.connect(url, key_prefix=prefix) as coord:  # the live ones are untouched
        assert _record_keys(coord) == {"live-1", "live-done"}
        assert [h.key for h in coord.locks()] == ["held"]


def test_purge_dry_run_counts_in_batches_on_postgres(
    fresh_pg_db: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL counts in keyset batches of PURGE_BATCH rows, as purge deletes: with
    batches of 2, five expired claims take three batches and two expired locks two
    (the last one empty); the sync and asyncio stores count the same."""
    import asyncio

    import idemlock.aio
    from idemlock.stores.postgres import _async, _sync

    monkeypatch.setattr(_async, "PURGE_BATCH", 2)
    monkeypatch.setattr(_sync, "PURGE_BATCH", 2)
    with idemlock.connect(fresh_pg_db, key_prefix="a") as coord:
        other = idemlock.connect(fresh_pg_db, key_prefix="b")
        for c, keys in ((coord, ("k1", "k2", "k3")), (other, ("k1", "k2"))):
            short = c.idempotency(idemlock.IdempotencySpec("s", ttl=0.2, lease=0.2))
            for key in keys:
                assert isinstance(short.claim(key), idemlock.Claimed)
        for key in ("x", "y"):
            assert coord.lock(idemlock.LockSpec("l", ttl=0.2)).acquire(key) is not None
        assert isinstance(coord.idempotency("long").claim("live"), idemlock.Claimed)
        _wait_until(
            lambda: _record_keys(coord) == {"live"} and not other.keys() and not coord.locks(),
            "the short ones to expire",
        )
        other.close()
        assert coord.purge(dry_run=True) == 7

        async def async_dry_run() -> int:
            async with idemlock.aio.connect(fresh_pg_db) as acoord:
                return await acoord.purge(dry_run=True)

        assert asyncio.run(async_dry_run()) == 7
        assert coord.purge() == 7
        assert coord.purge(dry_run=True) == 0


def test_purge_dry_run_on_the_memory_store_sync_and_async() -> None:
    """The in-process store (no CLI: another process cannot see it), both ports."""
    import asyncio

    import idemlock.aio

    clock = idemlock.ManualClock()
    coord = idemlock.connect("memory://", clock=clock)
    short = coord.idempotency(idemlock.IdempotencySpec("short", ttl=1, lease=1))
    assert isinstance(short.claim("a"), idemlock.Claimed)
    assert coord.lock(idemlock.LockSpec("l", ttl=1)).acquire("x") is not None
    assert isinstance(coord.idempotency("long").claim("b"), idemlock.Claimed)
    clock.advance(2)
    assert coord.purge(dry_run=True) == 2
    assert coord.purge(dry_run=True) == 2

    from idemlock.stores.memory import MemoryAsyncStore

    acoord = idemlock.aio.AsyncCoordinator(MemoryAsyncStore(coord.store), clock=clock)
    assert asyncio.run(acoord.purge(dry_run=True)) == 2
    assert coord.purge() == 2
    assert coord.purge(dry_run=True) == 0
    assert _record_keys(coord) == {"b"}


# ---- exit statuses in --help and docs/cli.md ---------------------------------------

#: What each sub-command can return, written out here (not derived from the code).
_EXPECTED_STATUSES = {
    "run": ["0", "2", "65", "69", "70", "75", "76", "77", "78", "126", "127", "128+N", "other"],
    "status": ["0", "1", "2", "69", "70", "78", "130"],
    "forget": ["0", "2", "69", "70", "78", "130"],
    "keys": ["0", "2", "69", "70", "78", "130"],
    "permits": ["0", "2", "69", "70", "78", "130"],
    "leader": ["0", "2", "69", "70", "78", "130"],
    "locks": ["0", "2", "69", "70", "78", "130"],
    "unlock": ["0", "1", "2", "69", "70", "78", "130"],
    "purge": ["0", "2", "69", "70", "78", "130"],
    "migrate": ["0", "2", "69", "70", "78", "130"],
    "demo": ["0", "2", "69", "70", "78", "130"],
}


def _help_statuses(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    from idemlock.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "exit statuses:" in out, out
    lines = out.split("exit statuses:\n", 1)[1].splitlines()
    # A status starts its line ("  69   ..."); a meaning's further lines are indented more.
    return [line.split()[0] for line in lines if line.startswith("  ") and line[2] != " "]


@pytest.mark.parametrize("command", list(_EXPECTED_STATUSES))
def test_each_commands_help_lists_exactly_its_exit_statuses(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _help_statuses([command, "--help"], capsys) == _EXPECTED_STATUSES[command]


def test_the_top_level_help_lists_every_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    every = {code for codes in _EXPECTED_STATUSES.values() for code in codes}
    assert set(_help_statuses(["--help"], capsys)) == every
    from idemlock.cli._common import COMMANDS

    assert set(COMMANDS) == set(_EXPECTED_STATUSES)  # a new command needs its line above


def test_docs_cli_md_has_the_exit_status_table_of_the_code() -> None:
    from idemlock.cli._common import exit_status_markdown

    doc = (Path(__file__).parent.parent / "docs" / "cli.md").read_text(encoding="utf-8")
    begin = "<!-- generated from EXIT_STATUSES in src/idemlock/cli/_common.py"
    end = "<!-- end of the generated table -->"
    assert begin in doc and end in doc
    shown = doc.split(begin, 1)[1].split("\n", 1)[1].split(end, 1)[0]
    assert shown == exit_status_markdown(), (
        "docs/cli.md's exit status table differs from the code's; replace it with:\n"
        + exit_status_markdown()
    )
