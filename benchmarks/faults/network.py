"""The loopback TCP proxies between the workers and the store: cuts and blackholes."""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
from typing import Any

from faults import HOST

# ---- the loopback TCP proxy -------------------------------------------------------------


class Conn:
    """One client connection through a proxy: both sides, the two pumps, and the gate a
    partial blackhole closes (data is then held, not forwarded and not dropped)."""

    def __init__(self, down: asyncio.StreamWriter, up: asyncio.StreamWriter) -> None:
        self.down, self.up = down, up
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.generation = 0  # of the blackhole that closed the gate (only it reopens it)
        self.pumps: list[asyncio.Future[None]] = []

    def abort(self) -> None:
        self.down.transport.abort()
        self.up.transport.abort()
        for p in self.pumps:
            p.cancel()


class Proxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target``. :meth:`ProxyHub.cut`
    aborts every connection through it (both sides see a reset); a blackhole
    (:meth:`ProxyHub.blackhole`) stops forwarding without closing anything, as a dead
    switch or a partition does: bytes sent meanwhile are held and delivered when it
    ends (TCP would retransmit them), new connections are accepted by the kernel and
    then answered by nobody."""

    def __init__(self, target: int, open_: asyncio.Event) -> None:
        self.target = target
        self.port = 0
        self.conns: set[Conn] = set()
        self.open = open_  # the hub's gate: closed during a full blackhole
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, HOST, 0)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self.open.wait()
        try:
            up_r, up_w = await asyncio.wait_for(asyncio.open_connection(HOST, self.target), 3)
        except (OSError, asyncio.TimeoutError):
            writer.transport.abort()  # the server is down: so is the connection
            return
        conn = Conn(writer, up_w)
        self.conns.add(conn)
        gates = (self.open, conn.flowing)
        conn.pumps = [
            asyncio.ensure_future(_pump(reader, up_w, gates)),
            asyncio.ensure_future(_pump(up_r, writer, gates)),
        ]
        try:
            await asyncio.wait(conn.pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.conns.discard(conn)
            conn.abort()

    def cut(self) -> int:
        conns = list(self.conns)
        self.conns.clear()
        for conn in conns:
            conn.abort()
        return len(conns)


async def _pump(
    src: asyncio.StreamReader, dst: asyncio.StreamWriter, gates: tuple[asyncio.Event, ...]
) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await src.read(65536):
            for gate in gates:
                if not gate.is_set():
                    await gate.wait()
            dst.write(data)
            await dst.drain()


class ProxyHub:
    """One event loop in a thread serving every proxy of a run."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.proxies: list[Proxy] = []
        self.open = asyncio.Event()
        self.open.set()
        self.generation = 0  # of the latest blackhole
        self.full_generation = 0  # of the latest full blackhole (only it reopens the gate)
        self.thread = threading.Thread(target=self.loop.run_forever, name="proxy", daemon=True)
        self.thread.start()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)

    def add(self, target: int) -> Proxy:
        proxy = Proxy(target, self.open)
        self._call(proxy.start())
        self.proxies.append(proxy)
        return proxy

    def cut(self, only: Proxy | None = None) -> int:
        async def cut_all() -> int:
            return sum(p.cut() for p in self.proxies if only is None or p is only)

        return int(self._call(cut_all()))

    def blackhole(
        self, seconds: float, share: float, rng: random.Random, only: Proxy | None = None
    ) -> str:
        """Stop forwarding for ``seconds``: everything (``share`` >= 1: every
        connection, and new ones hang after the kernel's accept) or a random ``share``
        of the open connections (at least one; the rest and new ones keep working, as
        when one path through the network dies); with ``only``, every open connection
        of that proxy (one member cut off). "" if there was nothing to silence."""

        async def go() -> str:
            self.generation += 1
            gen = self.generation
            if share >= 1:
                n = sum(len(p.conns) for p in self.proxies)
                if not n:
                    return ""  # nobody uses this store (plain mode on Redis)
                self.full_generation = gen
                self.open.clear()

                def heal_full() -> None:
                    if self.full_generation == gen:
                        self.open.set()

                self.loop.call_later(seconds, heal_full)
                return f"everything for {seconds:.2f}s ({n} connections)"
            conns = [c for p in self.proxies for c in p.conns if c.flowing.is_set()]
            if not conns or not self.open.is_set():
                return ""  # nothing to silence (or everything is silent already)
            if only is not None:
                chosen = [c for c in conns if c in only.conns]
                if not chosen:
                    return ""
            else:
                chosen = [c for c in conns if rng.random() < share] or conns[:1]
            for c in chosen:
                c.generation = gen
                c.flowing.clear()

            def heal_some() -> None:
                for c in chosen:
                    if c.generation == gen:
                        c.flowing.set()

            self.loop.call_later(seconds, heal_some)
            where = f" of :{only.target}" if only is not None else ""
            return f"{len(chosen)} of {len(conns)} connections{where} for {seconds:.2f}s"

        return str(self._call(go()))

    def heal(self) -> None:
        """End every blackhole now."""

        async def heal_all() -> None:
            self.full_generation = -1
            self.open.set()
            for p in self.proxies:
                for c in p.conns:
                    c.generation = -1
                    c.flowing.set()

        self._call(heal_all())

    def close(self) -> None:
        async def close_all() -> None:
            self.open.set()
            for p in self.proxies:
                p.cut()
                if p.server is not None:
                    p.server.close()

        with contextlib.suppress(Exception):
            self._call(close_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
