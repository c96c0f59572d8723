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


class Emitter:
    """Builds and delivers events; costs one truthiness check when nobody listens."""

    _coord: CoordinatorBase
    _kind: str
    _spec_name: str

    def _t0(self) -> float:
        return perf_counter() if self._coord._hooks else 0.0

    def _emit(self, name: str, outcome: str, t0: float) -> None:
        if self._coord._hooks:
            self._deliver(name, outcome, perf_counter() - t0)

    def _emit_error(self, name: str, exc: BaseException, t0: float) -> None:
        """A store call raised (the store down, a timeout): outcome "error", so an
        outage shows in the metrics instead of silence."""
        if self._coord._hooks:
            self._deliver(name, "error", perf_counter() - t0, type(exc).__name__)

    def _deliver(self, name: str, outcome: str, duration: float, error: str | None = None) -> None:
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
