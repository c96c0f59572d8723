"""What the queue integrations take, checked once for all of them: :class:`JobOptions`
(how an idempotent job runs: Celery's ``idemlock_*`` task options, the keywords of
RQ's, arq's and Dramatiq's decorators) and :class:`SendArgs` (the one calling
convention of their ``enqueue_once``: the job's ``args=``/``kwargs=`` and the send
``lease=``)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypedDict

from ..._core.clock import duration
from ..._core.types import MAX_LIMIT, IdempotencySpec, SemaphoreSpec
from ..._errors import ConfigurationError
from ..._urls import redact

#: the send lease of ``enqueue_once`` when none is given, in seconds
DEFAULT_SEND_LEASE = 600.0
#: how long a job waits for a permit of its concurrency limit before it comes back later
DEFAULT_CONCURRENCY_WAIT = 1.0
#: the permits' key of a job limited without a ``concurrency_key``: one for all its jobs
ALL_JOBS = "all"


class JobKeywords(TypedDict, total=False):
    """The keyword options of RQ's, arq's and Dramatiq's decorators (Celery's task
    takes them as ``idemlock_*`` task options), each described in the integration's
    module; a misspelt name or a value of the wrong type is refused by a type checker
    as it is (``ConfigurationError``) at run time."""

    replay_errors: Iterable[type[BaseException]]
    retry_every: float
    store_retry_backoff: float
    store_retry_max: float
    renew_every: timedelta | float | None
    max_run: timedelta | float | None
    concurrency: int | None
    concurrency_key: Callable[..., str] | None
    concurrency_wait: timedelta | float


@dataclasses.dataclass(frozen=True)
class JobOptions:
    """The options every queue integration takes for an idempotent job (Celery's with
    the ``idemlock_`` prefix), checked when the job is made. ``where`` and ``prefix``
    (not kept) name the job and the options in the errors."""

    spec: IdempotencySpec | str
    key: Callable[..., str] | None = None
    #: a Coordinator (an AsyncCoordinator for async jobs), a store URL, a callable
    #: returning a coordinator, or None (``$IDEMLOCK_URL``); opened in each process
    coordinator: Any = None
    replay_errors: tuple[type[BaseException], ...] = ()
    #: the longest wait before a job whose key another attempt holds runs again
    retry_every: float = 5.0
    #: the first and the longest wait before a job runs again after a store failure
    store_retry_backoff: float = 1.0
    store_retry_max: float = 60.0
    renew_every: timedelta | float | None = None
    max_run: timedelta | float | None = None
    #: the send lease of ``enqueue_once`` when it is given none
    send_lease: float = DEFAULT_SEND_LEASE
    #: at most this many jobs of one concurrency key run at once (None: no limit)
    concurrency: int | None = None
    #: a callable of the job's arguments returning its concurrency key (None: one key
    #: for every job of this function)
    concurrency_key: Callable[..., str] | None = None
    #: how long a job waits for a permit before it is sent back to the queue
    concurrency_wait: timedelta | float = DEFAULT_CONCURRENCY_WAIT
    #: the semaphore of the concurrency limit (None: no limit), made from the above
    permits: SemaphoreSpec | None = dataclasses.field(init=False, default=None)
    where: dataclasses.InitVar[str] = ""
    prefix: dataclasses.InitVar[str] = ""

    def __post_init__(self, where: str, prefix: str) -> None:
        at = f"{where}: {prefix}" if where else prefix
        if not isinstance(self.spec, (str, IdempotencySpec)):
            raise ConfigurationError(
                f"{at}spec must be an IdempotencySpec or a name, got {self.spec!r}"
            )
        if isinstance(self.spec, str):
            IdempotencySpec(self.spec)  # validates the name when the job is made
        if self.key is not None and not callable(self.key):
            raise ConfigurationError(f"{at}key must be a callable of the job's arguments or None")
        set_ = object.__setattr__
        set_(self, "replay_errors", tuple(self.replay_errors))
        for name in ("retry_every", "store_retry_backoff", "store_retry_max", "send_lease"):
            set_(self, name, duration(getattr(self, name), f"{at}{name}", positive=True))
        for name in ("renew_every", "max_run"):
            if getattr(self, name) is not None:
                duration(getattr(self, name), f"{at}{name}")
        set_(self, "permits", self._permits(at, prefix))

    def _permits(self, at: str, prefix: str) -> SemaphoreSpec | None:
        """The semaphore of ``concurrency``: named after the job's spec, its permits'
        lease the spec's (renewed while the body runs, like the claim)."""
        n = self.concurrency
        if n is not None and (
            isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_LIMIT
        ):
            raise ConfigurationError(
                f"{at}concurrency must be None or an int from 1 to {MAX_LIMIT} (the most "
                f"jobs of one concurrency key running at once), got {n!r}"
            )
        if self.concurrency_key is not None and not callable(self.concurrency_key):
            raise ConfigurationError(
                f"{at}concurrency_key must be a callable of the job's arguments returning "
                "the key its concurrency limit counts by, or None, got "
                f"{described(self.concurrency_key)}"
            )
        wait = duration(self.concurrency_wait, f"{at}concurrency_wait")
        object.__setattr__(self, "concurrency_wait", wait)
        if n is None:
            if self.concurrency_key is not None:
                raise ConfigurationError(
                    f"{at}concurrency_key needs {prefix}concurrency (the most jobs of one key "
                    "running at once)"
                )
            return None
        spec = self.spec if isinstance(self.spec, IdempotencySpec) else IdempotencySpec(self.spec)
        return SemaphoreSpec(f"{spec.name}.concurrency", limit=n, ttl=spec.lease)

    @classmethod
    def of(
        cls,
        spec: IdempotencySpec | str,
        key: Callable[..., str] | None,
        coordinator: Any,
        keywords: Mapping[str, Any],
        *,
        where: str,
    ) -> JobOptions:
        """The options of a decorator (``where``): its arguments and :class:`JobKeywords`."""
        unknown = sorted(set(keywords) - JobKeywords.__optional_keys__)
        if unknown:
            raise ConfigurationError(
                f"{where}: unknown option(s) {', '.join(unknown)}; the options are spec, "
                f"key, coordinator, {', '.join(sorted(JobKeywords.__optional_keys__))}"
            )
        errors = tuple(keywords.get("replay_errors", ()))
        return cls(spec, key, coordinator, **{**keywords, "replay_errors": errors}, where=where)


@dataclasses.dataclass(frozen=True)
class SendArgs:
    """What every queue's ``enqueue_once`` takes besides the queue's own send options,
    checked once for all of them: the job's arguments (``args=``, ``kwargs=``: the
    job's own keywords live in their dict, so none can collide with a send option)
    and idemlock's send ``lease`` in seconds."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    lease: float

    @classmethod
    def parse(
        cls,
        args: Sequence[Any] | None,
        kwargs: Mapping[str, Any] | None,
        lease: timedelta | float | None,
        *,
        call: str,
        default_lease: float = DEFAULT_SEND_LEASE,
    ) -> SendArgs:
        """The arguments of ``call`` (named in errors), or ConfigurationError."""
        if args is None:
            args = ()
        if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
            raise ConfigurationError(
                f"{call}: args= must be a tuple or list of the job's positional arguments, "
                f"got {described(args)} (for one argument write args=(value,))"
            )
        if kwargs is None:
            kwargs = {}
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise ConfigurationError(
                f"{call}: kwargs= must be a dict of the job's keyword arguments by name, "
                f"got {described(kwargs)}"
            )
        given = default_lease if lease is None else lease
        value = duration(given, f"{call}: lease= (the send lease)", positive=True)
        return cls(tuple(args), dict(kwargs), value)


def described(value: Any) -> str:
    """``value`` as a message may show it: a str redacted (it may be a store URL with
    its password), anything else by its type only (its repr may hold secrets)."""
    if isinstance(value, str):
        return f"the str {redact(value)!r}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def spec_name(spec: IdempotencySpec | str | None) -> str | None:
    return spec.name if isinstance(spec, IdempotencySpec) else spec


def legacy_arguments(
    positional: tuple[Any, ...],
    args: Sequence[Any] | None,
    kwargs: Mapping[str, Any] | None,
    *,
    old: str,
    new: str,
    call: str,
) -> tuple[Sequence[Any] | None, Mapping[str, Any] | None]:
    """RQ's 0.1 form ``enqueue_once(queue, fn, args, kwargs)``: the (args, kwargs) it
    meant, with a DeprecationWarning that names the new call; ``positional`` empty:
    ``args``/``kwargs`` unchanged."""
    if not positional:
        return args, kwargs
    if len(positional) > 2 or args is not None or (len(positional) == 2 and kwargs is not None):
        raise ConfigurationError(
            f"{call}: pass the job's arguments as args=(...) and kwargs={{...}} only, "
            f"got {len(positional)} more positional argument(s)"
        )
    deprecated(old, new, stacklevel=4)
    args = positional[0]
    if len(positional) == 2:
        kwargs = positional[1]
    return args, kwargs


def deprecated(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that ``old`` goes in a later release; ``stacklevel`` counts from the
    caller of this function (3: the caller of the function that called it)."""
    warnings.warn(
        f"{old} is deprecated and will be removed in idemlock 0.3: call {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
