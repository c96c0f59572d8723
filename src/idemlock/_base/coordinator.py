"""What the sync and async coordinators share: the store, the key prefix and tenant,
the clock, the result format, the keyring, the event hooks, and the checks of specs
and listings."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any

from .._core.clock import Clock, duration
from .._core.codec import COMPRESS_OVER, MAX_RESULT_BYTES, ResultFormat
from .._core.events import Hook
from .._core.keys import namespace, split_namespace, validate_key
from .._core.port import Capabilities, LockRow, RecordRow
from .._core.types import (
    ElectionSpec,
    IdempotencySpec,
    LockInfo,
    LockSpec,
    RecordStatus,
    SemaphoreSpec,
    from_ms,
)
from .._errors import ConfigurationError

if TYPE_CHECKING:
    from .._keyring import Keyring


class CoordinatorBase:
    """Holds the store, the key prefix, the tenant, the clock, the result format and
    the keyring."""

    def __init__(
        self,
        store: Any,
        *,
        key_prefix: str = "idemlock",
        clock: Clock | None = None,
        url: str | None = None,
        keyring: Keyring | None = None,
        tenant: str | None = None,
        max_result_bytes: int = MAX_RESULT_BYTES,
        compress_over: int | None = COMPRESS_OVER,
        hooks: Iterable[Hook] | None = None,
    ) -> None:
        from .._clock import SYSTEM_CLOCK

        self._store = store
        self.capabilities = _capabilities(store)
        self.key_prefix = validate_key(key_prefix, "key_prefix")
        self.tenant = None if tenant is None else validate_key(tenant, "tenant")
        self.clock: Clock = clock or SYSTEM_CLOCK
        self.url = url
        if keyring is not None and type(keyring).__name__ != "Keyring":
            # Only the type: a str here is often the keyring's JSON, every key in it.
            raise ConfigurationError(
                f"keyring must be an idemlock.Keyring, got a {type(keyring).__name__}; "
                "build one with idemlock.Keyring.from_env() (from $IDEMLOCK_KEYRING), "
                "Keyring.from_json(text) or Keyring.from_file(path)"
            )
        self.keyring = keyring
        self.result_format = ResultFormat(max_result_bytes, compress_over)
        #: longest wait between re-checks where notifications do not cross processes
        self.poll_cap: float | None = (
            None if self.capabilities.cross_process_wakeups else float(store.poll_cap)
        )
        #: a tenant view shares its parent's store and must not close it
        self._owns_store = True
        #: event hooks; shared with tenant views and ports, so add_hook applies to all
        self._hooks: list[Hook] = list(hooks or ())
        #: the one timer for every local deadline this coordinator (and its tenant
        #: views) holds: a lease in hold() is lost when it passes
        self._watchdog: Any = self._make_watchdog(self.clock)
        #: the one renewer (heartbeats) for every claim this coordinator keeps alive
        self._renewer: Any = self._make_renewer(store, self.clock)

    def _make_watchdog(self, clock: Clock) -> Any:
        raise NotImplementedError

    def _make_renewer(self, store: Any, clock: Clock) -> Any:
        raise NotImplementedError

    def add_hook(self, hook: Hook) -> None:
        """Call ``hook(event)`` for every outcome (see :class:`idemlock.Event`)."""
        if not callable(hook):
            raise ConfigurationError(f"a hook must be callable, got {hook!r}")
        self._hooks.append(hook)

    def _view_of(self, parent: CoordinatorBase, tenant: str) -> None:
        self.__dict__.update(parent.__dict__)
        self.tenant = validate_key(tenant, "tenant")
        self._owns_store = False

    def _call_bound(self) -> float:
        return float(self._store.timeout)

    def _renewal_period(
        self, renew_every: timedelta | float | None, of_ms: int, of: Callable[[], str]
    ) -> float:
        """The period its renewer renews a claim's heartbeat or a lock's lease at, in
        seconds (default: a third of ``of_ms``, what each renewal extends); ``of()``
        names that in the error."""
        if renew_every is None:
            return of_ms / 3000
        s = duration(renew_every, "renew_every", positive=True)
        if s * 1000 >= of_ms:
            raise ConfigurationError(
                f"renew_every must be positive and shorter than {of()}, got {s}s"
            )
        return s

    @property
    def store(self) -> Any:
        """The store adapter (for store-specific extras; typed ``Any`` as it is the
        adapter of whichever store the URL named)."""
        return self._store

    def _ns(self, name: str) -> str:
        return namespace(self.key_prefix, name, self.tenant)

    def _ns_prefix(self) -> str:
        return namespace(self.key_prefix, "x", self.tenant)[:-1]

    def _idem_spec(self, spec: IdempotencySpec | str) -> IdempotencySpec:
        if isinstance(spec, str):
            return IdempotencySpec(spec)
        if not isinstance(spec, IdempotencySpec):
            raise ConfigurationError(
                f"expected an IdempotencySpec or a spec name, got {type(spec).__name__}"
            )
        if spec.encrypt_result and self.keyring is None:
            raise ConfigurationError(
                f"spec {spec.name!r} has encrypt_result=True but this coordinator has no "
                "keyring to seal results with; pass keyring=idemlock.Keyring.from_env() (or "
                "another Keyring) to connect(), or set encrypt_result=False"
            )
        return spec

    def _lock_spec(self, spec: LockSpec | str) -> LockSpec:
        if isinstance(spec, str):
            spec = LockSpec(spec)
        if not isinstance(spec, LockSpec):
            raise ConfigurationError(
                f"expected a LockSpec or a spec name, got {type(spec).__name__}"
            )
        # requires_fencing_token holds on every store: each one issues fencing tokens.
        return spec

    def _election_spec(self, spec: ElectionSpec | str) -> ElectionSpec:
        if isinstance(spec, str):
            return ElectionSpec(spec)
        if not isinstance(spec, ElectionSpec):
            raise ConfigurationError(
                f"expected an ElectionSpec or a spec name, got {type(spec).__name__}"
            )
        return spec

    def _semaphore_spec(self, spec: SemaphoreSpec) -> SemaphoreSpec:
        if not isinstance(spec, SemaphoreSpec):
            raise ConfigurationError(
                f"expected a SemaphoreSpec (a name and a limit: "
                f"SemaphoreSpec('exports', limit=3)), got {type(spec).__name__}"
            )
        return spec

    def _listing_place(self, ns: str) -> tuple[str, str | None]:
        """(spec name, tenant or None) of a listed namespace. The root's listing covers
        its tenants' namespaces too (``prefix:t=<tenant>:<spec>``), so each row says
        whose it is and can be acted on through ``for_tenant``."""
        parts = split_namespace(ns)
        if not parts:
            return ns, None
        tenant = None
        # namespace() escapes ':' in every part, so a tenant's namespace has 3 parts.
        if len(parts) == 3 and ns.split(":")[1].startswith("t="):
            tenant = parts[1][2:]
        return parts[-1], tenant

    def _lock_info(self, row: LockRow) -> LockInfo:
        spec, tenant = self._listing_place(row.ns)
        return LockInfo(
            spec,
            row.key,
            row.owner,
            row.token,
            _listed_time(row.expires_ms),
            tenant,
            bool(getattr(row, "corrupt", False)),
            None if row.value is None else row.value.decode("utf-8", "replace"),
        )

    def _record_status(self, row: RecordRow) -> RecordStatus:
        spec, tenant = self._listing_place(row.ns)
        return RecordStatus(
            row.key, row.state, row.fence, _listed_time(row.expires_ms), spec, tenant
        )


def _capabilities(store: Any) -> Capabilities:
    try:
        caps = store.capabilities
    except AttributeError:
        caps = None
    if not isinstance(caps, Capabilities):
        raise ConfigurationError(
            f"a {type(store).__name__} is not an idemlock store (it declares no "
            "capabilities); open a coordinator with idemlock.connect(url) or pass one "
            "of the stores in idemlock.stores"
        )
    return caps


def _listed_time(ms: int) -> datetime:
    # A corrupt row may carry any number: list it rather than fail on its date.
    try:
        return from_ms(int(ms))
    except (OverflowError, ValueError, OSError, TypeError):
        return datetime.max.replace(tzinfo=timezone.utc)
