"""Durations given by callers (waits, timeouts, intervals), in seconds."""

from __future__ import annotations

from datetime import timedelta

from ._core.clock import duration


def seconds(value: timedelta | float | None, what: str) -> float | None:
    """A wait, timeout or interval given by the caller, in seconds (None stays None).
    The one duration check (NaN, infinity, negative and above ``MAX_TTL`` refused)."""
    if value is None:
        return None
    return duration(value, what)
