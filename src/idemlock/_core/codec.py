"""How results are stored: JSON data in an envelope, framed, maybe compressed.

Never pickle or eval: stored bytes are data. Frame: one marker byte, then the body.

* ``j`` UTF-8 JSON envelope; ``z`` the same compressed with zlib (bodies above
  ``compress_over`` bytes, when that makes them smaller).
* Envelope: ``{"v": data}`` for a result (so a bare ``null`` is a recorded ``None``) or
  ``{"e": {"type": ..., "args": [...], "message": ...}}`` for a recorded exception.
* Sealed records (marker ``s``) wrap a frame; see :mod:`idemlock._keyring`.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._errors import ConfigurationError, ResultDecodeError, ResultEncodeError, ResultTooLarge
from .jsonfast import dumps_compact, loads

if TYPE_CHECKING:
    # typed results load their helpers on first use; TypedError is a TypeError
    from .typed import Dumper, Loader

_SCALARS = (str, int, float, bool, type(None))

MAX_RESULT_BYTES = 1 << 20
COMPRESS_OVER = 16 * 1024


@dataclass(frozen=True)
class RecordedError:
    """An exception recorded as data: its type's qualified name, args and message."""

    type: str
    args: tuple[Any, ...]
    message: str


def _plain(v: Any) -> Any:
    return v


def _exact(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is JSON data that comes back from JSON as it is: a dict with
    str keys or a list, of exact JSON scalars and such dicts and lists, nested at most
    a few levels (deeper ones are decoded and compared instead). Floats qualify: JSON
    writes their shortest repr, which reads back the same float (NaN and infinity are
    refused when encoding)."""
    if depth > 8:
        return False
    tp = type(value)
    if tp is dict:
        for k, v in value.items():
            if type(k) is not str or (type(v) not in _SCALARS and not _exact(v, depth + 1)):
                return False
        return True
    if tp is list:
        return all(type(v) in _SCALARS or _exact(v, depth + 1) for v in value)
    return False


# What a result that cannot be stored leaves behind. A caller without a dumper is the
# port (complete(token, result), attempt.result of port.run()): it raises before
# writing and keeps the claim. The decorator (and the queue integrations) pass the
# return type's dumper and abandon the claim.
_KEPT = (
    "nothing was recorded and the claim stays in flight until its lease ends or you "
    "abandon it (port.abandon(token); after port.run(), attempt.token)"
)
_JSON_HINT = "lists instead of tuples, str keys, ISO strings instead of datetimes"
_ABANDONED = "nothing was recorded and the claim was abandoned, so a retry runs the call again"
# What a record that cannot be replayed needs; the claim's reply names the record.
_FORGET = (
    "forget the record (port.forget(key)) so the next call runs again, or use a new "
    "spec name so no old record is read"
)


def type_name(tp: type) -> str:
    return f"{tp.__module__}.{tp.__qualname__}"


class ResultFormat:
    """Encodes results and recorded errors to stored bytes and back."""

    def __init__(
        self, max_bytes: int = MAX_RESULT_BYTES, compress_over: int | None = COMPRESS_OVER
    ) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 16:
            raise ConfigurationError(f"max_result_bytes must be an int >= 16, got {max_bytes!r}")
        if compress_over is not None and (
            isinstance(compress_over, bool)
            or not isinstance(compress_over, int)
            or compress_over < 0
        ):
            raise ConfigurationError(
                f"compress_over must be a non-negative int or None, got {compress_over!r}"
            )
        self.max_bytes = max_bytes
        self.compress_over = compress_over

    def encode(self, value: Any, dump: Dumper = _plain, load: Loader = _plain) -> bytes:
        """Frame ``value``; raise ``ResultEncodeError`` unless it comes back equal."""
        from_port = dump is _plain  # no return type: complete() or port.run()
        fate = _KEPT if from_port else _ABANDONED
        try:
            data = dump(value)
            text = dumps_compact({"v": data})
            # A plain scalar of an exact JSON type always comes back equal, and so does
            # plain JSON data built of them (checked without decoding); anything else
            # is decoded and compared, so nothing unfaithful is ever stored.
            if type(value) in _SCALARS or (from_port and load is _plain and _exact(value)):
                back = value
            else:
                back = load(loads(text)["v"])
            body = text.encode("utf-8")  # a lone surrogate: UnicodeEncodeError, a ValueError
        except (TypeError, ValueError, RecursionError) as exc:  # TypedError included
            how = (
                f"pass JSON data ({_JSON_HINT}), or use the decorator with a return "
                "annotation to store other types"
                if from_port
                else "return JSON-like data or declare the return type"
            )
            raise ResultEncodeError(
                f"the result ({type(value).__name__}) cannot be stored faithfully: {exc}; "
                f"{how} (dataclass, datetime, UUID, Decimal, bytes, pydantic, msgspec ...); "
                f"{fate}"
            ) from None
        if type(back) is not type(value) or back != value:
            how = (
                f"pass JSON data ({_JSON_HINT}), or use the decorator with a return "
                "annotation so it can be restored (e.g. -> tuple[int, int])"
                if from_port
                else "declare the return type so it can be restored (e.g. -> tuple[int, "
                "int]), or return plain JSON data (lists, str-keyed dicts)"
            )
            raise ResultEncodeError(
                f"the result ({type(value).__name__}) would not come back equal after storing "
                f"(it would replay as {type(back).__name__} {back!r:.60}); {how}; {fate}"
            )
        return self.frame(body, fate)

    def encode_error(self, exc: BaseException) -> bytes:
        # Only the decorator records exceptions; it abandons the claim when it cannot.
        err = {"type": type_name(type(exc)), "args": list(exc.args), "message": str(exc)}
        try:
            body = dumps_compact({"e": err}).encode("utf-8")
        except (TypeError, ValueError, RecursionError) as e:
            raise ResultEncodeError(
                f"the exception {type(exc).__name__} cannot be recorded: its args are not JSON "
                f"data ({e}); {_ABANDONED}"
            ) from None
        return self.frame(body, _ABANDONED)

    def frame(self, body: bytes, fate: str = "nothing was recorded") -> bytes:
        out = b"j" + body
        if self.compress_over is not None and len(body) > self.compress_over:
            packed = zlib.compress(body, 6)
            if len(packed) < len(body):
                out = b"z" + packed
        if len(out) > self.max_bytes:
            raise ResultTooLarge(
                f"the result takes {len(out)} bytes stored, over the limit of {self.max_bytes}; "
                f"store large data elsewhere and return a reference to it, or raise "
                f"max_result_bytes; {fate}"
            )
        return out

    def decode(self, data: bytes, load: Loader = _plain) -> tuple[Any, RecordedError | None]:
        """Return (result, None) or (None, recorded error)."""
        data = bytes(data)
        marker, body = data[:1], data[1:]
        try:
            if marker == b"z":
                body = zlib.decompress(body, bufsize=self.max_bytes)
            elif marker != b"j":
                raise ResultDecodeError(
                    f"stored result has an unknown format marker {marker!r}: it was written by "
                    f"another program or version, or is corrupt; {_FORGET}"
                )
            obj = loads(body.decode("utf-8"))
        except (zlib.error, UnicodeDecodeError, ValueError) as exc:
            raise ResultDecodeError(f"stored result is corrupt ({exc}); {_FORGET}") from None
        if isinstance(obj, dict) and len(obj) == 1:
            if "v" in obj:
                try:
                    return load(obj["v"]), None
                except (TypeError, ValueError, KeyError) as exc:  # TypedError included
                    raise ResultDecodeError(
                        f"stored result does not fit the declared return type ({exc}); it was "
                        f"recorded by another version of the code: {_FORGET}"
                    ) from None
            err = obj.get("e")
            if (
                isinstance(err, dict)
                and isinstance(err.get("type"), str)
                and isinstance(err.get("args"), list)
                and isinstance(err.get("message"), str)
            ):
                return None, RecordedError(err["type"], tuple(err["args"]), err["message"])
        raise ResultDecodeError(f"stored result is not an idemlock record; {_FORGET}")
