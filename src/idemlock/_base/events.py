"""Events: how a port builds one :class:`idemlock.Event` and hands it to the hooks, and
how it reports a claim or lease lost."""

from __future__ import annotations

import logging
from collections.abc import Callable
from time import perf_counter
from typing import TYPE_CHECKING, Any

from .._core.events import Event
from .._logfields import port_fields

if TYPE_CHECKING:
    from .coordinator import CoordinatorBase

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

    def emit(self, name: str, outcome: str, t0: float, token: int | None = None) -> None:
        if self._coord._hooks:
            self.deliver(name, outcome, perf_counter() - t0, token=token)

    def error(self, name: str, exc: BaseException, t0: float, token: int | None = None) -> None:
        """A store call raised (the store down, a timeout): outcome "error", so an
        outage shows in the metrics instead of silence."""
        if self._coord._hooks:
            self.deliver(name, "error", perf_counter() - t0, type(exc).__name__, token)

    def waits(self) -> Waits | None:
        """What reports an acquire's wait, or None when nobody listens."""
        return Waits(self) if self._coord._hooks else None

    def deliver(
        self,
        name: str,
        outcome: str,
        duration: float,
        error: str | None = None,
        token: int | None = None,
    ) -> None:
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
            token,
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


class Waits:
    """One acquire's wait, as events: ``wait`` ``started`` when its first attempt was
    refused and it goes on waiting (``start``, called by the acquire flow), ``wait``
    ``ended`` once the acquire is over, however (``end``, called in ``finally``: granted,
    timed out, failed or cancelled), so a gauge of waiters never keeps one that left."""

    __slots__ = ("_events", "_since")

    def __init__(self, events: Events) -> None:
        self._events = events
        self._since: float | None = None

    def start(self) -> None:
        self._since = perf_counter()
        self._events.deliver("wait", "started", 0.0)

    def end(self) -> None:
        if self._since is not None:
            since, self._since = self._since, None
            self._events.deliver("wait", "ended", perf_counter() - since)


def report_loss(
    events: Events,
    on_lost: Callable[[Any], object] | None,
    lost: object,
    what: str,
    thing: str,
    token: int | None = None,
) -> None:
    """A claim or lease was lost: the ``lost`` event (with the lease's ``token``), then
    ``on_lost(lost)``. The loss is what matters (the block still raises, an async body
    is still cancelled), so the callback's error is logged, never raised."""
    if events._coord._hooks:
        events.deliver("lost", "lost", 0.0, token=token)
    if on_lost is None:
        return
    try:
        on_lost(lost)
    except Exception:
        log.warning(
            "on_lost callback %r for a %s of spec %s raised; the %s is lost all the same",
            on_lost,
            what,
            events._spec_name,
            thing,
            exc_info=True,
            extra=port_fields(events, "on_lost", "error"),
        )
