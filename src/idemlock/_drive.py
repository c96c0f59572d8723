"""The two drivers of :mod:`idemlock._core.flows`: the only code that blocks, awaits or
reads a clock on behalf of a flow. :func:`run_async` is written here; :func:`run_sync`
is generated from it into :mod:`idemlock._drive_sync` (and imported here, so both come
from one place). asyncio is imported inside the functions: ``import idemlock`` alone
must not load it."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from ._clock import SYSTEM_CLOCK
from ._core.clock import Clock
from ._core.flows import Call, Now, Sleep, Subscribe, Wait
from ._core.port import AsyncStore
from ._drive_sync import run_sync  # async-only

if TYPE_CHECKING:  # async-only
    import asyncio

# sync-only: import threading

__all__ = ["run_async", "run_sync"]  # async-only


async def run_async(
    flow: Any, store: AsyncStore, stop: asyncio.Event | None = None, clock: Clock = SYSTEM_CLOCK
) -> Any:
    """Run ``flow`` on ``store`` to its end and return its value. ``clock`` answers its
    :class:`~idemlock._core.flows.Now` requests (the machine's clock those with ``real``);
    ``stop`` ends a :class:`~idemlock._core.flows.Sleep` early."""
    subs: list[Any] = []
    try:
        req = next(flow)
        while True:
            try:
                if type(req) is Call:
                    res = await getattr(store, req.method)(*req.args)
                elif type(req) is Now:
                    res = time.monotonic() if req.real else clock.monotonic()
                elif type(req) is Wait:
                    res = await req.sub.wait(req.timeout)
                elif type(req) is Subscribe:
                    res = await store.subscribe(req.channel)
                    subs.append(res)
                elif type(req) is Sleep:
                    res = await _sleep(req.seconds, stop)
                else:  # pragma: no cover - programming error
                    raise TypeError(f"unknown flow request {req!r}")
            except Exception as exc:
                req = flow.throw(exc)
                continue
            req = flow.send(res)
    except StopIteration as done:
        return done.value
    finally:
        flow.close()
        for sub in subs:
            await sub.aclose()


async def _sleep(seconds: float, stop: asyncio.Event | None) -> bool:
    """Sleep ``seconds``, or until ``stop`` is set: whether it was."""
    import asyncio  # async-only

    if stop is None:
        await asyncio.sleep(seconds)
        return False
    try:  # async-only
        await asyncio.wait_for(stop.wait(), seconds)
        return True
    except asyncio.TimeoutError:
        return False
    # sync-only: return stop.wait(seconds)
