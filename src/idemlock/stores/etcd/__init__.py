"""The etcd store: fenced leases and idempotent claims on etcd v3 (3.4+), sync and asyncio.

(Full description in docs/etcd.md.)
"""

from __future__ import annotations

from typing import Any

from . import _conf
from ._sync import EtcdStore

__all__ = ["EtcdStore", "open_async", "open_sync"]


def open_sync(url: str, **options: Any) -> tuple[EtcdStore, None]:
    return EtcdStore(_conf.parse(url, options)), None


def open_async(url: str, **options: Any) -> tuple[Any, None]:
    from ._async import AsyncEtcdStore

    return AsyncEtcdStore(_conf.parse(url, options)), None
