"""Typed results: turn a value into JSON data by its declared type, and back.

The wrap reads the function's return annotation; on replay the declared type is
restored: dataclasses, ``datetime``/``date``/``time``/``UUID``/``Decimal``, ``bytes``,
enums, ``list``/``tuple``/``dict``/``set``/``frozenset`` of those, ``X | None``,
pydantic models and msgspec structs (imported only when such a type is declared).
Nothing is ever imported by name from stored data: the type comes from the code.
"""

from __future__ import annotations

import dataclasses
import enum
import sys
import types
import typing
from collections.abc import Callable
from datetime import date, datetime, time
from typing import Any

Loader = Callable[[Any], Any]
Dumper = Callable[[Any], Any]

_NONE = type(None)


class TypedError(TypeError):
    """The value does not fit its declared type (raised while encoding or decoding)."""


def _is_pydantic(tp: Any) -> bool:
    return isinstance(tp, type) and hasattr(tp, "model_validate") and hasattr(tp, "model_dump")


def _is_msgspec(tp: Any) -> bool:
    return isinstance(tp, type) and hasattr(tp, "__struct_fields__") and "msgspec" in sys.modules


def _fail(what: str, value: Any, tp: Any) -> TypedError:
    name = getattr(tp, "__name__", repr(tp))
    return TypedError(
        f"{what}: {type(value).__name__} value {value!r:.80} for declared type {name}"
    )


def dumper(tp: Any) -> Dumper:
    """A function turning a value of type ``tp`` into JSON data."""
    return _build(tp, dump=True)


def loader(tp: Any) -> Loader:
    """A function turning JSON data back into a value of type ``tp``."""
    return _build(tp, dump=False)


def _build(tp: Any, dump: bool) -> Callable[[Any], Any]:
    if tp is Any or tp is object:
        return _plain
    if tp is None or tp is _NONE:

        def none(v: Any) -> Any:
            if v is not None:
                raise _fail("expected None", v, tp)
            return None

        return none
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in args if a is not _NONE]
        if len(arms) == 1 and len(args) == 2:
            inner = _build(arms[0], dump)
            return lambda v: None if v is None else inner(v)
        # A general union has no tag in JSON: keep plain JSON values only.
        return _plain
    if origin in (list, set, frozenset) or tp in (list, set, frozenset):
        item = _build(args[0], dump) if args else _plain
        container = origin or tp
        if dump:

            def seq_dump(v: Any) -> Any:
                if not isinstance(v, container):
                    raise _fail("expected a " + container.__name__, v, tp)
                items = [item(x) for x in v]
                return items if container is list else sorted(items, key=repr)

            return seq_dump
        return lambda v: container(item(x) for x in _expect(v, list, tp))
    if origin is tuple or tp is tuple:
        if args and len(args) == 2 and args[1] is Ellipsis:
            item = _build(args[0], dump)
            if dump:
                return lambda v: [item(x) for x in _expect(v, tuple, tp)]
            return lambda v: tuple(item(x) for x in _expect(v, list, tp))
        if args:
            parts = [_build(a, dump) for a in args]

            def fixed(v: Any) -> Any:
                seq = _expect(v, tuple if dump else list, tp)
                if len(seq) != len(parts):
                    raise _fail(f"expected {len(parts)} items", v, tp)
                out = [f(x) for f, x in zip(parts, seq, strict=True)]
                return out if dump else tuple(out)

            return fixed
        if dump:
            return lambda v: [_plain(x) for x in _expect(v, tuple, tp)]
        return lambda v: tuple(_expect(v, list, tp))
    if origin is dict or tp is dict:
        kt, vt = args if args else (str, Any)
        if kt is not str:
            raise TypedError(f"dict keys must be str to store as JSON, declared {tp!r}")
        val = _build(vt, dump)
        return lambda v: {_expect(k, str, tp): val(x) for k, x in _expect(v, dict, tp).items()}
    if isinstance(tp, type):
        return _build_class(tp, dump)
    if isinstance(tp, typing.TypeVar) or origin is typing.Literal or tp is typing.Literal:
        return _plain
    raise TypedError(f"cannot store results of declared type {tp!r}; declare a JSON-like type")


def _build_class(tp: type, dump: bool) -> Callable[[Any], Any]:
    if tp is bool:
        return lambda v: _expect(v, bool, tp)
    if tp is int:
        return lambda v: _int(v, tp)
    if tp is float:
        return (lambda v: _float(v, tp)) if dump else (lambda v: float(_number(v, tp)))
    if tp is str:
        return lambda v: _expect(v, str, tp)
    if issubclass(tp, enum.Enum):
        if dump:
            return lambda v: _expect(v, tp, tp).value
        return lambda v: tp(v)
    if tp is datetime:
        if dump:
            return lambda v: _expect(v, datetime, tp).isoformat()
        return lambda v: datetime.fromisoformat(_expect(v, str, tp))
    if tp is date:
        if dump:
            return lambda v: _exact(v, date, tp).isoformat()
        return lambda v: date.fromisoformat(_expect(v, str, tp))
    if tp is time:
        if dump:
            return lambda v: _expect(v, time, tp).isoformat()
        return lambda v: time.fromisoformat(_expect(v, str, tp))
    # uuid and decimal are imported for the types that need them only (a declared
    # UUID or Decimal has its module loaded already), so `import idemlock` stays light.
    module = getattr(tp, "__module__", None)
    if module == "uuid":
        import uuid

        if tp is uuid.UUID:
            if dump:
                return lambda v: str(_expect(v, uuid.UUID, tp))
            return lambda v: uuid.UUID(_expect(v, str, tp))
    if module == "decimal":
        from decimal import Decimal

        if tp is Decimal:
            if dump:
                return lambda v: str(_expect(v, Decimal, tp))
            return lambda v: Decimal(_expect(v, str, tp))
    if tp in (bytes, bytearray):
        import base64

        if dump:
            return lambda v: base64.b64encode(_expect(v, (bytes, bytearray), tp)).decode("ascii")
        return lambda v: tp(base64.b64decode(_expect(v, str, tp), validate=True))
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        fields = list(dataclasses.fields(tp))
        if dump:

            def dc_dump(v: Any) -> Any:
                if type(v) is not tp:
                    raise _fail("expected exactly", v, tp)
                return {f.name: _build(hints[f.name], True)(getattr(v, f.name)) for f in fields}

            return dc_dump

        def dc_load(v: Any) -> Any:
            data = _expect(v, dict, tp)
            init = {f.name: _build(hints[f.name], False)(data[f.name]) for f in fields if f.init}
            obj = tp(**init)
            for f in fields:
                if not f.init:
                    object.__setattr__(obj, f.name, _build(hints[f.name], False)(data[f.name]))
            return obj

        return dc_load
    if _is_pydantic(tp):
        if dump:
            return lambda v: _expect(v, tp, tp).model_dump(mode="json")
        return lambda v: tp.model_validate(v)  # type: ignore[attr-defined]
    if _is_msgspec(tp):
        import msgspec

        if dump:
            return lambda v: msgspec.to_builtins(_expect(v, tp, tp))
        return lambda v: msgspec.convert(v, tp)
    if tp in (dict, list):
        return _plain
    raise TypedError(
        f"cannot store results of declared type {tp.__qualname__}; use a dataclass, a "
        "pydantic model, a msgspec struct or JSON-like data"
    )


def _expect(v: Any, kind: Any, tp: Any) -> Any:
    if not isinstance(v, kind):
        raise _fail("wrong type", v, tp)
    return v


def _exact(v: Any, kind: type, tp: Any) -> Any:
    if type(v) is not kind:
        raise _fail("wrong type", v, tp)
    return v


def _int(v: Any, tp: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _fail("expected an int", v, tp)
    return int(v)


def _number(v: Any, tp: Any) -> float | int:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _fail("expected a number", v, tp)
    return v


def _float(v: Any, tp: Any) -> float:
    return float(_number(v, tp))


def _plain(v: Any) -> Any:
    # Undeclared types pass as they are; the round-trip check catches what JSON loses.
    return v
