"""The rows of the etcd store's listings and reads (``records()``, ``locks()``,
``lock()``), made from the key-values etcd returns. A value the store cannot read is
listed as a corrupt row, with a warning, so one bad key never hides the others."""

from __future__ import annotations

import logging
from typing import Any, Literal

from ..._core.port import LockRow, RecordRow
from ..._logfields import fields as log_fields
from . import _codec as K

log = logging.getLogger("idemlock")


def record_row(ns: str, key: str, rec: Any, marker: Any) -> RecordRow | None:
    """The row of a record and its lease marker (None: an in-flight claim whose lease
    ended, kept only for a late completion)."""
    val = K.parse_record(rec.value)
    if isinstance(val, K.InFlightVal):
        if marker is None:
            return None
        times = K.parse_marker(marker.value)
        return RecordRow(ns, key, "in_flight", int(rec.mod_revision), times.expires_ms)
    return RecordRow(ns, key, "completed", val.fence, val.times.expires_ms)


def lock_row(ns: str, key: str, kv: Any) -> LockRow:
    val = K.parse_lock(kv.value)
    return LockRow(
        ns, key, val.owner, int(kv.create_revision), val.times.expires_ms, value=val.value
    )


def corrupt(kind: Literal["c", "l"], raw: bytes, why: str, ns: str = "", key: str = "") -> Any:
    """The corrupt row of the key ``raw`` of ``kind`` ("c" a record, "l" a lock)."""
    what = "record" if kind == "c" else "lock"
    log.warning(
        "idemlock: etcd key %r is not an idemlock %s (%s); listed as corrupt",
        raw,
        what,
        why,
        extra=log_fields(store="etcd", operation="list", outcome="corrupt"),
    )
    name = key or raw.decode("utf-8", "replace")
    if kind == "c":
        return RecordRow(ns, name, "corrupt", 0, 0)
    return LockRow(ns, name, "", 0, 0, corrupt=True)
