"""The two drivers of :mod:`idemlock._core.flows`: the only code that blocks or awaits
on behalf of a flow."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any, TypeVar

from ._core.flows import Call, Sleep, Subscribe, Wait
from ._core.port import AsyncStore, SyncStore

if TYPE_CHECKING:
    import asyncio

R = TypeVar("R")


def run_sync(flow: Any, store: SyncStore, stop: threading.Event | None = None) -> Any:
    subs: list[Any] = []
    try:
        req = next(flow)
        while True:
            try:
                if type(req) is Call:
                    res = getattr(store, req.method)(*req.args)
                elif type(req) is Wait:
                    res = req.sub.wait(req.timeout)
                elif type(req) is Subscribe:
                    res = store.subscribe(req.channel)
                    subs.append(res)
                elif type(req) is Sleep:
                    if stop is not None:
                        res = stop.wait(req.seconds)
                    else:
                        time.sleep(req.seconds)
                        res = False
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
            sub.close()


async def run_async(flow: Any, store: AsyncStore, stop: asyncio.Event | None = None) -> Any:
    import asyncio  # here: `import idemlock` alone must not load asyncio

    subs: list[Any] = []
    try:
        req = next(flow)
        while True:
            try:
                if type(req) is Call:
                    res = await getattr(store, req.method)(*req.args)
                elif type(req) is Wait:
                    res = await req.sub.wait(req.timeout)
                elif type(req) is Subscribe:
                    res = await store.subscribe(req.channel)
                    subs.append(res)
                elif type(req) is Sleep:
                    if stop is not None:
                        try:
                            await asyncio.wait_for(stop.wait(), req.seconds)
                            res = True
                        except asyncio.TimeoutError:
                            res = False
                    else:
                        await asyncio.sleep(req.seconds)
                        res = False
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
