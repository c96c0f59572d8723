"""One contract test per row of the state table (``idemlock._core.table``), run on every
store at the port level, sync and async: the test id names the row.

Each scenario brings a key into the row's state, makes the row's call and checks the
reply against the row's reply and the state after it against the row's next state.
Rows that need time to pass use short leases and ``harness.advance`` (a manual clock
where the store has one); on a store that judges time by its own clock each of them
waits in real time, so they run in one test per store, all at once (see
:func:`test_rows_that_let_time_pass`)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from idemlock._core import table as T
from idemlock._core.port import Acquired, Busy, Channel, Done, Granted, Held, Mismatch

from .facade import Facade, Proxy, async_facade, each_face, sync_facade
from .harness import Harness
from .windows import long_windows

LONG = 60_000
#: ms; crossed by advance(PAST), and long enough to outlast a busy machine's stall
#: between a claim or acquire and the checks made while it is live
SHORT = 1000
PAST = 1.2

_REPLY_TYPES: dict[str, type] = {
    "granted": Granted,
    "busy": Busy,
    "done": Done,
    "mismatch": Mismatch,
    "acquired": Acquired,
    "held": Held,
}


class Ctx:
    def __init__(
        self,
        api: Facade,
        row: str,
        monkeypatch: pytest.MonkeyPatch,
        live_ends: Callable[[], None] = lambda: None,
    ) -> None:
        self.api = api
        self.monkeypatch = monkeypatch
        self._live_ends = live_ends
        self.row = T.BY_ID[row]
        self.store = Proxy(api.coord.store, api.mode)
        self.ns = f"{api.harness.prefix}|tbl"
        self.key = "k" + uuid.uuid4().hex[:8]

    def token(self) -> str:
        return uuid.uuid4().hex

    def advance(self) -> None:
        """Let the short leases (SHORT) of the scenario lapse: ``advance(PAST)``."""
        assert self.row.id in TIMED, f"{self.row.id} lets time pass: register it with timed=True"
        self._live_ends()
        self.api.harness.advance(PAST)

    def expect(self, reply: Any, row: str | None = None) -> Any:
        """Assert ``reply`` is the reply of ``row`` (default: the row under test)."""
        r = T.BY_ID[row] if row else self.row
        assert r.reply is not None
        name = r.reply.name
        if name in _REPLY_TYPES:
            assert isinstance(reply, _REPLY_TYPES[name]), (r.id, reply)
        elif r.op in ("extend", "renew", "step", "unstep"):
            assert (type(reply) is int) is (name == "ok"), (r.id, reply)
        elif r.op == "fence":
            assert reply[0] is (name == "ok"), (r.id, reply)
        else:
            assert reply is (name == "ok"), (r.id, reply)
        return reply

    async def claim(self, token: str, fp: str | None = None, lease: int = LONG) -> Any:
        return await self.store.claim(self.ns, self.key, fp, token, lease)

    async def record_state(self) -> str | None:
        row = await self.store.record(self.ns, self.key)
        return None if row is None else row.state

    async def lock_owner(self) -> str | None:
        row = await self.store.lock(self.ns, self.key)
        return None if row is None else row.owner


Scenario = Callable[[Ctx], Awaitable[None]]
SCENARIOS: dict[str, Scenario] = {}
#: rows whose scenario lets time pass (``c.advance()``)
TIMED: set[str] = set()


def rows(*ids: str, timed: bool = False) -> Callable[[Scenario], Scenario]:
    def register(fn: Scenario) -> Scenario:
        for rid in ids:
            assert rid in T.BY_ID, rid
            SCENARIOS[rid] = fn
            if timed:
                TIMED.add(rid)
        return fn

    return register


# ---- claims ----------------------------------------------------------------------


@rows("claim.new", timed=True)
async def _claim_new(c: Ctx) -> None:
    first = c.expect(await c.claim(c.token(), lease=SHORT))
    assert await c.record_state() == "in_flight"
    c.advance()  # lapsed: taken over with a new fence
    again = c.expect(await c.claim(c.token()))
    assert again.fence > first.fence


@rows("claim.resend")
async def _claim_resend(c: Ctx) -> None:
    t = c.token()
    first = await c.claim(t)
    again = c.expect(await c.claim(t))
    assert again.fence == first.fence


@rows("claim.mismatch")
async def _claim_mismatch(c: Ctx) -> None:
    t = c.token()
    await c.claim(t, fp="a")
    assert c.expect(await c.claim(c.token(), fp="b")).state == "in_flight"
    assert await c.store.complete(c.ns, c.key, t, b"r", LONG)
    assert c.expect(await c.claim(c.token(), fp=None)).state == "completed"


@rows("claim.busy")
async def _claim_busy(c: Ctx) -> None:
    await c.claim(c.token(), fp="a")
    c.expect(await c.claim(c.token(), fp="a"))
    assert await c.record_state() == "in_flight"


@rows("claim.replay")
async def _claim_replay(c: Ctx) -> None:
    t = c.token()
    await c.claim(t)
    assert await c.store.complete(c.ns, c.key, t, b"result", LONG)
    assert c.expect(await c.claim(c.token())).result == b"result"


@rows("claim.expiry", timed=True)
async def _claim_expiry(c: Ctx) -> None:
    t = c.token()
    await c.claim(t, lease=SHORT)
    c.advance()
    assert await c.record_state() is None  # not live: listed nowhere
    # lapsed, not absent: the late completion still lands
    assert await c.store.complete(c.ns, c.key, t, b"late", LONG)


@rows("claim.ttl", timed=True)
async def _claim_ttl(c: Ctx) -> None:
    t = c.token()
    first = await c.claim(t)
    assert await c.store.complete(c.ns, c.key, t, b"r", SHORT)
    c.advance()
    assert await c.record_state() is None
    again = await c.claim(c.token())
    assert isinstance(again, Granted) and again.fence > first.fence


@rows("complete.ok")
async def _complete_ok(c: Ctx) -> None:
    t = c.token()
    await c.claim(t)
    c.expect(await c.store.complete(c.ns, c.key, t, b"r", LONG))
    assert await c.record_state() == "completed"


@rows("complete.late", "abandon.late", timed=True)
async def _late(c: Ctx) -> None:
    t = c.token()
    await c.claim(t, lease=SHORT)
    c.advance()
    if c.row.op == "complete":
        c.expect(await c.store.complete(c.ns, c.key, t, b"r", LONG))
        assert await c.record_state() == "completed"
    else:
        c.expect(await c.store.abandon(c.ns, c.key, t))
        assert await c.record_state() is None


@rows("complete.resend")
async def _complete_resend(c: Ctx) -> None:
    t = c.token()
    await c.claim(t)
    assert await c.store.complete(c.ns, c.key, t, b"r", LONG)
    before = await c.store.record(c.ns, c.key)
    c.expect(await c.store.complete(c.ns, c.key, t, b"r", LONG))
    assert await c.store.record(c.ns, c.key) == before  # nothing changed
    # Another result is no re-send: complete.stale
    c.expect(await c.store.complete(c.ns, c.key, t, b"other", LONG), "complete.stale")


@rows("complete.stale", "abandon.stale", timed=True)
async def _stale(c: Ctx) -> None:
    def call(token: str) -> Any:
        if c.row.op == "complete":
            return c.store.complete(c.ns, c.key, token, b"r", LONG)
        return c.store.abandon(c.ns, c.key, token)

    c.expect(await call(c.token()))  # absent
    first = c.token()
    await c.claim(first, lease=SHORT)
    c.expect(await call(c.token()))  # in flight with another token
    c.advance()
    second = c.token()
    assert isinstance(await c.claim(second), Granted)  # taken over
    c.expect(await call(first))
    assert await c.record_state() == "in_flight"
    assert await c.store.abandon(c.ns, c.key, second)
    c.expect(await c.store.abandon(c.ns, c.key, second), "abandon.stale")  # re-sent


@rows("abandon.ok")
async def _abandon_ok(c: Ctx) -> None:
    t = c.token()
    first = await c.claim(t)
    c.expect(await c.store.abandon(c.ns, c.key, t))
    assert await c.record_state() is None
    again = await c.claim(c.token())
    assert isinstance(again, Granted) and again.fence > first.fence  # counter kept


@rows("extend.ok", timed=True)
async def _extend_ok(c: Ctx) -> None:
    t = c.token()
    first = await c.claim(t, lease=SHORT)
    exp = c.expect(await c.store.extend(c.ns, c.key, t, LONG))
    assert exp > first.expires_ms
    c.advance()
    assert await c.record_state() == "in_flight"


@rows("extend.stale", timed=True)
async def _extend_stale(c: Ctx) -> None:
    t = c.token()
    await c.claim(t, lease=SHORT)
    c.expect(await c.store.extend(c.ns, c.key, c.token(), LONG))  # another token
    c.advance()
    c.expect(await c.store.extend(c.ns, c.key, t, LONG))  # lapsed: never revived
    assert await c.record_state() is None


@rows("forget.live")
async def _forget_live(c: Ctx) -> None:
    first = await c.claim(c.token())
    c.expect(await c.store.forget(c.ns, c.key))
    assert await c.record_state() is None
    again = await c.claim(c.token())
    assert isinstance(again, Granted) and again.fence > first.fence


@rows("forget.dead", timed=True)
async def _forget_dead(c: Ctx) -> None:
    c.expect(await c.store.forget(c.ns, c.key))  # absent
    await c.claim(c.token(), lease=SHORT)
    c.advance()
    c.expect(await c.store.forget(c.ns, c.key))  # lapsed
    assert await c.record_state() is None


# ---- locks -----------------------------------------------------------------------


@rows("lock.acquire")
async def _lock_acquire(c: Ctx) -> None:
    got = c.expect(await c.store.acquire(c.ns, c.key, "a", LONG))
    assert got.token > 0 and await c.lock_owner() == "a"


@rows("lock.reacquire")
async def _lock_reacquire(c: Ctx) -> None:
    first = await c.store.acquire(c.ns, c.key, "a", LONG)
    again = c.expect(await c.store.acquire(c.ns, c.key, "a", LONG))
    assert again.token == first.token


@rows("lock.busy")
async def _lock_busy(c: Ctx) -> None:
    await c.store.acquire(c.ns, c.key, "a", LONG)
    c.expect(await c.store.acquire(c.ns, c.key, "b", LONG))
    assert await c.lock_owner() == "a"


@rows("lock.handoff", "lock.handoff.take")
async def _lock_handoff(c: Ctx) -> None:
    # A waiter of another store object (another process's gid) registers by failing
    # while subscribed; the release then keeps a window for it where the store has one
    # (long here: the row is about who may take the lock, not how long it is kept).
    options = long_windows(c.monkeypatch, c.api.harness.name)
    other = c.api.other()
    releaser = c.api.other(**options) if options else c.api
    try:
        waiter = Proxy(other.coord.store, c.api.mode)
        store = Proxy(releaser.coord.store, c.api.mode)
        held = await store.acquire(c.ns, c.key, "a", LONG)
        sub = await waiter.subscribe(Channel("lock", c.ns, c.key))
        # Twice, as a waiting acquire does (it asks again after subscribing): a store
        # may queue a one-shot try but choose only an owner that asked more than once.
        for _ in range(2):
            assert isinstance(await waiter.acquire(c.ns, c.key, "w", LONG), Held)
        assert await store.release(c.ns, c.key, "a", held.token)
        newcomer = await c.store.acquire(c.ns, c.key, "n", LONG)
        if c.api.coord.store.capabilities.handoff:
            c.expect(newcomer, "lock.handoff")  # reserved for the waiter
        else:
            # no window: the state is free, not reserved (row lock.acquire)
            c.expect(newcomer, "lock.acquire")
            assert await c.store.release(c.ns, c.key, "n", newcomer.token)
        got = c.expect(await waiter.acquire(c.ns, c.key, "w", LONG), "lock.handoff.take")
        assert got.token > held.token
        if c.api.mode == "sync":
            sub.close()
        else:
            await sub.aclose()
    finally:
        await other.close()
        if releaser is not c.api:
            await releaser.close()


@rows("lock.release")
async def _lock_release(c: Ctx) -> None:
    first = await c.store.acquire(c.ns, c.key, "a", LONG)
    c.expect(await c.store.release(c.ns, c.key, "a", first.token))
    assert await c.lock_owner() is None
    again = await c.store.acquire(c.ns, c.key, "b", LONG)
    assert again.token > first.token  # counter kept


@rows("lock.release.stale")
async def _lock_release_stale(c: Ctx) -> None:
    c.expect(await c.store.release(c.ns, c.key, "a", 1))  # free
    held = await c.store.acquire(c.ns, c.key, "a", LONG)
    c.expect(await c.store.release(c.ns, c.key, "b", held.token))  # another owner
    c.expect(await c.store.release(c.ns, c.key, "a", held.token + 1))  # another token
    assert await c.lock_owner() == "a"


@rows("lock.renew", timed=True)
async def _lock_renew(c: Ctx) -> None:
    held = await c.store.acquire(c.ns, c.key, "a", SHORT)
    exp = c.expect(await c.store.renew(c.ns, c.key, "a", held.token, LONG))
    assert exp > held.expires_ms
    c.advance()
    assert await c.lock_owner() == "a"


@rows("lock.renew.stale", timed=True)
async def _lock_renew_stale(c: Ctx) -> None:
    held = await c.store.acquire(c.ns, c.key, "a", SHORT)
    c.expect(await c.store.renew(c.ns, c.key, "b", held.token, LONG))
    c.advance()
    c.expect(await c.store.renew(c.ns, c.key, "a", held.token, LONG))  # never revived
    assert await c.lock_owner() is None


@rows("lock.break")
async def _lock_break(c: Ctx) -> None:
    held = await c.store.acquire(c.ns, c.key, "a", LONG)
    c.expect(await c.store.break_lock(c.ns, c.key))
    assert await c.lock_owner() is None
    assert await c.store.renew(c.ns, c.key, "a", held.token, LONG) is None
    again = await c.store.acquire(c.ns, c.key, "b", LONG)
    assert again.token > held.token  # counter kept


@rows("lock.break.free")
async def _lock_break_free(c: Ctx) -> None:
    c.expect(await c.store.break_lock(c.ns, c.key))


@rows("lock.expiry", timed=True)
async def _lock_expiry(c: Ctx) -> None:
    held = await c.store.acquire(c.ns, c.key, "a", SHORT)
    c.advance()
    assert await c.lock_owner() is None
    again = await c.store.acquire(c.ns, c.key, "b", LONG)
    assert isinstance(again, Acquired) and again.token > held.token


# ---- steps inside a claim (stores declaring ``steps``) ----------------------------


def _steps_of(c: Ctx, granted: Any) -> bool:
    """Whether the store keeps steps; where it does not, a grant carries none."""
    if c.api.coord.store.capabilities.steps:
        return True
    assert granted.steps == ()
    return False


def _named(rows: Any) -> set[tuple[str, int, bytes | None]]:
    return {(r.name, r.fence, r.result) for r in rows}


@rows("step.record")
async def _step_record(c: Ctx) -> None:
    t = c.token()
    first = await c.claim(t)
    if not _steps_of(c, first):
        return
    exp = c.expect(await c.store.step(c.ns, c.key, t, "charge", b'"ch_1"', LONG, LONG))
    assert exp >= first.expires_ms  # the lease renewed
    c.expect(await c.store.step(c.ns, c.key, t, "email", None, LONG, LONG))  # a marker
    c.expect(await c.store.step(c.ns, c.key, t, "email", b"7", LONG, LONG))  # replaced
    recorded = {("charge", first.fence, b'"ch_1"'), ("email", first.fence, b"7")}
    assert _named(await c.store.steps(c.ns, c.key)) == recorded
    # They outlive an abandon: the next attempt's grant carries them.
    assert await c.store.abandon(c.ns, c.key, t)
    t2 = c.token()
    again = await c.claim(t2)
    assert again.fence > first.fence and _named(again.steps) == recorded
    # A completion keeps them as long as its record; forget drops them with it.
    assert await c.store.complete(c.ns, c.key, t2, b"1", LONG)
    assert _named(await c.store.steps(c.ns, c.key)) == recorded
    assert await c.store.forget(c.ns, c.key)
    assert await c.store.steps(c.ns, c.key) == []
    assert (await c.claim(c.token())).steps == ()


@rows("step.stale", timed=True)
async def _step_stale(c: Ctx) -> None:
    t = c.token()
    if not _steps_of(c, await c.store.claim(c.ns, c.key + "-x", None, t, LONG)):
        return
    c.expect(await c.store.step(c.ns, c.key, t, "s", b"1", LONG, LONG))  # absent
    held = await c.claim(t, lease=SHORT)
    c.expect(await c.store.step(c.ns, c.key, c.token(), "s", b"1", LONG, LONG))  # not mine
    c.advance()
    c.expect(await c.store.step(c.ns, c.key, t, "s", b"1", LONG, LONG))  # lapsed
    taker = c.token()
    assert (await c.claim(taker)).fence > held.fence
    c.expect(await c.store.step(c.ns, c.key, t, "s", b"1", LONG, LONG))  # taken over
    assert await c.store.complete(c.ns, c.key, taker, b"1", LONG)
    c.expect(await c.store.step(c.ns, c.key, taker, "s", b"1", LONG, LONG))  # completed
    assert await c.store.steps(c.ns, c.key) == []


@rows("step.drop")
async def _step_drop(c: Ctx) -> None:
    t = c.token()
    first = await c.claim(t)
    if not _steps_of(c, first):
        return
    await c.store.step(c.ns, c.key, t, "a", b"1", LONG, LONG)
    await c.store.step(c.ns, c.key, t, "b", None, LONG, LONG)
    exp = c.expect(await c.store.drop_step(c.ns, c.key, t, "b", LONG))
    assert exp >= first.expires_ms
    c.expect(await c.store.drop_step(c.ns, c.key, t, "never", LONG))  # nothing to drop
    assert _named(await c.store.steps(c.ns, c.key)) == {("a", first.fence, b"1")}


@rows("step.drop.stale")
async def _step_drop_stale(c: Ctx) -> None:
    t = c.token()
    first = await c.claim(t)
    if not _steps_of(c, first):
        return
    await c.store.step(c.ns, c.key, t, "b", None, LONG, LONG)
    c.expect(await c.store.drop_step(c.ns, c.key, c.token(), "b", LONG))
    assert _named(await c.store.steps(c.ns, c.key)) == {("b", first.fence, None)}


# ---- fences ----------------------------------------------------------------------


@rows("fence.advance")
async def _fence_advance(c: Ctx) -> None:
    assert c.expect(await c.store.fence_advance(c.ns, c.key, 5)) == (True, 5)
    assert c.expect(await c.store.fence_advance(c.ns, c.key, 5)) == (True, 5)  # equal
    assert c.expect(await c.store.fence_advance(c.ns, c.key, 7)) == (True, 7)
    assert await c.store.fence_current(c.ns, c.key) == 7


@rows("fence.stale")
async def _fence_stale(c: Ctx) -> None:
    await c.store.fence_advance(c.ns, c.key, 7)
    assert c.expect(await c.store.fence_advance(c.ns, c.key, 6)) == (False, 7)
    assert await c.store.fence_current(c.ns, c.key) == 7


def test_every_row_has_a_scenario() -> None:
    assert set(SCENARIOS) == set(T.BY_ID)


def test_every_store_declares_the_handoff_window() -> None:
    """The hand-off rows follow each store's ``capabilities.handoff``; every store keeps
    the window today."""
    from idemlock.stores.etcd._sync import EtcdStore
    from idemlock.stores.memory import MemoryStore
    from idemlock.stores.postgres._sync import PostgresStore
    from idemlock.stores.redis._sync import RedisStore
    from idemlock.stores.sqlite._store import SQLiteStore

    stores = (EtcdStore, MemoryStore, PostgresStore, RedisStore, SQLiteStore)
    assert all(s.capabilities.handoff for s in stores)


@pytest.mark.parametrize("row", [r.id for r in T.ROWS if r.id not in TIMED])
async def test_row(harness: Harness, row: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A row with a capability (``needs``) is checked on every store: its scenario
    # expects the row where the store declares the capability and the state without it
    # elsewhere, so no store's run of it is skipped.
    async def scenario(api: Facade) -> None:
        await SCENARIOS[row](Ctx(api, row, monkeypatch))

    await each_face(harness, scenario)


async def test_rows_that_let_time_pass(harness: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row of TIMED, on both faces, as test_row would run it. On a manual clock
    one after the other. On a store that judges time by its own clock each row and face
    waits PAST in real time: they all run at once, each in a thread with an event loop
    and a coordinator of its own, on a key prefix of its own, so the wait is spent once.
    Only their live phases (from the first call to ``c.advance()``, where a stall of
    SHORT would let a lease lapse under a check) take turns: the others only sleep or
    check what has lapsed meanwhile, so no live phase meets more load than in a test of
    its own. A failure names its row and face."""
    timed = sorted(TIMED)
    if harness.clock is not None:
        for row in timed:

            async def scenario(api: Facade, row: str = row) -> None:
                try:
                    await SCENARIOS[row](Ctx(api, row, monkeypatch))
                except BaseException as exc:
                    exc.add_note(f"(row {row})")
                    raise

            await each_face(harness, scenario)
        return

    live = threading.Lock()

    async def one(row: str, mode: str) -> None:
        h = dataclasses.replace(harness, prefix=f"{harness.prefix}{row}{mode[0]}")
        holding = live.acquire(timeout=120)
        assert holding, "the live phases of the other rows did not end within 120 s"

        def live_ends() -> None:
            nonlocal holding
            if holding:
                holding = False
                live.release()

        api = sync_facade(h) if mode == "sync" else async_facade(h)
        try:
            await SCENARIOS[row](Ctx(api, row, monkeypatch, live_ends))
        except BaseException as exc:
            exc.add_note(f"(row {row}, on the {mode} face)")
            raise
        finally:
            live_ends()
            await api.close()

    jobs = [(row, mode) for row in timed for mode in ("sync", "async")]
    loop = asyncio.get_running_loop()
    # a thread each (asyncio.to_thread's pool has only a few on a small machine)
    with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="table-row") as pool:
        results = await asyncio.gather(
            *(loop.run_in_executor(pool, asyncio.run, one(row, mode)) for row, mode in jobs),
            return_exceptions=True,
        )
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise errors[0]
