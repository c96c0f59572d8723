"""The decorator engine shared by ``@port.idempotent`` (sync and async) and the queue
integrations: what a decorated function needs on every call, and the checks of the
decorator's options."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ._core.canonical import fingerprint
from ._core.clock import duration
from ._core.codec import type_name
from ._core.keys import validate_key
from ._core.types import ClaimToken, Completed, IdempotencySpec
from ._errors import ConfigurationError

if TYPE_CHECKING:
    from ._base.idempotency import IdempotencyBase

IN_FLIGHT_MODES = ("raise", "wait")

# The settings that make a caller wait for a key in flight, as InFlightError names
# them. The decorator names its own only when it waited: a job integration (RQ, arq,
# Dramatiq) wraps with on_in_flight="raise" and has no such setting.
DECORATOR_WAIT = "idempotent(..., on_in_flight='wait', wait=seconds)"
RUN_WAIT = "port.run(key, wait=seconds)"


class WrapPlan:
    """What a decorated function needs on every call: its key, payload, result types
    and the exceptions whose outcome is recorded and replayed."""

    def __init__(
        self,
        fn: Callable[..., Any],
        key: Callable[..., str] | None,
        replay_errors: tuple[type[BaseException], ...],
    ) -> None:
        self.fn = fn
        self.key = key
        self.sig = inspect.signature(fn)
        if isinstance(replay_errors, type):
            replay_errors = (replay_errors,)
        for tp in replay_errors:
            if not (isinstance(tp, type) and issubclass(tp, Exception)):
                raise ConfigurationError(f"replay_errors must be exception classes, got {tp!r}")
        self.errors = tuple(replay_errors)
        # Types are resolved only from this allow-list, never imported by stored name.
        self.by_name = {type_name(tp): tp for tp in self.errors}
        self._types: tuple[Any, Any] | None = None

    def types(self) -> tuple[Any, Any]:
        """(dump, load) for the declared return type, resolved on first use so forward
        references defined later in the module work."""
        if self._types is None:
            from ._core.typed import TypedError, dumper, loader

            try:
                hints = typing.get_type_hints(self.fn)
            except Exception as exc:
                raise ConfigurationError(
                    f"cannot resolve the return annotation of {self.fn.__qualname__}: {exc}"
                ) from None
            tp = hints.get("return", Any)
            try:
                self._types = (dumper(tp), loader(tp))
            except TypedError as exc:
                raise ConfigurationError(f"{self.fn.__qualname__}: {exc}") from None
        return self._types

    def key_payload(self, args: Any, kwargs: Any) -> tuple[str, dict[str, Any]]:
        bound = self.sig.bind(*args, **kwargs)
        bound.apply_defaults()
        payload = dict(bound.arguments)
        if self.key is None:
            return fingerprint(payload), payload
        return validate_key(self.key(*args, **kwargs)), payload

    def check_replayable(self, claim: Completed, key: str, spec: str) -> None:
        """``ResultDecodeError``, naming the record of ``key`` in ``spec``, when
        :meth:`replay` could not raise ``claim``'s recorded exception again."""
        if claim.error is not None and claim.error.type not in self.by_name:
            raise self._not_replayable(claim.error.type, f"record of key {key!r} (spec {spec!r}): ")

    def replay(self, claim: Completed) -> Any:
        if claim.error is None:
            return claim.result
        tp = self.by_name.get(claim.error.type)
        if tp is None:
            # Callers check first (check_replayable names the key); a fallback.
            raise self._not_replayable(claim.error.type, "")
        raise tp(*claim.error.args)

    def _not_replayable(self, type_: str, record: str) -> Exception:
        from ._errors import ResultDecodeError

        return ResultDecodeError(
            f"{record}the recorded outcome is an exception of type {type_}, which is not "
            f"in replay_errors of {self.fn.__qualname__}; add it there, or forget the "
            "record (port.forget(key)) so the next call runs the function again"
        )


def wrap_options(
    spec_or_name: IdempotencySpec | str,
    key: Callable[..., str] | None,
    on_in_flight: str,
    wait: timedelta | float | None,
) -> None:
    if on_in_flight not in IN_FLIGHT_MODES:
        raise ConfigurationError(
            f"on_in_flight must be one of {IN_FLIGHT_MODES}, got {on_in_flight!r}"
        )
    if key is not None and not callable(key):
        raise ConfigurationError("key must be a callable of the call's arguments, or None")
    if wait is not None:
        duration(wait, "wait")


def heartbeat_options(
    port: IdempotencyBase,
    heartbeat: bool,
    renew_every: timedelta | float | None,
    max_run: timedelta | float | None,
    on_lost: Callable[[ClaimToken], object] | None,
) -> tuple[float | None, float | None]:
    """(renewal interval or None for no heartbeat, max_run seconds or None)."""
    if not isinstance(heartbeat, bool):
        raise ConfigurationError(f"heartbeat must be True or False, got {heartbeat!r}")
    if on_lost is not None and not callable(on_lost):
        raise ConfigurationError(f"on_lost must be a callable of the claim token, got {on_lost!r}")
    every = port._heartbeat_every(renew_every)
    limit = None if max_run is None else duration(max_run, "max_run", positive=True)
    return (every if heartbeat else None), limit


@dataclass(frozen=True, slots=True)
class Wrapping:
    """What ``idempotent()`` wraps a function with, on either face: its port, the key
    function, the errors to replay, the wait for a key in flight and the heartbeat's
    interval, limit and ``on_lost``."""

    port: Any
    key: Callable[..., str] | None
    replay_errors: tuple[type[BaseException], ...]
    wait_s: float | None
    every: float | None
    limit: float | None
    on_lost: Callable[[ClaimToken], object] | None

    def plan(self, fn: Callable[..., Any]) -> WrapPlan:
        return WrapPlan(fn, self.key, self.replay_errors)
