"""Validation of user-supplied names and keys, and namespaces for stores."""

from __future__ import annotations

import re

from .._errors import InvalidKey

MAX_KEY_BYTES = 512
# Whitespace, C0/C1 control characters and lone surrogates.
_FORBIDDEN = re.compile(r"[\s\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def validate_key(value: object, what: str = "key") -> str:
    """Return ``value`` if it is a usable key, else raise :class:`InvalidKey`.

    A key is a non-empty ``str`` of at most 512 UTF-8 bytes with no whitespace
    and no control characters (they break log lines, CLI output and some stores).
    """
    if not isinstance(value, str):
        raise InvalidKey(f"{what} must be a str, got {type(value).__name__}; convert it first")
    if not value:
        raise InvalidKey(f"{what} must not be empty")
    if len(value) <= 128 and value.isascii() and value.isprintable() and " " not in value:
        return value  # the common case: short printable ASCII
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_KEY_BYTES:
        raise InvalidKey(
            f"{what} is {size} bytes of UTF-8, more than the limit of {MAX_KEY_BYTES}; "
            "hash long keys (for example with idemlock.fingerprint) before using them"
        )
    bad = _FORBIDDEN.search(value)
    if bad is not None:
        ch = bad.group()
        if 0xD800 <= ord(ch) <= 0xDFFF:
            raise InvalidKey(f"{what} {value!r} contains a lone surrogate; use valid Unicode")
        raise InvalidKey(
            f"{what} {value!r} contains whitespace or a control character ({ch!r}); "
            "use only printable characters without spaces"
        )
    return value


def _escape(part: str) -> str:
    # ':' separates namespace parts and '%' escapes; '{' '}' are special to Redis Cluster.
    return part.replace("%", "%25").replace(":", "%3A").replace("{", "%7B").replace("}", "%7D")


def namespace(prefix: str, name: str, tenant: str | None = None) -> str:
    """Build the namespace string a store receives for one spec.

    Parts are escaped so that no choice of prefix, tenant or name can produce the
    namespace of another (``a:b`` + ``c`` never equals ``a`` + ``b:c``).
    """
    parts = [_escape(prefix)]
    if tenant is not None:
        parts.append("t=" + _escape(tenant))
    parts.append(_escape(name))
    return ":".join(parts)


def split_namespace(ns: str) -> list[str]:
    """Undo :func:`namespace` (for listings): the unescaped parts."""
    out = []
    for part in ns.split(":"):
        out.append(
            part.replace("%7D", "}").replace("%7B", "{").replace("%3A", ":").replace("%25", "%")
        )
    return out
