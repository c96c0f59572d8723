"""The stores' shared fork registry (``idemlock.stores._forks``): in a forked child each
registry tells its live objects, registries in the order they were made."""

from __future__ import annotations

import gc
import os

from idemlock.stores._forks import ForkRegistry

from .servers._proc import waitpid


class _Obj:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name = name
        self.calls = calls


def test_a_forked_child_runs_each_registry_in_order_on_its_live_objects() -> None:
    calls: list[str] = []
    first: ForkRegistry[_Obj] = ForkRegistry(lambda o: o.calls.append("first " + o.name))
    second: ForkRegistry[_Obj] = ForkRegistry(lambda o: o.calls.append("second " + o.name))
    a, gone, dropped = _Obj("a", calls), _Obj("gone", calls), _Obj("dropped", calls)
    second.add(a)
    first.add(a)
    first.add(gone)
    first.add(dropped)
    first.discard(dropped)
    del gone
    gc.collect()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what ran, and leave without pytest's cleanup
        os.close(r)
        os.write(w, "|".join(calls).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        child = f.read().decode()
    assert waitpid(pid)[1] == 0
    assert child == "first a|second a"
    assert calls == []  # the parent's objects are untouched
