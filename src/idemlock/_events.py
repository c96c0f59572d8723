"""Events: how a port builds one :class:`idemlock.Event` and hands it to the hooks."""

from __future__ import annotations

import logging
from time import perf_counter
from typing import TYPE_CHECKING

from ._core.events import Event
from ._logfields import port_fields

if TYPE_CHECKING:
    from ._coordinator import CoordinatorBase

log = logging.getLogger("idemlock")


class Events:
    """Builds and delivers one port's events; costs one truthiness check when nobody
    listens. A port holds one, made with the port (``port._events``)."""

    __slots__ = ("_coord", "_kind", "_spec_name")

    def __init__(self, coord: CoordinatorBase, kind: str, spec_name: str) -> None:
        # The names port_fields() reads, so a log record about an event names the port.
        self._coord = coord
        self._kind = kind
        self._spec_name = spec_name

    def t0(self) -> float:
        return perf_counter() if self._coord._hooks else 0.0

    def emit(self, name: str, outcome: str, t0: float) -> None:
        if self._coord._hooks:
            self.deliver(name, outcome, perf_counter() - t0)

    def error(self, name: str, exc: BaseException, t0: float) -> None:
        """A store call raised (the store down, a timeout): outcome "error", so an
        outage shows in the metrics instead of silence."""
        if self._coord._hooks:
            self.deliver(name, "error", perf_counter() - t0, type(exc).__name__)

    def deliver(self, name: str, outcome: str, duration: float, error: str | None = None) -> None:
        hooks = self._coord._hooks
        event = Event(
            name,
            outcome,
            self._kind,
            self._spec_name,
            self._coord.store.kind,
            duration,
            self._coord.tenant,
            error,
        )
        for hook in hooks:
            try:
                hook(event)
            except Exception:
                # A broken metrics hook must never break the operation it observes.
                log.warning(
                    "event hook %r failed",
                    hook,
                    exc_info=True,
                    extra=port_fields(self, name, outcome),
                )
