"""The proxies between the workers and the store (the tests' ``TcpProxy``): cuts and
blackholes, each healed by a timer unless a later one took over."""

from __future__ import annotations

import contextlib
import random
import threading

from tests.servers.proxy import TcpProxy


class Network:
    def __init__(self) -> None:
        self.proxies: list[TcpProxy] = []
        self.mu = threading.Lock()
        self.timers: list[threading.Timer] = []
        self.generation = 0  # of the latest blackhole
        self.full = 0  # the generation of the latest full one (only its timer heals it)
        self.held: dict[object, tuple[TcpProxy, int]] = {}  # connection: proxy, generation

    def add(self, target: int) -> TcpProxy:
        self.proxies.append(TcpProxy(target))
        return self.proxies[-1]

    def cut(self, only: TcpProxy | None = None) -> int:
        with self.mu:
            return sum(p.cut() for p in self.proxies if only in (None, p))

    def blackhole(
        self, seconds: float, share: float, rng: random.Random, only: TcpProxy | None = None
    ) -> bool:
        """Stop forwarding for ``seconds``: everything (``share`` >= 1: new connections
        hang after the kernel's accept too) or a random ``share`` of the open
        connections (at least one); with ``only``, every open connection of that proxy
        (one member cut off). False if there was nothing to silence."""
        with self.mu:
            self.generation += 1
            gen = self.generation
            conns = [(p, c) for p in self.proxies for c in p.open_pairs() if c not in self.held]
            if share >= 1:
                if not any(p.connections() for p in self.proxies):
                    return False  # nobody uses this store (plain mode on Redis)
                self.full = gen
                for p in self.proxies:
                    p.blackhole()
                chosen = []
            elif not all(p.forwarding for p in self.proxies):
                return False  # everything is silent already
            elif only is not None:
                chosen = [(p, c) for p, c in conns if p is only]
            else:
                chosen = [pc for pc in conns if rng.random() < share] or conns[:1]
            if share < 1 and not chosen:
                return False
            for p, c in chosen:
                self.held[c] = (p, gen)
                p.hold([c])

        def heal() -> None:
            with self.mu, contextlib.suppress(RuntimeError):  # closed meanwhile
                if self.full == gen:
                    for p in self.proxies:
                        p.heal()
                for p, c in chosen:
                    if self.held.get(c, (p, -1))[1] == gen:
                        del self.held[c]
                        p.hold([c], held=False)

        timer = threading.Timer(seconds, heal)
        timer.daemon = True
        self.timers.append(timer)
        timer.start()
        return True

    def heal(self) -> None:
        """End every blackhole now."""
        with self.mu:
            self.full = -1
            for p in self.proxies:
                p.heal()
            for c, (p, _) in self.held.items():
                p.hold([c], held=False)
            self.held.clear()

    def close(self) -> None:
        for timer in self.timers:
            timer.cancel()
        for p in self.proxies:
            p.close()
