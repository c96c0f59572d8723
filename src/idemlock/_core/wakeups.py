"""Waiting for notifications, without I/O: the state machine every listener shares.

A store's listener keeps one connection that subscribes to a channel per waited-on
key and wakes the local waiters of a channel when a notification arrives. What it
must remember is the same for Redis pub/sub and PostgreSQL LISTEN/NOTIFY, and lives
here, apart from sockets, threads, tasks and clocks (``now`` is always passed in):

- **Reference counts.** A channel is subscribed once however many local waiters it
  has (a *group*); the first waiter asks for the SUBSCRIBE.
- **Ordered confirmations.** Subscribe and unsubscribe confirmations come back in
  the order the commands were sent; each channel keeps a queue of what it expects,
  so a late "unsubscribe" reply never confirms a newer subscription.
- **The waiter-id filter.** A lock release may name the one process it hands the
  lock to (its waiter id, ``gid``). The other processes' waiters are woken only
  ``defer`` seconds later, and only if no newer notification came (the chosen one
  may have died).
- **Observers.** An election's observer subscribes to the key's lock channel as an
  *observer*: woken by every notification there, and alone woken by ``OBSERVERS``
  (a value published), which waiters, who wait for a free permit, sleep through.
- **Linger.** A channel stays subscribed ``linger`` seconds after its last waiter
  left, so waiting on the same key again costs no round trip; at most
  ``max_lingering`` channels linger (the oldest are given up first).
- **Reconnects.** A lost connection wakes every waiter (a notification may have been
  missed) and forgets lingering channels; the next connection subscribes every
  group again and wakes every waiter once more.

Drivers call these methods with their own lock held (or on their one event loop),
perform the returned commands in the order returned, and fire the returned
subscribers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

K = TypeVar("K", bound=Hashable)  # a channel name (bytes for Redis, str for PostgreSQL)
S = TypeVar("S", bound=Hashable)  # a subscriber: the driver's mailbox object

#: the payload of a notification meant for every process
EVERYONE = b"*"
#: the payload of a notification meant for observers only: a grant or renew published
#: a value (an election's term began or its value changed); waiters stay asleep
OBSERVERS = b"!"


@dataclass(frozen=True, slots=True)
class Command(Generic[K]):
    """Something to send on the connection: SUBSCRIBE/LISTEN or UNSUBSCRIBE/UNLISTEN."""

    verb: Literal["subscribe", "unsubscribe"]
    channels: tuple[K, ...]


@dataclass(slots=True)
class Tick(Generic[K, S]):
    """What is due at a moment: subscribers to wake, commands to send, and when to
    call ``tick`` next (None: nothing is pending)."""

    wakes: list[S] = field(default_factory=list)
    commands: list[Command[K]] = field(default_factory=list)
    deadline: float | None = None


class Group(Generic[K, S]):
    """This process's subscription to one channel."""

    __slots__ = ("channel", "confirmed", "gid", "observers", "registered", "subs")

    def __init__(self, channel: K, gid: bytes) -> None:
        self.channel = channel
        self.subs: set[S] = set()
        #: the subscribers among ``subs`` that observe rather than wait
        self.observers: set[S] = set()
        #: the server confirmed the subscription on the current connection
        self.confirmed = False
        #: this process's waiter id for the channel's key, and whether the store has
        #: it registered (set by the driver after a refused lock attempt)
        self.gid = gid
        self.registered = False


class Wakeups(Generic[K, S]):
    """The listener's state: groups, expected confirmations, deferred wakes, lingering
    channels and the connection's up/down state."""

    def __init__(
        self,
        *,
        linger: float,
        defer: float = 0.0,
        max_lingering: int | None = None,
        new_gid: Callable[[], bytes] | None = None,
    ) -> None:
        self.linger = linger
        self.defer = defer
        self.max_lingering = max_lingering
        self._new_gid = new_gid
        self._groups: dict[K, Group[K, S]] = {}
        # Per channel, what its next confirmations answer, in wire order: the group a
        # SUBSCRIBE was sent for, or None for an UNSUBSCRIBE.
        self._pending: dict[K, deque[Group[K, S] | None]] = {}
        self._deferred: dict[K, float] = {}  # channel -> when to wake its waiters
        self._idle: dict[K, float] = {}  # channel without waiters -> when to give it up
        self.connected = False
        # A connection was lost since the last one came up: waiters may have missed
        # a notification, so the next connection wakes them.
        self._lost = False

    # ---- queries -----------------------------------------------------------------------

    def waiting(self, channel: K) -> Group[K, S] | None:
        """The group of ``channel`` if a local waiter waits on it: observers alone are
        no waiters (a refused acquire then queues no waiter id, so no release keeps
        the lock for a process where nobody waits for it)."""
        g = self._groups.get(channel)
        return g if g is not None and len(g.subs) > len(g.observers) else None

    def group(self, channel: K) -> Group[K, S] | None:
        """The group of ``channel`` with or without waiters: a lingering channel keeps
        its group, and with it this process's waiter id, until it is given up."""
        return self._groups.get(channel)

    def confirmed(self, channel: K) -> bool:
        """Whether ``channel`` is subscribed on the current connection."""
        g = self._groups.get(channel)
        return self.connected and g is not None and g.confirmed

    def deferred(self, channel: K) -> float | None:
        """When the waiters of ``channel`` are due to be woken for a hand-off to another
        process that they may still need (None: no such wake is pending)."""
        return self._deferred.get(channel)

    def has_waiters(self) -> bool:
        """Whether anyone, waiter or observer, needs the connection."""
        return any(g.subs for g in self._groups.values())

    def subscribers(self) -> list[S]:
        return [s for g in self._groups.values() for s in g.subs]

    # ---- waiters come and go -----------------------------------------------------------

    def subscribe(self, channel: K, sub: S, observer: bool = False) -> list[Command[K]]:
        """Add a waiter (or an ``observer``); a SUBSCRIBE to send if the channel is new
        and connected."""
        g = self._groups.get(channel)
        self._idle.pop(channel, None)
        if g is not None:
            self._add(g, sub, observer)
            return []
        g = self._groups[channel] = Group(channel, self._new_gid() if self._new_gid else b"")
        self._add(g, sub, observer)
        if not self.connected:
            return []  # the next connection subscribes every group
        return [self._subscribe_cmd([g])]

    @staticmethod
    def _add(g: Group[K, S], sub: S, observer: bool) -> None:
        g.subs.add(sub)
        if observer:
            g.observers.add(sub)

    def discard(self, channel: K, sub: S) -> None:
        """Undo a ``subscribe`` whose connection could not be opened: no linger."""
        g = self._groups.get(channel)
        if g is None:
            return
        g.subs.discard(sub)
        g.observers.discard(sub)
        if not g.subs:
            del self._groups[channel]
            self._pending.pop(channel, None)

    def unsubscribe(
        self, channel: K, sub: S, now: float, linger: float | None = None
    ) -> bytes | None:
        """Remove a waiter or observer. The channel lingers once it has none; returns
        the waiter id to unregister from the store if the store had this process
        registered and no waiter is left (observers may be)."""
        g = self._groups.get(channel)
        if g is None or sub not in g.subs:
            return None
        g.subs.discard(sub)
        g.observers.discard(sub)
        if len(g.subs) > len(g.observers):
            return None  # waiters are left
        if not g.subs:
            self._deferred.pop(channel, None)
            self._idle[channel] = now + (self.linger if linger is None else linger)
        registered, g.registered = g.registered, False
        return g.gid if registered else None

    # ---- what the connection brings ------------------------------------------------------

    def on_message(self, channel: K, payload: bytes | None, now: float) -> list[S]:
        """A notification: the subscribers to wake now. ``payload`` is the waiter id
        the lock was handed to, ``EVERYONE``, ``OBSERVERS`` or None (no filter)."""
        g = self._groups.get(channel)
        if g is None or not g.subs:
            return []
        if payload == OBSERVERS:
            return list(g.observers)
        if payload is None or payload == EVERYONE or payload == g.gid:
            self._deferred.pop(channel, None)
            return list(g.subs)
        # Handed to another process: wake our waiters only if that one does not take
        # it; observers see the change now.
        self._deferred[channel] = now + self.defer
        return list(g.observers)

    def on_confirm(self, kind: Literal["subscribe", "unsubscribe"], channel: K) -> bool:
        """A subscribe/unsubscribe confirmation; True if it confirmed a subscription."""
        q = self._pending.get(channel)
        item = q.popleft() if q else None
        if q is not None and not q:
            del self._pending[channel]
        if kind == "subscribe" and item is not None:
            item.confirmed = True
            return True
        return False

    def on_connect(self) -> Tick[K, S]:
        """A connection is up: SUBSCRIBE every group, and wake every waiter if an
        earlier connection was lost (something may have been missed meanwhile)."""
        self.connected = True
        wakes = self.subscribers() if self._lost else []
        self._lost = False
        groups = list(self._groups.values())
        return Tick(wakes, [self._subscribe_cmd(groups)] if groups else [])

    def on_disconnect(self) -> list[S]:
        """The connection is lost: forget lingering channels and what was expected,
        and wake every waiter to re-check the store."""
        self.connected = False
        self._lost = True
        self._pending.clear()
        self._deferred.clear()
        for channel in self._idle:
            self._groups.pop(channel, None)
        self._idle.clear()
        for g in self._groups.values():
            g.confirmed = False
        return self.subscribers()

    def close(self) -> list[S]:
        """The listener is closed: forget everything; every waiter wakes."""
        wakes = self.subscribers()
        self.connected = False
        self._groups.clear()
        self._pending.clear()
        self._deferred.clear()
        self._idle.clear()
        return wakes

    # ---- timers --------------------------------------------------------------------------

    def tick(self, now: float) -> Tick[K, S]:
        """Fire the deferred wakes that are due and give up the channels that lingered
        long enough (or beyond ``max_lingering``)."""
        out: Tick[K, S] = Tick()
        deadline: float | None = None
        for channel, at in list(self._deferred.items()):
            if at > now:
                deadline = at if deadline is None else min(deadline, at)
                continue
            del self._deferred[channel]
            g = self._groups.get(channel)
            if g is not None:
                out.wakes.extend(g.subs)
        idle = list(self._idle.items())
        excess = 0
        if self.max_lingering is not None and len(idle) > self.max_lingering:
            excess = len(idle) - self.max_lingering
            idle.sort(key=lambda kv: kv[1])  # the oldest go first
        gone: list[K] = []
        for i, (channel, until) in enumerate(idle):
            if i >= excess and until > now:
                deadline = until if deadline is None else min(deadline, until)
                continue
            del self._idle[channel]
            if self._groups.pop(channel, None) is not None and self.connected:
                self._pending.setdefault(channel, deque()).append(None)
                gone.append(channel)
        if gone:
            out.commands.append(Command("unsubscribe", tuple(gone)))
        out.deadline = deadline
        return out

    def _subscribe_cmd(self, groups: list[Group[K, S]]) -> Command[K]:
        for g in groups:
            self._pending.setdefault(g.channel, deque()).append(g)
        return Command("subscribe", tuple(g.channel for g in groups))
