"""What the contract suite needs from a store: a way to open coordinators on it.

Each store has one harness factory in ``tests/contract/stores.py``; the suite is
parametrized over :data:`STORES` there, and adding a store is one line.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import idemlock
import idemlock.aio
from idemlock import ManualClock


@dataclass
class Harness:
    #: store name as in STORES
    name: str
    #: URL other processes can open (None: the store lives in this process only)
    url: str | None
    #: open a sync coordinator: (key_prefix, **options) -> Coordinator
    open_sync: Callable[..., idemlock.Coordinator]
    #: open an async coordinator: (key_prefix, **options) -> AsyncCoordinator
    open_async: Callable[..., idemlock.aio.AsyncCoordinator]
    #: a manual clock the store judges expiry by, if it accepts one
    clock: ManualClock | None = None
    #: whether the store's fencing counter outlives a restart (stores with a server)
    extras: dict[str, Any] = field(default_factory=dict)
    prefix: str = field(default_factory=lambda: "t" + uuid.uuid4().hex[:12])
    #: fault injection (tests/servers/faults.py Faults), set by the fault harnesses of
    #: tests/contract/fault_stores.py only
    faults: Any = None

    def stall(self) -> AbstractContextManager[None]:
        """A block during which the store is silent (calls hang: no error, no EOF)."""
        return self._faults().stall()  # type: ignore[no-any-return]

    def outage(self) -> AbstractContextManager[None]:
        """A block during which the store is down; it is back on exit."""
        return self._faults().outage()  # type: ignore[no-any-return]

    def restart(self) -> None:
        """Stop the store and start it again now."""
        self._faults().restart()

    def _faults(self) -> Any:
        if self.faults is None:
            raise RuntimeError(f"the {self.name} harness has no faults: use fault_harness")
        return self.faults

    def advance(self, seconds: float) -> None:
        """Let ``seconds`` pass for the store: move the manual clock, or sleep."""
        if self.clock is not None:
            self.clock.advance(seconds)
        else:
            time.sleep(seconds)

    def sync(self, **options: Any) -> idemlock.Coordinator:
        return self.open_sync(self.prefix, **options)

    def aio(self, **options: Any) -> idemlock.aio.AsyncCoordinator:
        return self.open_async(self.prefix, **options)
