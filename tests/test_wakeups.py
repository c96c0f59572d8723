"""The listeners' state machine (``idemlock._core.wakeups``), without a server: each
test feeds it events and checks what it asks the driver to do."""

from __future__ import annotations

import itertools

from idemlock._core.wakeups import EVERYONE, OBSERVERS, Command, Wakeups


def machine(**kw: object) -> Wakeups[bytes, str]:
    ids = (f"g{i}".encode() for i in itertools.count())
    opts: dict[str, object] = {"linger": 2.0, "defer": 0.01, "new_gid": lambda: next(ids)}
    opts.update(kw)
    return Wakeups(**opts)  # type: ignore[arg-type]


def connected(**kw: object) -> Wakeups[bytes, str]:
    w = machine(**kw)
    assert w.on_connect().commands == []
    return w


def test_the_first_waiter_subscribes_and_the_others_share_it() -> None:
    w = connected()
    assert w.subscribe(b"c", "a") == [Command("subscribe", (b"c",))]
    assert w.subscribe(b"c", "b") == []  # counted, not subscribed again
    assert not w.confirmed(b"c")
    assert w.on_confirm("subscribe", b"c") is True
    assert w.confirmed(b"c")
    assert sorted(w.on_message(b"c", EVERYONE, 0.0)) == ["a", "b"]


def test_a_waiter_leaving_keeps_the_channel_while_others_wait() -> None:
    w = connected()
    w.subscribe(b"c", "a")
    w.subscribe(b"c", "b")
    w.on_confirm("subscribe", b"c")
    w.unsubscribe(b"c", "a", 0.0)
    assert w.on_message(b"c", EVERYONE, 0.0) == ["b"]
    assert w.tick(100.0).commands == []  # b still waits: no UNSUBSCRIBE ever
    assert w.unsubscribe(b"c", "a", 0.0) is None  # leaving twice is harmless


def test_confirmations_are_matched_in_wire_order() -> None:
    # A channel given up and waited on again before the UNSUBSCRIBE was answered: the
    # late "unsubscribe" reply must not confirm the new subscription, the "subscribe"
    # reply after it does.
    w = connected()
    w.subscribe(b"c", "a")
    w.on_confirm("subscribe", b"c")
    w.unsubscribe(b"c", "a", 0.0)
    assert w.tick(2.0).commands == [Command("unsubscribe", (b"c",))]
    assert w.subscribe(b"c", "b") == [Command("subscribe", (b"c",))]
    assert w.on_confirm("unsubscribe", b"c") is False
    assert not w.confirmed(b"c")
    assert w.on_confirm("subscribe", b"c") is True
    assert w.confirmed(b"c")


def test_a_subscribe_reply_for_an_unsubscribe_confirms_nothing() -> None:
    # A SUBSCRIBE that raced ahead of an earlier UNSUBSCRIBE on the wire would be
    # answered in its order; what was queued first is answered first.
    w = connected()
    w.subscribe(b"c", "a")
    w.on_confirm("subscribe", b"c")
    w.unsubscribe(b"c", "a", 0.0)
    w.tick(5.0)
    w.subscribe(b"c", "b")
    assert w.on_confirm("subscribe", b"c") is False  # answers the UNSUBSCRIBE slot
    assert w.on_confirm("subscribe", b"c") is True


def test_the_waiter_id_filter_and_deferred_wakes() -> None:
    w = connected(defer=0.5)
    w.subscribe(b"c", "a")
    gid = w.waiting(b"c").gid  # type: ignore[union-attr]
    assert w.on_message(b"c", gid, 0.0) == ["a"]  # handed to this process
    assert w.on_message(b"c", b"someone else", 1.0) == []  # deferred
    assert w.tick(1.2).wakes == [] and w.tick(1.2).deadline == 1.5
    assert w.tick(1.5).wakes == ["a"]
    assert w.tick(1.6).wakes == []  # fired once


def test_a_newer_notification_postpones_or_replaces_a_deferred_wake() -> None:
    w = connected(defer=0.5)
    w.subscribe(b"c", "a")
    gid = w.waiting(b"c").gid  # type: ignore[union-attr]
    w.on_message(b"c", b"other", 0.0)
    w.on_message(b"c", b"other", 0.4)  # a newer hand-off to another process
    assert w.tick(0.5).wakes == [] and w.tick(0.5).deadline == 0.9
    assert w.on_message(b"c", gid, 0.6) == ["a"]  # then to us: woken now, not again
    assert w.tick(1.0).wakes == []


def test_observers_wake_on_every_change_and_waiters_sleep_through_a_value() -> None:
    w = connected(defer=0.5)
    assert w.subscribe(b"c", "waiter") != []
    assert w.subscribe(b"c", "observer", observer=True) == []  # shares the SUBSCRIBE
    g = w.waiting(b"c")
    assert g is not None
    gid = g.gid
    assert w.on_message(b"c", OBSERVERS, 0.0) == ["observer"]  # a value published
    assert w.tick(1.0).wakes == [] and w.deferred(b"c") is None  # the waiter sleeps on
    assert sorted(w.on_message(b"c", EVERYONE, 1.0)) == ["observer", "waiter"]
    assert w.on_message(b"c", b"another process", 2.0) == ["observer"]  # sees it now
    assert w.deferred(b"c") == 2.5  # and the waiter later, if that one does not take it
    assert sorted(w.tick(2.5).wakes) == ["observer", "waiter"]
    assert sorted(w.on_message(b"c", gid, 3.0)) == ["observer", "waiter"]
    w.unsubscribe(b"c", "observer", 3.0)
    assert w.on_message(b"c", OBSERVERS, 3.1) == []
    w.unsubscribe(b"c", "waiter", 3.2)
    assert w.subscribe(b"c", "again", observer=True) == []  # the channel lingered
    assert w.on_message(b"c", OBSERVERS, 3.3) == ["again"]


def test_observers_alone_are_no_waiters_and_keep_no_registration() -> None:
    w = connected()
    w.subscribe(b"c", "observer", observer=True)
    assert w.waiting(b"c") is None  # a refused acquire queues nobody for it
    w.subscribe(b"c", "waiter")
    g = w.waiting(b"c")
    assert g is not None
    g.registered = True
    # the last waiter leaves while the observer stays: the registration goes
    assert w.unsubscribe(b"c", "waiter", 0.0) == g.gid and not g.registered
    assert w.waiting(b"c") is None and w.group(b"c") is g and w.has_waiters()
    assert w.unsubscribe(b"c", "observer", 0.0) is None


def test_every_process_has_its_own_waiter_id() -> None:
    w = connected()
    w.subscribe(b"x", "a")
    w.subscribe(b"y", "b")
    gx, gy = w.waiting(b"x"), w.waiting(b"y")
    assert gx is not None and gy is not None and gx.gid != gy.gid
    assert w.on_message(b"x", gy.gid, 0.0) == []


def test_no_filter_without_a_payload() -> None:
    w = connected(new_gid=None)
    w.subscribe("chan", "a")  # type: ignore[arg-type]
    assert w.on_message("chan", None, 0.0) == ["a"]  # type: ignore[arg-type]


def test_messages_for_channels_nobody_waits_on_wake_nobody() -> None:
    w = connected()
    assert w.on_message(b"c", EVERYONE, 0.0) == []
    w.subscribe(b"c", "a")
    w.unsubscribe(b"c", "a", 0.0)
    assert w.on_message(b"c", EVERYONE, 0.1) == []  # lingering, without waiters


def test_linger_then_unsubscribe() -> None:
    w = connected(linger=2.0)
    w.subscribe(b"c", "a")
    w.on_confirm("subscribe", b"c")
    w.unsubscribe(b"c", "a", 10.0)
    t = w.tick(11.0)
    assert t.commands == [] and t.deadline == 12.0
    # Waiting again within the linger costs no round trip.
    assert w.subscribe(b"c", "b") == []
    assert w.confirmed(b"c")
    w.unsubscribe(b"c", "b", 11.5)
    assert w.tick(13.0).deadline == 13.5
    assert w.tick(13.5).commands == [Command("unsubscribe", (b"c",))]
    assert not w.confirmed(b"c") and w.tick(20.0).deadline is None


def test_a_lingering_channel_keeps_its_group_and_waiter_id() -> None:
    w = connected(linger=2.0)
    assert w.group(b"c") is None
    w.subscribe(b"c", "a")
    g = w.group(b"c")
    assert g is not None and g is w.waiting(b"c") and g.gid == b"g0"
    w.unsubscribe(b"c", "a", 10.0)
    # No waiter any more, but the channel lingers with the same group (and id).
    assert w.waiting(b"c") is None and w.group(b"c") is g
    assert w.tick(12.0).commands == [Command("unsubscribe", (b"c",))]
    assert w.group(b"c") is None


def test_linger_given_per_call() -> None:
    w = connected(linger=2.0)
    w.subscribe(b"c", "a")
    w.unsubscribe(b"c", "a", 0.0, linger=0.3)
    assert w.tick(0.3).commands == [Command("unsubscribe", (b"c",))]


def test_at_most_max_lingering_channels_linger_oldest_first() -> None:
    w = connected(max_lingering=2)
    for i, ch in enumerate((b"a", b"b", b"c")):
        w.subscribe(ch, "s" + str(i))
        w.on_confirm("subscribe", ch)
        w.unsubscribe(ch, "s" + str(i), float(i))
    t = w.tick(2.5)
    assert t.commands == [Command("unsubscribe", (b"a",))]
    assert w.confirmed(b"b") and w.confirmed(b"c")


def test_unsubscribing_reports_a_registered_waiter_id() -> None:
    w = connected()
    w.subscribe(b"c", "a")
    g = w.waiting(b"c")
    assert g is not None
    g.registered = True  # the store has this process queued for the lock
    assert w.unsubscribe(b"c", "a", 0.0) == g.gid  # to unregister
    w.subscribe(b"c", "b")
    assert w.unsubscribe(b"c", "b", 0.0) is None  # registration already given back


def test_a_disconnect_wakes_everyone_and_forgets_lingering_channels() -> None:
    w = connected()
    w.subscribe(b"c", "a")
    w.subscribe(b"d", "b")
    w.on_confirm("subscribe", b"c")
    w.on_confirm("subscribe", b"d")
    w.unsubscribe(b"d", "b", 0.0)
    w.on_message(b"c", b"other", 0.0)  # a deferred wake: moot once everyone is woken
    assert w.on_disconnect() == ["a"]
    assert not w.confirmed(b"c") and w.waiting(b"c") is not None
    assert w.tick(10.0).commands == [] and w.tick(10.0).wakes == []
    # New waiters while away subscribe with the next connection.
    assert w.subscribe(b"e", "e") == []
    up = w.on_connect()
    assert sorted(up.wakes) == ["a", "e"]  # something may have been missed
    assert [sorted(c.channels) for c in up.commands] == [[b"c", b"e"]]
    assert w.on_confirm("subscribe", b"c") and w.on_confirm("subscribe", b"e")
    assert w.confirmed(b"c") and not w.confirmed(b"d")


def test_confirmations_expected_on_a_lost_connection_are_forgotten() -> None:
    w = connected()
    w.subscribe(b"c", "a")
    w.on_disconnect()
    w.on_connect()
    # Only the new connection's SUBSCRIBE is outstanding: one reply confirms it.
    assert w.on_confirm("subscribe", b"c") is True
    assert w.on_confirm("subscribe", b"c") is False


def test_the_first_connection_wakes_nobody() -> None:
    w = machine()
    assert w.subscribe(b"c", "a") == []  # not connected yet
    up = w.on_connect()
    assert up.wakes == [] and up.commands == [Command("subscribe", (b"c",))]


def test_a_failed_subscribe_leaves_nothing_behind() -> None:
    w = machine()
    w.subscribe(b"c", "a")
    w.discard(b"c", "a")
    assert w.waiting(b"c") is None and not w.has_waiters()
    assert w.on_connect().commands == []


def test_close_wakes_everyone_and_forgets_all() -> None:
    w = connected()
    w.subscribe(b"c", "a")
    w.subscribe(b"d", "b")
    assert sorted(w.close()) == ["a", "b"]
    assert not w.has_waiters() and not w.confirmed(b"c")
    assert w.unsubscribe(b"c", "a", 0.0) is None


def test_a_mailbox_whose_event_loop_closed_does_not_stop_the_others() -> None:
    # A waiter whose loop ended mid-wait (never resumed) must not keep the reader
    # from waking the other waiters of the channel.
    import asyncio

    from idemlock.stores._local import LocalHub

    hub = LocalHub()
    dead, live = hub.subscribe("k"), hub.subscribe("k")
    loop = asyncio.new_event_loop()
    task = loop.create_task(dead.wait_async(60))
    loop.run_until_complete(asyncio.sleep(0))  # the task now waits on its future
    loop.close()  # without finishing it
    hub.notify("k")
    assert live.wait(0) is True
    assert dead.wait(0) is True  # its flag is kept all the same
    del task
