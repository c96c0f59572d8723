"""How a record's key, payload and result look in the store: the key and the payload
fingerprint as HMACs under a keyring, the result framed by the result format and
sealed (encrypted and bound to its key) when the spec says so."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .._core.canonical import canonicalize, fingerprint
from .._core.codec import RecordedError, ResultFormat
from .._core.keys import validate_key

if TYPE_CHECKING:
    from .._keyring import Keyring


class Records:
    """The store-side form of keys, payloads and results for one spec's namespace. An
    idempotency port holds one, made with the port (``port._records``)."""

    __slots__ = ("_format", "_keyring", "_ns", "_seal", "_spec_name")

    def __init__(
        self, ns: str, spec_name: str, fmt: ResultFormat, keyring: Keyring | None, seal: bool
    ) -> None:
        self._ns = ns
        self._spec_name = spec_name
        self._format = fmt
        self._keyring = keyring
        self._seal = seal

    def skey(self, key: str) -> str:
        """The key as stored: the key itself, or its HMAC when a keyring is set (the
        store then never sees callers' keys)."""
        validate_key(key)
        if self._keyring is None:
            return key
        return self._keyring.lookup("key", self._ns.encode() + b"\0" + key.encode())

    def fp(self, payload: Any) -> str | None:
        if payload is None:
            return None
        if self._keyring is None:
            return fingerprint(payload)
        # An HMAC, not a bare hash: guessable payloads cannot be brute-forced from it.
        return self._keyring.lookup("fp", canonicalize(payload))

    def step_key(self, key: str, name: str) -> str:
        """``attempt.key_for(name)``: stable per (namespace, key, step name), an HMAC
        under a keyring (so it says nothing of the key)."""
        data = b"\0".join(part.encode() for part in (self._ns, key, name)) + b"\0"
        if self._keyring is not None:
            return "idemlock-" + self._keyring.lookup("step", data)[:32]
        import hashlib  # here: `import idemlock` stays light (tests/test_import_cost.py)

        return "idemlock-" + hashlib.sha256(data).hexdigest()[:32]

    def ad(self, key: str) -> bytes:
        # Associated data: the record only opens under this prefix, tenant, spec and key.
        return b"idemlock/1\0" + self._ns.encode() + b"\0" + key.encode()

    # ---- results ---------------------------------------------------------------------

    def encode(self, key: str, value: Any, dump: Any = None, load: Any = None) -> bytes:
        if dump is None:
            framed = self._format.encode(value)
        else:
            framed = self._format.encode(value, dump, load)
        return self.seal_framed(key, framed)

    def encode_error(self, key: str, exc: BaseException) -> bytes:
        return self.seal_framed(key, self._format.encode_error(exc))

    def seal_framed(self, key: str, framed: bytes) -> bytes:
        if not self._seal:
            return framed
        assert self._keyring is not None
        return self._keyring.seal(framed, self.ad(key))

    def decode(self, key: str, data: bytes, load: Any = None) -> tuple[Any, RecordedError | None]:
        if self._seal:
            assert self._keyring is not None
            data = self._keyring.open(bytes(data), self.ad(key))
        elif data[:1] == b"s":
            from .._errors import SealError

            raise SealError(
                f"the stored result of {key!r} is sealed but spec {self._spec_name!r} does not "
                "use encrypt_result; set encrypt_result=True with the keyring that sealed it"
            )
        if load is None:
            return self._format.decode(data)
        return self._format.decode(data, load)
