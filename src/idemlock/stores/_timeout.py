"""The check of a store's ``timeout`` option (a keyword or ``?timeout=`` in its URL),
shared by the stores that bound their calls with one."""

from __future__ import annotations

import math

from .._errors import ConfigurationError


def positive_seconds(given: object, what: str = "timeout") -> float:
    """``given`` (a number, or its text from a URL) as seconds: finite and above zero,
    else ``ConfigurationError`` naming ``what``."""
    value = given
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            value = given
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ConfigurationError(
            f"{what} must be a positive, finite number of seconds, got {given!r}"
        )
    return float(value)
