"""fencekit's key-naming helper.

idemlock lays out its own keys (escaped or hashed, one hash tag per record on Redis
Cluster); the names built here are the ones fencekit used, kept so code that logs or
inspects them still runs. The façade stores nothing under them.
"""

from __future__ import annotations

__all__ = ["DEFAULT_PREFIX", "KeySpace"]

DEFAULT_PREFIX = "fencekit"


def _segment(value: object, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty str, got {value!r}")
    if any(ch.isspace() for ch in value):
        raise ValueError(f"{what} must not contain whitespace, got {value!r}")
    return value


class KeySpace:
    """Names of the form ``<prefix>:<family>:<name>``."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = _segment(prefix, "prefix")

    def _join(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    def idempotency(self, key: str) -> str:
        return self._join("idem", _segment(key, "idempotency key"))

    def idempotency_result(self, key: str) -> str:
        return self.idempotency(key) + ":result"

    def lock(self, resource: str) -> str:
        return self._join("lock", _segment(resource, "resource"))

    def fence_seq(self, resource: str) -> str:
        return self._join("fence", "seq", _segment(resource, "resource"))

    def fence_max(self, resource: str) -> str:
        return self._join("fence", "max", _segment(resource, "resource"))
