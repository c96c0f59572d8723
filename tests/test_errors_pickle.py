"""Every IdemlockError pickles back to an equal error (issue 10, item 18).

The subclasses are discovered (every module of the package is imported, then the
class tree is walked), not listed by hand, so a new error class is covered the day
it is written. Instances are built from each constructor's signature.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import inspect
import multiprocessing
import pickle
import pkgutil
from datetime import datetime, timezone
from typing import Any

import pytest

import idemlock
from idemlock import FencedOut, IdemlockError, InFlightError, PayloadMismatch

WHEN = datetime(2030, 1, 2, 3, 4, 5, 600000, tzinfo=timezone.utc)


def _import_everything() -> None:
    for info in pkgutil.walk_packages(idemlock.__path__, "idemlock."):
        try:
            importlib.import_module(info.name)
        except ImportError:  # an optional driver that is not installed
            continue


def _all_subclasses(root: type) -> list[type]:
    seen: dict[type, None] = {}
    todo = [root]
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen[cls] = None
        todo.extend(cls.__subclasses__())
    return sorted(seen, key=lambda c: f"{c.__module__}.{c.__qualname__}")


_import_everything()
ERRORS = [c for c in _all_subclasses(IdemlockError) if c.__module__.startswith("idemlock")]


def _value_for(param: inspect.Parameter) -> Any:
    """A plausible argument for one constructor parameter, from its annotation."""
    note = str(param.annotation)
    if "datetime" in note:
        return WHEN
    if "int" in note and "str" not in note:
        return 2**63 - 1
    if "float" in note:
        return 1.5
    if "bool" in note:
        return True
    return f"{param.name}-value"


def _instances(cls: type[IdemlockError]) -> list[IdemlockError]:
    """One instance with every parameter given, and one with only the required ones."""
    params = [
        p
        for p in inspect.signature(cls.__init__).parameters.values()
        if p.name != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    var_args = any(
        p.kind is p.VAR_POSITIONAL for p in inspect.signature(cls.__init__).parameters.values()
    )
    if not params:
        # A plain Exception signature (*args): a message, as idemlock raises them.
        return [cls(f"{cls.__name__}: something went wrong; do this instead")]
    full = {p.name: _value_for(p) for p in params}
    required = {p.name: full[p.name] for p in params if p.default is inspect.Parameter.empty}
    out = [cls(**full), cls(**required)]
    if var_args:  # pragma: no cover - none today
        out.append(cls("extra"))
    return out


def _same(a: BaseException, b: BaseException) -> None:
    assert type(a) is type(b)
    assert str(a) == str(b)
    assert a.args == b.args
    assert vars(a) == vars(b)


def test_discovery_finds_the_whole_tree() -> None:
    names = {c.__name__ for c in ERRORS}
    # Sanity: the walk reaches classes of _errors and of other modules.
    assert {"FencedOut", "InFlightError", "PayloadMismatch", "StoreCorrupt", "SealError"} <= names
    assert {c.__name__ for c in ERRORS if c.__module__ != "idemlock._errors"}
    assert set(idemlock._errors.__all__) <= names


@pytest.mark.parametrize("cls", ERRORS, ids=lambda c: c.__qualname__)
def test_every_error_round_trips_through_pickle(cls: type[IdemlockError]) -> None:
    for err in _instances(cls):
        for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
            back = pickle.loads(pickle.dumps(err, protocol))
            _same(err, back)
        # A note added on the way (add_note, Python 3.11+) travels too.
        vars(err)["__notes__"] = ["while doing X"]
        _same(err, pickle.loads(pickle.dumps(err)))


def test_attributes_survive() -> None:
    err = FencedOut("ledger", 7, 9)
    back = pickle.loads(pickle.dumps(err))
    assert (back.resource, back.token, back.current) == ("ledger", 7, 9)
    busy = pickle.loads(pickle.dumps(InFlightError("k", WHEN)))
    assert busy.key == "k" and busy.expires_at == WHEN
    mismatch = PayloadMismatch("k")
    back_m = pickle.loads(pickle.dumps(mismatch))
    assert str(back_m) == str(mismatch)  # not wrapped a second time
    assert str(back_m).count("idempotency key") == 1
    assert back_m.key == "k"


def _raise(name: str) -> None:
    """Runs in a worker process: raise one error of each kind with attributes."""
    if name == "fenced":
        raise FencedOut("ledger", 7, 9)
    if name == "busy":
        raise InFlightError("job-1", WHEN)
    raise PayloadMismatch("job-2")


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_errors_cross_a_process_pool(start: str) -> None:
    ctx = multiprocessing.get_context(start)
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        try:
            pool.submit(_raise, "fenced").result(timeout=60)
        except FencedOut as exc:  # the point: except FencedOut matches after the trip
            assert (exc.resource, exc.token, exc.current) == ("ledger", 7, 9)
            _same(exc, FencedOut("ledger", 7, 9))
        else:  # pragma: no cover
            pytest.fail("the worker's FencedOut did not come back as FencedOut")
        with pytest.raises(InFlightError) as busy:
            pool.submit(_raise, "busy").result(timeout=60)
        _same(busy.value, InFlightError("job-1", WHEN))
        with pytest.raises(PayloadMismatch) as mismatch:
            pool.submit(_raise, "job").result(timeout=60)
        _same(mismatch.value, PayloadMismatch("job-2"))


def test_errors_cross_multiprocessing_pool() -> None:
    with multiprocessing.get_context("spawn").Pool(1) as pool, pytest.raises(FencedOut) as info:
        pool.apply(_raise, ("fenced",))
    assert info.value.current == 9


def test_in_flight_context_shapes_the_message_not_the_attributes() -> None:
    err = InFlightError("k", WHEN, waited=30.0, wait_with="port.run(key, wait=seconds)")
    assert "after a wait of 30s" in str(err) and "port.run(key, wait=seconds)" in str(err)
    assert vars(err) == {"key": "k", "expires_at": WHEN}
    _same(err, pickle.loads(pickle.dumps(err)))
