"""The ``Idempotency-Key`` field value: a structured-field Item (RFC 8941, RFC 9651)
whose bare item is a String.

``parse_idempotency_key`` accepts ``"abc"`` (``\\"`` and ``\\\\`` the only escapes) with
optional parameters, which are validated and ignored, and, when asked (the HTTP
adapters ask by default), the unquoted values Stripe's clients send. Everything else is
:class:`MalformedKey`.
"""

from __future__ import annotations

import re

from ..._errors import IdemlockError

__all__ = ["MalformedKey", "parse_idempotency_key"]


class MalformedKey(IdemlockError, ValueError):
    """The Idempotency-Key header is not a usable structured-field String (the
    middleware answers 400 with the message)."""


_PARAM_KEY = re.compile(r"[a-z*][a-z0-9_\-.*]*")
_NUMBER = re.compile(r"-?(?:[0-9]{1,12}\.[0-9]{1,3}|[0-9]{1,15})(?![0-9.])")
_INTEGER = re.compile(r"-?[0-9]{1,15}(?![0-9.])")
_TOKEN = re.compile(r"[A-Za-z*][!#$%&'*+\-.^_`|~0-9A-Za-z:/]*")
_BINARY = re.compile(r":[A-Za-z0-9+/=]*:")
_BOOLEAN = re.compile(r"\?[01]")
_LOWER_HEX = frozenset("0123456789abcdef")


def _parse_string(text: str, pos: int) -> tuple[str, int]:
    """An sf-string starting at ``text[pos] == '"'``: (value, position after it)."""
    out: list[str] = []
    i = pos + 1
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            if i + 1 >= n or text[i + 1] not in '"\\':
                raise MalformedKey("a backslash may only escape '\"' or '\\'")
            out.append(text[i + 1])
            i += 2
        elif ch == '"':
            return "".join(out), i + 1
        elif not " " <= ch <= "~":
            raise MalformedKey("only printable ASCII is allowed inside the quotes")
        else:
            out.append(ch)
            i += 1
    raise MalformedKey("the string has no closing double quote")


def _skip_display_string(text: str, pos: int) -> int:
    """An RFC 9651 display string (``%"..."``) starting at ``pos``; its end."""
    raw = bytearray()
    i = pos + 2
    n = len(text)
    while i < n:
        ch = text[i]
        if not " " <= ch <= "~":
            raise MalformedKey("a display string allows only printable ASCII")
        if ch == "%":
            hexdigits = text[i + 1 : i + 3]
            if len(hexdigits) != 2 or not set(hexdigits) <= _LOWER_HEX:
                raise MalformedKey("a display string needs %xx with lowercase hex digits")
            raw.append(int(hexdigits, 16))
            i += 3
        elif ch == '"':
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                raise MalformedKey("a display string is not valid UTF-8") from None
            return i + 1
        else:
            raw.append(ord(ch))
            i += 1
    raise MalformedKey("the display string has no closing double quote")


def _skip_bare_item(text: str, pos: int) -> int:
    """Validate any bare item (a parameter value) at ``pos``; return its end."""
    ch = text[pos : pos + 1]
    if ch == '"':
        return _parse_string(text, pos)[1]
    if ch == "%" and text[pos + 1 : pos + 2] == '"':
        return _skip_display_string(text, pos)
    if ch == "@":
        m = _INTEGER.match(text, pos + 1)
    else:
        m = next(
            (m for rx in (_NUMBER, _TOKEN, _BINARY, _BOOLEAN) if (m := rx.match(text, pos))),
            None,
        )
    if m is None:
        raise MalformedKey(f"a parameter value is malformed at {text[pos : pos + 10]!r}")
    return m.end()


def parse_idempotency_key(
    value: bytes | str, *, max_length: int = 255, allow_unquoted: bool = False
) -> str:
    """The key carried by an ``Idempotency-Key`` field value, or raise
    :class:`MalformedKey`.

    The value must be a structured-field Item whose bare item is a String (RFC 8941
    section 3.3.3): ``"abc"``, with ``\\"`` and ``\\\\`` as the only escapes; parameters
    are checked and ignored. The decoded key must have 1 to ``max_length`` characters.
    ``allow_unquoted`` also accepts a bare value of printable ASCII without spaces (what
    Stripe's clients send)."""
    text = value.decode("latin-1") if isinstance(value, (bytes, bytearray)) else value
    text = text.strip(" \t")
    if not text.startswith('"'):
        if allow_unquoted and text and all("!" <= ch <= "~" for ch in text):
            key = text
        else:
            raise MalformedKey(
                'the value must be a quoted string, for example Idempotency-Key: "8e03978e-..."'
            )
    else:
        key, pos = _parse_string(text, 0)
        while text[pos : pos + 1] == ";":
            pos += 1
            while text[pos : pos + 1] == " ":
                pos += 1
            m = _PARAM_KEY.match(text, pos)
            if m is None:
                raise MalformedKey("a parameter name must start with a-z or '*'")
            pos = m.end()
            if text[pos : pos + 1] == "=":
                pos = _skip_bare_item(text, pos + 1)
        if text[pos:].strip(" "):
            raise MalformedKey(f"unexpected characters after the string: {text[pos:][:20]!r}")
    if not key:
        raise MalformedKey("the key must not be empty")
    if len(key) > max_length:
        raise MalformedKey(f"the key has {len(key)} characters, more than {max_length}")
    return key
