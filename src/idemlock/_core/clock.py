"""Time as the domain sees it: the :class:`Clock` protocol its drivers read (the
machine's clocks or a manual one, in :mod:`idemlock._clock`), and the one validator
of every duration idemlock takes."""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Protocol

from .._errors import ConfigurationError

#: The longest ttl, lease or wait idemlock accepts: 100 years. Stores rely on it
#: (Redis packs expiry times into 6 bytes of milliseconds, datetimes end at year 9999),
#: and anything longer is a mistake or a "forever" that no store can keep.
MAX_TTL = timedelta(days=36525)
MAX_SECONDS = MAX_TTL.total_seconds()


def duration(value: object, what: str, *, positive: bool = False, text: bool = False) -> float:
    """``value`` (a ``timedelta`` or a number of seconds; with ``text``, as from a URL,
    also a numeric string) as float seconds, or :class:`~idemlock.ConfigurationError`.

    The one check of every duration: NaN and infinity are refused (a NaN deadline is
    never reached, so a wait on it spins forever), so are negative values, zero when
    ``positive``, and anything above :data:`MAX_TTL`. The message names ``what``, what
    it must be and what was given.
    """
    seconds = _seconds(value, text)
    # NaN fails every comparison; infinity fails the maximum
    if (
        seconds is not None
        and (seconds > 0 if positive else seconds >= 0)
        and seconds <= MAX_SECONDS
    ):
        return seconds
    need = "a positive" if positive else "zero or a positive"
    form = "number of seconds" if text else "number of seconds or a timedelta"
    raise ConfigurationError(
        f"{what} must be {need} {form}, up to the maximum of 100 years (idemlock.MAX_TTL), "
        f"got {_short(value)}"
    )


def whole_ms(seconds: float) -> int:
    """A positive duration :func:`duration` accepted, in whole milliseconds (at least 1:
    what the stores take)."""
    return max(1, round(seconds * 1000))


def _seconds(value: object, text: bool) -> float | None:
    if isinstance(value, timedelta):
        return value.total_seconds()
    if text and isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(value)
        except OverflowError:  # an int beyond float range: beyond the maximum too
            return math.inf if value > 0 else -math.inf
    return None


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
