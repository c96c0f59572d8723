"""docs/states.md is what tools/gen_states.py generates from the state table."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from idemlock._core import table as T

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "gen_states.py"


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_states", TOOL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_states_doc_is_current() -> None:
    text = (ROOT / "docs" / "states.md").read_text()
    assert text == _tool().render(), "docs/states.md is stale: run python tools/gen_states.py"


def test_every_row_is_in_the_doc() -> None:
    text = (ROOT / "docs" / "states.md").read_text()
    for row in T.ROWS:
        assert f"| `{row.id}` |" in text, row.id


def test_the_store_error_rule_is_in_the_doc(monkeypatch: pytest.MonkeyPatch) -> None:
    # The table module's "Store errors." paragraph (what a caller may assume after
    # StoreUnavailable, durability= included) is generated into the page, once.
    text = (ROOT / "docs" / "states.md").read_text()
    section = text.split("## Store errors\n", 1)[1].split("\n## ", 1)[0]
    flat = " ".join(section.split())
    for said in (
        "`StoreUnavailable`",
        "`durability=`",
        "the row may have happened",
        "The same call re-sent is safe",
        "Tokens and fences never repeat",
    ):
        assert said in flat, said
    assert text.count("## Store errors") == 1
    assert "``" not in section and not any(
        ln.startswith(("+ ", "- ")) for ln in section.split("\n")
    )
    tool = _tool()
    monkeypatch.setattr(tool.T, "__doc__", "States. No store errors here.")
    with pytest.raises(SystemExit, match="Store errors"):
        tool.render()


def test_check_fails_on_a_stale_doc(tmp_path: Path) -> None:
    tool = _tool()
    tool.TARGET = tmp_path / "states.md"
    tool.TARGET.write_text("stale\n")
    assert tool.main(["--check"]) == 1
    assert tool.main([]) == 0
    assert tool.main(["--check"]) == 0


def test_check_runs_as_a_command() -> None:
    done = subprocess.run(
        [sys.executable, str(TOOL), "--check"], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def test_every_event_emitted_is_in_the_tables_vocabulary() -> None:
    # Drive each operation through its outcomes on the memory store and collect the
    # events: an outcome typed by hand somewhere, outside the table, shows up here.
    from datetime import timedelta

    import idemlock
    from idemlock import IdempotencySpec, LockSpec

    seen: list[tuple[str, str]] = []
    coord = idemlock.connect("memory://", hooks=[lambda e: seen.append((e.name, e.outcome))])
    port = coord.idempotency(IdempotencySpec("vocab", lease=timedelta(seconds=30)))
    first = port.claim("k", payload={"a": 1})
    assert isinstance(first, idemlock.Claimed)
    port.claim("k", payload={"a": 1})  # in flight
    with pytest.raises(idemlock.PayloadMismatch):
        port.claim("k", payload={"a": 2})
    port.complete(first.token, 1)
    port.claim("k", payload={"a": 1})  # replay
    again = port.claim("other")
    assert isinstance(again, idemlock.Claimed)
    port.abandon(again.token)
    with pytest.raises(idemlock.StaleClaim):
        port.complete(again.token, 2)
    with pytest.raises(idemlock.StaleClaim):
        port.abandon(again.token)
    locks = coord.lock(LockSpec("vocab-lock", ttl=timedelta(seconds=30)))
    lease = locks.acquire("L", owner="a")
    assert lease is not None
    assert locks.acquire("L", owner="b", wait=0) is None
    locks.renew(lease)
    locks.release(lease)
    locks.release(lease)  # not held any more
    taken = locks.acquire("L", owner="c")
    assert taken is not None and locks.break_lock("L") is True
    assert locks.break_lock("L") is False
    coord.close()
    assert len({name for name, _ in seen}) >= 6, seen
    vocabulary = T.events()
    unknown = [(n, o) for n, o in seen if o not in vocabulary.get(n, ())]
    assert not unknown, f"events outside the table's vocabulary: {unknown}"


def test_every_operation_answers_in_every_state() -> None:
    # Each call has a row without a guard for every state it can meet: the table never
    # leaves a store to improvise.
    kinds = {"claim": T.CLAIM_STATES, "lock": T.LOCK_STATES, "fence": ("gate",)}
    for row in T.ROWS:
        if row.op == "expire":
            continue
        family = row.id.split(".")[0]
        states = kinds.get(family, T.CLAIM_STATES)
        for state in states:
            fallback = [
                r
                for r in T.ROWS
                if r.op == row.op
                and state in r.states
                # a free key always has room: every limit is at least 1
                and (not r.guard or (r.guard, state) == ("room", "free"))
            ]
            assert fallback, (row.op, state)


def test_row_ids_are_unique_and_replies_named_once() -> None:
    assert len(T.BY_ID) == len(T.ROWS)
    assert set(T.REPLIES) == {r.reply.name for r in T.ROWS if r.reply is not None}


def test_lua_answers_with_the_table_codes_only() -> None:
    # Reply codes are interpolated from the table: no script answers a bare number.
    import re

    from idemlock.stores.redis import _lua

    scripts = {
        n: v
        for n, v in vars(_lua).items()
        if isinstance(v, str) and n.isupper() and not n.startswith("_")
    }
    assert len(scripts) > 10
    for name, text in scripts.items():
        assert not re.search(r"return \{?-?\d", text), name
