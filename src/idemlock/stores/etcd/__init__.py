"""The etcd store: fenced leases and idempotent claims on etcd v3 (3.4+), sync and asyncio.

URLs: ``etcd://[user:password@]host:port[,host:port...]`` and ``etcds://`` (TLS, with
``?ca=``, ``cert=``, ``key=`` PEM files). Options (URL query or keywords): ``timeout``
(seconds, default 5: the bound on one store call, retries and failover included),
``prefix`` (etcd key prefix, default ``idemlock/``), ``user``, ``password``.

* Tokens and fences are Raft revisions (a permit's ``create_revision``, the revision of
  the Txn that granted a claim): they strictly increase for the cluster's life, with
  no clock assumption.
* Every transition is one Txn guarded by compares on revisions and on the value's
  owner/token prefix (:mod:`._ops`); each permit of a lock key (a lock is the one-permit
  case, stored as in the previous releases), a claim's lease marker and a completed
  record each live on an etcd lease of their own (etcd's clock decides expiry, in
  whole seconds, never before the caller's ttl ends).
* A call whose reply was lost (UNAVAILABLE, DEADLINE_EXCEEDED) is sent again, to the
  next member, and recognises its own first attempt; nothing is applied twice.
* Waiters are woken by one Watch stream per store; processes waiting for a lock queue
  up in etcd (a key each, ordered by create_revision) and get it in arrival order.
* The client is a thin layer over stubs generated from etcd's .proto files
  (``tools/gen_etcd_stubs.py``): ``grpc.Channel`` (:mod:`._sync`) and ``grpc.aio``
  (:mod:`._async`) drive the same op generators. After ``os.fork()`` the child uses
  etcd's HTTP gateway instead (:mod:`._gateway`): gRPC's core is not fork-safe.
* Importing this package sets ``GRPC_ENABLE_FORK_SUPPORT=false`` unless it is set (or
  gRPC is already loaded, which then keeps its own setting). gRPC's core turns its fork
  handlers on by default while its Python layer turns them off; when another thread is
  inside gRPC at a fork (our watch and retry threads often are) the handlers are
  skipped half-way, and the child of a ``fork()`` or of a ``subprocess`` started with
  ``user=`` could abort inside them before it reaches its own code. The child never
  needs them: it does not touch gRPC.
"""

from __future__ import annotations

import os
import sys
from typing import Any

if "grpc" not in sys.modules:
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from . import _conf
from ._sync import EtcdStore

__all__ = ["EtcdStore", "open_async", "open_sync"]


def open_sync(url: str, **options: Any) -> tuple[EtcdStore, None]:
    return EtcdStore(_conf.parse(url, options)), None


def open_async(url: str, **options: Any) -> tuple[Any, None]:
    from ._async import AsyncEtcdStore

    return AsyncEtcdStore(_conf.parse(url, options)), None
