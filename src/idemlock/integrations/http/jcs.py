"""RFC 8785 JSON Canonicalization Scheme (JCS): the one byte string of a JSON value.

Objects are written with their members sorted by the UTF-16 code units of their names,
no whitespace, strings with the fewest escapes (only ``"``, ``\\``, and the control
characters, as ``\\b \\f \\n \\r \\t`` or ``\\u00xx``), and every number as the IEEE 754
double it denotes, printed as ECMAScript's ``Number.prototype.toString`` prints it
(``1200``, ``1200.0`` and ``1.2e3`` are all ``1200``; ``1e21`` is ``1e+21``). The result is
UTF-8. Any language's JCS library gives the same bytes for the same JSON data.

A value outside I-JSON (RFC 7493) has no JCS form: NaN or an infinity, an integer that
no double holds exactly, a string with a lone surrogate, a member name given twice.
:func:`canonical` answers None for it; :func:`loads` parses text keeping duplicates
detectable.
"""

from __future__ import annotations

import json
import math
from typing import Any

__all__ = ["canonical", "loads", "number"]

#: Python's own JSON string writer (C when available): its escapes are JCS's
_string = json.encoder.encode_basestring

_SAFE_INT = 2**53


class _NotIJson(Exception):
    """The value has no RFC 8785 form."""


class _Duplicates(dict[str, Any]):
    """An object whose text named a member twice (I-JSON forbids it)."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    return obj if len(obj) == len(pairs) else _Duplicates(obj)


def loads(text: bytes | str) -> Any:
    """``json.loads``, except that an object with a repeated member name comes back
    marked, so :func:`canonical` refuses it."""
    return json.loads(text, object_pairs_hook=_pairs)


def number(x: float) -> str:
    """A finite double as ECMAScript writes it (ECMA-262 Number::toString, RFC 8785
    section 3.2.2.3). ``repr`` gives the shortest digits that read back as ``x``, as
    ECMAScript chooses them; only the layout differs."""
    if not math.isfinite(x):
        raise _NotIJson("NaN and the infinities have no JSON form")
    if x == 0:
        return "0"  # -0 too
    sign = "-" if x < 0 else ""
    mantissa, _, exp = repr(abs(x)).partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = (whole + fraction).lstrip("0")
    stripped = digits.rstrip("0")
    k = len(stripped)
    # x = stripped * 10**(n - k): n is where the decimal point falls in the digits
    n = k + (len(digits) - k) - len(fraction) + (int(exp) if exp else 0)
    if k <= n <= 21:
        text = stripped + "0" * (n - k)
    elif 0 < n <= 21:
        text = stripped[:n] + "." + stripped[n:]
    elif -6 < n <= 0:
        text = "0." + "0" * -n + stripped
    else:
        e = n - 1
        head = stripped if k == 1 else stripped[0] + "." + stripped[1:]
        text = f"{head}e{'+' if e >= 0 else '-'}{abs(e)}"
    return sign + text


def _write(value: Any, out: list[str]) -> None:
    if value is None:
        out.append("null")
    elif value is True:
        out.append("true")
    elif value is False:
        out.append("false")
    elif isinstance(value, str):
        out.append(_string(value))
    elif isinstance(value, int):
        if -_SAFE_INT <= value <= _SAFE_INT:
            out.append(str(value))
        else:
            try:
                as_double = float(value)
            except OverflowError:
                raise _NotIJson("an integer beyond any double") from None
            if as_double != value:
                raise _NotIJson("an integer no double holds exactly")
            out.append(number(as_double))
    elif isinstance(value, float):
        out.append(number(value))
    elif isinstance(value, (list, tuple)):
        out.append("[")
        for i, item in enumerate(value):
            if i:
                out.append(",")
            _write(item, out)
        out.append("]")
    elif isinstance(value, dict):
        if isinstance(value, _Duplicates):
            raise _NotIJson("a member name given twice")
        names = list(value)
        if not all(isinstance(name, str) for name in names):
            raise _NotIJson("a member name that is not a string")
        names.sort(key=lambda name: name.encode("utf-16-be", "surrogatepass"))
        out.append("{")
        for i, name in enumerate(names):
            if i:
                out.append(",")
            out.append(_string(name))
            out.append(":")
            _write(value[name], out)
        out.append("}")
    else:
        raise _NotIJson(f"a {type(value).__name__} is not JSON data")


def canonical(value: Any) -> bytes | None:
    """The RFC 8785 bytes of ``value`` (JSON data: dict, list, str, int, float, bool,
    None), or None when it has none (see the module's note)."""
    out: list[str] = []
    try:
        _write(value, out)
        return "".join(out).encode("utf-8")  # a lone surrogate fails here
    except (_NotIJson, UnicodeEncodeError, RecursionError):
        return None
