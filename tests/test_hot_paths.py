"""Shortcuts of the hot path give the answers of the long way round.

``ResultFormat.encode`` knows plain JSON data of exact types to be faithful without
decoding it back; a dumper other than the plain one always takes the long way (decode
and compare), so the two must accept and refuse the same values.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from idemlock import ResultEncodeError
from idemlock._core.codec import ResultFormat


class _Str(str):
    pass


class _Int(int):
    pass


SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # NaN and infinity included: both ways refuse them
    | st.text()
    | st.builds(_Str, st.text(max_size=3))
    | st.builds(_Int, st.integers(-5, 5))
)
KEYS = st.text(max_size=4) | st.integers(-3, 3) | st.builds(_Str, st.text(max_size=3))
VALUES = st.recursive(
    SCALARS,
    lambda children: (
        st.lists(children, max_size=4)
        | st.tuples(children)
        | st.dictionaries(KEYS, children, max_size=4)
    ),
    max_leaves=12,
)


def _outcome(encode: Any) -> bytes | None:
    try:
        return bytes(encode())
    except ResultEncodeError:
        return None


@given(VALUES)
def test_the_faithful_shortcut_agrees_with_decoding(value: Any) -> None:
    fmt = ResultFormat()
    short = _outcome(lambda: fmt.encode(value))
    long = _outcome(lambda: fmt.encode(value, lambda v: v, lambda v: v))
    assert short == long
    if short is not None:
        assert fmt.decode(short) == (value, None)


def test_the_shortcut_refuses_what_would_change() -> None:
    fmt = ResultFormat()
    for value in ({1: "a"}, {"a": (1,)}, [{"x": {2: 3}}], [1.0, (2,)]):
        try:
            fmt.encode(value)
        except ResultEncodeError:
            continue
        raise AssertionError(f"{value!r} was accepted")
    deep: Any = 1
    for _ in range(30):  # deeper than the shortcut looks: decoded and compared
        deep = {"d": [deep]}
    assert fmt.decode(fmt.encode(deep)) == (deep, None)
