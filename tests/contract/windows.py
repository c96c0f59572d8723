"""Hand-off windows and waiter registrations that outlast a loaded machine's stalls.

A released lock is reserved for the longest-waiting process for a few milliseconds
(Redis 10, PostgreSQL 50), and a waiter's registration lapses a second or two after its
last attempt. A test that checks who may take a reserved lock makes its calls one after
another, and a busy machine may stall longer than that between two of them: the window
ends under the test and a newcomer takes the lock. :func:`long_windows` makes both last
minutes in this process; the options it returns give the stores whose window is a
connection option (Redis's ``handoff_ms``) their longest one.
"""

from __future__ import annotations

from typing import Any

import pytest

#: ms a window or a registration lasts under long_windows
LONG_MS = 600_000


def long_windows(monkeypatch: pytest.MonkeyPatch, store: str) -> dict[str, Any]:
    """Lengthen ``store``'s hand-off window and registrations; the connect options the
    releasing coordinator needs for it."""
    if store.startswith("postgres"):  # postgres-pgbouncer too
        from psycopg.types.numeric import Int8

        from idemlock.stores.postgres import _async, _shared, _sync

        for module in (_sync, _async):
            monkeypatch.setattr(module, "_HANDOFF_MS8", Int8(LONG_MS))
        monkeypatch.setattr(_shared, "_REGISTER_MS8", Int8(LONG_MS))
    elif store.startswith("redis"):
        from idemlock.stores.redis import _common

        monkeypatch.setattr(_common, "REGISTER_MS", LONG_MS)
        return {"handoff_ms": 10_000}  # the longest the option admits
    elif store.startswith("etcd"):
        from idemlock.stores.etcd import _ops

        monkeypatch.setattr(_ops, "WAITER_S", LONG_MS // 1000)
    elif store == "sqlite":
        from idemlock.stores.sqlite import _store

        monkeypatch.setattr(_store, "HANDOFF_MS", LONG_MS)
        monkeypatch.setattr(_store, "REGISTER_SLACK_MS", LONG_MS)
    return {}
