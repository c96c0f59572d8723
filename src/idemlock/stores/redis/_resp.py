"""A small RESP2/RESP3 reply parser with hiredis.Reader's interface (``feed``, and
``gets`` returning ``False`` until a whole reply is in), for the pipelined connection
when hiredis is not installed (``pip install 'idemlock[redis]'`` brings none).

Replies come back as redis-py's ``disable_decoding`` would give them: bulk and status
strings as bytes, integers, ``None``, lists (RESP3: booleans as 1 or 0, since ``False``
means "no whole reply yet"; maps as dicts; doubles as floats); an error reply as an
instance of the ``reply_error`` class (not raised: it belongs to one caller of a batch).
"""

from __future__ import annotations

from typing import Any


class ProtocolError(Exception):
    """The bytes are not RESP: the connection is out of step and must be dropped."""


class _Incomplete(Exception):
    """Not a whole reply yet."""


_INCOMPLETE = _Incomplete()


class Reader:
    """Parses replies out of the bytes fed to it, in order."""

    __slots__ = ("_buf", "_error", "_pos")

    def __init__(self, reply_error: type[Exception]) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._error = reply_error

    def feed(self, data: bytes) -> None:
        self._buf += data

    def gets(self) -> Any:
        """The next whole reply, or ``False`` if none is complete yet."""
        buf = self._buf
        if self._pos >= len(buf):
            return False
        try:
            value, pos = self._parse(self._pos)
        except _Incomplete:
            return False
        if pos >= len(buf):
            buf.clear()
            self._pos = 0
        elif pos > 65536:  # drop what was parsed, not on every reply
            del buf[:pos]
            self._pos = 0
        else:
            self._pos = pos
        return value

    def _line(self, pos: int) -> tuple[int, bytes, int]:
        buf = self._buf
        end = buf.find(b"\r\n", pos)
        if end < 0:
            raise _INCOMPLETE
        return buf[pos], bytes(buf[pos + 1 : end]), end + 2

    def _blob(self, head: bytes, pos: int) -> tuple[bytes | None, int]:
        n = int(head)
        if n < 0:
            return None, pos
        end = pos + n
        if len(self._buf) < end + 2:
            raise _INCOMPLETE
        return bytes(self._buf[pos:end]), end + 2

    def _parse(self, pos: int) -> tuple[Any, int]:
        kind, head, pos = self._line(pos)
        try:
            if kind == 0x24:  # $ bulk string
                return self._blob(head, pos)
            if kind == 0x3A or kind == 0x28:  # : integer, ( big number
                return int(head), pos
            if kind == 0x2A or kind == 0x7E or kind == 0x3E:  # * array, ~ set, > push
                n = int(head)
                if n < 0:
                    return None, pos
                items = []
                for _ in range(n):
                    item, pos = self._parse(pos)
                    items.append(item)
                return items, pos
            if kind == 0x2B:  # + status
                return head, pos
            if kind == 0x2D:  # - error
                return self._error(head.decode("utf-8", "replace")), pos
            if kind == 0x5F:  # _ null
                return None, pos
            if kind == 0x23:  # # boolean: 1 or 0, as `False` means "no reply yet"
                return int(head == b"t"), pos
            if kind == 0x2C:  # , double
                return float(head), pos
            if kind == 0x3D:  # = verbatim string: "txt:" before the text
                raw, pos = self._blob(head, pos)
                return (raw[4:] if raw is not None else None), pos
            if kind == 0x21:  # ! blob error
                raw, pos = self._blob(head, pos)
                return self._error((raw or b"").decode("utf-8", "replace")), pos
            if kind == 0x25 or kind == 0x7C:  # % map, | attribute (then the reply itself)
                out: dict[Any, Any] = {}
                for _ in range(int(head)):
                    k, pos = self._parse(pos)
                    v, pos = self._parse(pos)
                    out[k if not isinstance(k, list) else tuple(k)] = v
                if kind == 0x7C:
                    return self._parse(pos)
                return out, pos
        except ValueError as exc:
            raise ProtocolError(f"bad RESP header {bytes([kind]) + head!r}") from exc
        raise ProtocolError(f"unknown RESP type {bytes([kind])!r}")
