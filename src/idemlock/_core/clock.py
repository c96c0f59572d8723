"""Clocks: the wall clock for stores without a server, and a manual clock for tests;
and the one validator of every duration idemlock takes."""

from __future__ import annotations

import math
import threading
import time
from datetime import timedelta
from typing import Protocol

from .._errors import ConfigurationError

#: The longest ttl, lease or wait idemlock accepts: 100 years. Stores rely on it
#: (Redis packs expiry times into 6 bytes of milliseconds, datetimes end at year 9999),
#: and anything longer is a mistake or a "forever" that no store can keep.
MAX_TTL = timedelta(days=36525)
MAX_SECONDS = MAX_TTL.total_seconds()


def duration(
    value: object,
    what: str,
    *,
    positive: bool = False,
    maximum: float = MAX_SECONDS,
    text: bool = False,
) -> float:
    """``value`` (a ``timedelta`` or a number of seconds; with ``text``, as from a URL,
    also a numeric string) as float seconds, or :class:`~idemlock.ConfigurationError`.

    The one check of every duration: NaN and infinity are refused (a NaN deadline is
    never reached, so a wait on it spins forever), so are negative values, zero when
    ``positive``, and anything above ``maximum`` (default :data:`MAX_TTL`).
    """
    given = value
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif text and isinstance(value, str):
        try:
            seconds = float(value.strip())
        except ValueError:
            raise ConfigurationError(f"{what} must be a number of seconds, got {given!r}") from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int beyond float range: beyond any maximum too
            seconds = maximum * 2 if value > 0 else -1.0
    else:
        raise ConfigurationError(
            f"{what} must be a timedelta or a number of seconds, got "
            f"{type(value).__name__} {given!r}"
        )
    if math.isnan(seconds):
        raise ConfigurationError(f"{what} must be a number of seconds, got NaN")
    if math.isinf(seconds) and seconds > 0:
        raise ConfigurationError(
            f"{what} must be finite, got {_short(given)}; give a real bound (at most "
            f"{_span(maximum)})"
        )
    if seconds < 0 or (positive and seconds == 0):
        need = "positive" if positive else "zero or positive"
        raise ConfigurationError(f"{what} must be {need}, got {_short(given)}")
    if seconds > maximum:
        raise ConfigurationError(
            f"{what} is longer than the maximum of {_span(maximum)} ({maximum:g} seconds), "
            f"got {_short(given)}; use a shorter duration (idemlock.MAX_TTL is 100 years)"
        )
    return seconds


def _span(seconds: float) -> str:
    if seconds >= 365 * 86400:
        return f"{seconds / (365.25 * 86400):g} years"
    return f"{seconds:g} seconds"


def _short(value: object) -> str:
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an int of {value.bit_length()} bits"  # repr() of a huge int may raise
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class Clock(Protocol):
    """Where time comes from. ``time()`` is wall-clock seconds since the epoch (judges
    expiry in stores without a server); ``monotonic()`` measures the client's own
    intervals (``lease.remaining()``)."""

    def time(self) -> float: ...

    def monotonic(self) -> float: ...


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
