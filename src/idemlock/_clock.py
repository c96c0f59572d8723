"""The clocks a coordinator reads (the domain in :mod:`idemlock._core` only receives
times): the machine's, and a manual one for tests."""

from __future__ import annotations

import threading
import time


class SystemClock:
    """The machine's clocks."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


SYSTEM_CLOCK = SystemClock()


class ManualClock:
    """A clock that only moves when told to, so tests cross an expiry without sleeping."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self._lock = threading.Lock()
        self._wall = float(start)
        self._mono = 0.0

    def time(self) -> float:
        with self._lock:
            return self._wall

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("a ManualClock only moves forward")
        with self._lock:
            self._wall += seconds
            self._mono += seconds
