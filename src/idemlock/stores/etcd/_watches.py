"""The bookkeeping of etcd watches, without I/O: shared by the thread watcher
(``_grpc_sync``) and the task watcher (``_grpc_aio``).

One watch per key range, shared by this store's local waiters on it (a *group*),
named by a watch id the server echoes back. The watchers keep only what differs:
how a create is awaited (a condition or an event), how requests reach the stream
(a queue or ``call.write``) and how the stream is read and re-opened.

This is not :class:`idemlock._core.wakeups.Wakeups`: etcd confirms a watch by its
id rather than in wire order, re-creates a watch the server cancelled, has no
waiter-id filter (its lock hand-off is the waiters' queue of ``_ops``), and gives
a watch up as soon as its last waiter leaves (no linger).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from ..._core.port import Channel
from . import _codec as K
from ._ops import Rpc, Waiter
from ._pb.etcdserverpb import rpc_pb2 as _rpc_pb2

pb: Any = _rpc_pb2  # generated without type information

#: mvccpb.Event.EventType.PUT
PUT = 0

S = TypeVar("S", bound=Hashable)  # a watcher's mailbox type


class Group(Generic[S]):
    """One etcd watch (one key range), shared by this store's waiters on it."""

    __slots__ = ("channel", "end", "id", "key", "no_put", "quiet", "subs", "waiter")

    def __init__(self, wid: int, key: bytes, end: bytes, channel: Channel) -> None:
        self.id = wid
        self.key = key
        self.end = end
        self.channel = channel
        self.no_put = channel.kind == "lock"  # a lock is freed by a deletion only
        self.quiet = quiet_key(channel, end)  # a key whose puts wake nobody
        #: this process's place in the lock's queue while its callers wait
        self.waiter = Waiter() if channel.kind == "lock" else None
        self.subs: set[S] = set()

    def create(self) -> Any:
        filters = [pb.WatchCreateRequest.NOPUT] if self.no_put else []
        return pb.WatchRequest(
            create_request=pb.WatchCreateRequest(
                key=self.key, range_end=self.end, watch_id=self.id, filters=filters
            )
        )

    def cancel(self) -> Any:
        return pb.WatchRequest(cancel_request=pb.WatchCancelRequest(watch_id=self.id))


G = TypeVar("G", bound=Group[Any])


class Book(Generic[G]):
    """A watcher's groups, by key range and by watch id."""

    def __init__(self, root: bytes, new_group: Callable[[int, bytes, bytes, Channel], G]) -> None:
        self.root = root
        self._new = new_group
        #: by (key, range_end, channel kind): a lock's waiters and its observers (who
        #: also want the puts) watch the same range apart
        self.groups: dict[tuple[bytes, bytes, str], G] = {}
        self.by_id: dict[int, G] = {}
        self._ids = itertools.count(1)

    def reset(self) -> None:
        """Forget every group (a new event loop, a forked child)."""
        self.groups, self.by_id = {}, {}

    def group(self, key: bytes, end: bytes, channel: Channel) -> tuple[G, bool]:
        """The group of a range (the caller adds its waiter to ``subs``); True if the
        group is new (its create is to be sent)."""
        g = self.groups.get((key, end, channel.kind))
        if g is not None:
            return g, False
        g = self._new(next(self._ids), key, end, channel)
        self.groups[(key, end, channel.kind)] = g
        self.by_id[g.id] = g
        return g, True

    def waiting(self, key: bytes) -> Waiter | None:
        """This process's place in the queue of the lock named ``key``, if a caller of
        this store waits for it."""
        g = self.groups.get((key, K.lock_end(key), "lock"))
        return g.waiter if g is not None and g.subs else None

    def leave(self, g: G, sub: Any, background: Callable[[Rpc], None]) -> bool:
        """Remove a waiter; True if it was its group's last (the watch is to be
        cancelled). The lock queue's place of a group given up is given up too."""
        g.subs.discard(sub)
        if g.subs or self.groups.get((g.key, g.end, g.channel.kind)) is not g:
            return False
        if g.waiter is not None and g.waiter.rev:
            background(leave_rpc(self.root, g.channel, g.waiter))
        del self.groups[(g.key, g.end, g.channel.kind)]
        self.by_id.pop(g.id, None)
        return True


def watch_range(root: bytes, channel: Channel) -> tuple[bytes, bytes]:
    """(key, range_end) watched for a channel: a lock key's permit is freed by the
    deletion of its etcd key (the range holds every permit of the lock key), and its
    grants and published values are puts there (an observer's ``"leader"`` channel);
    a claim is freed by a change of its record or the end of its lease marker (its
    steps, beside them, are not watched: a step write frees nothing)."""
    if channel.kind != "claim":
        name = K.lock_name(root, channel.ns, channel.key)
        return name, K.lock_end(name)
    return K.claim_watch_range(K.claim_names(root, channel.ns, channel.key))


def quiet_key(channel: Channel, end: bytes) -> bytes | None:
    """The key of a watched range whose puts wake nobody: a claim's lease marker,
    renewed by extend and by every step (the claim is freed by a change of its record
    or by the marker's deletion), so a step written wakes no waiter for the claim."""
    return end[:-1] if channel.kind == "claim" else None


def wakes(quiet: bytes | None, events: Any) -> bool:
    """Whether a watch reply's ``events`` wake its waiters: any of them but a put of
    the range's ``quiet`` key."""
    if quiet is None:
        return bool(events)
    return any(ev.type != PUT or ev.kv.key != quiet for ev in events)


def leave_rpc(root: bytes, channel: Channel, waiter: Waiter) -> Rpc:
    """Give up this process's place in a lock's queue (sent in the background)."""
    key = K.queue_prefix(root, channel.ns, channel.key) + waiter.wid
    waiter.rev = 0
    return Rpc("DeleteRange", pb.DeleteRangeRequest(key=key), background=True)
