"""The fence gate's logic, shared by its two faces (:class:`idemlock.aio.AsyncFenceGate`
and the generated :class:`idemlock.FenceGate`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._core.keys import validate_key
from .._errors import ConfigurationError

if TYPE_CHECKING:
    from .coordinator import CoordinatorBase


class FenceBase:
    """What a fence gate holds for one resource."""

    def __init__(self, coord: CoordinatorBase, resource: str) -> None:
        self._store = coord._store
        self.resource = validate_key(resource, "resource")
        self._ns = coord._ns("fence")

    def _fence_set(self) -> Any:
        if not self._store.capabilities.fence_set:
            raise ConfigurationError(
                f"set_if_fresh writes into the store itself, which the {self._store.kind} "
                "store does not hold user data for. check_and_advance followed by your own "
                "write is not atomic (a newer holder may write in between); for rows of "
                "your own PostgreSQL tables put the check in the write with "
                "idemlock.stores.postgres.fenced.fenced_update or fenced_upsert (check and "
                "write in one statement, on the table's fence column), or keep the value "
                "in the Redis store, whose set_if_fresh is atomic"
            )
        return self._store.fence_set
