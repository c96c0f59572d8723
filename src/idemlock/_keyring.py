"""Sealing results at rest (AES-256-GCM) and hiding keys (HMAC-SHA256).

A :class:`Keyring` holds named sealing keys, one of them primary (used to seal; all
are used to open), and a separate *lookup secret* used to turn idempotency keys and
payload fingerprints into HMACs before they reach the store. Rotating the primary
never changes the lookup secret, so every live record stays findable; changing the
lookup secret forgets every record.

Sealed frame: ``s`` + 1 byte key-id length + key id + 12-byte nonce + ciphertext+tag.
The associated data binds the namespace (prefix, tenant, spec) and the key, so a
sealed record copied to another key, spec or tenant fails to open.
"""

from __future__ import annotations

import base64
import hmac
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._core.keys import validate_key
from ._errors import ConfigurationError, SealError

KEY_BYTES = 32
NONCE_BYTES = 12


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: Any, what: str) -> bytes:
    if not isinstance(text, str):
        raise ConfigurationError(f"{what} must be a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except ValueError:
        raise ConfigurationError(f"{what} is not valid base64") from None


class Keyring:
    """Named 32-byte AES-256-GCM keys with one primary, plus a lookup secret.

    Key material never appears in ``repr``, logs or error messages.
    """

    __slots__ = ("_aead", "_keys", "_lookup", "primary")

    def __init__(self, keys: Mapping[str, bytes], primary: str, lookup_secret: bytes) -> None:
        if not keys:
            raise ConfigurationError("a Keyring needs at least one key")
        checked: dict[str, bytes] = {}
        for key_id, material in keys.items():
            validate_key(key_id, "key id")
            if len(key_id.encode()) > 255:
                raise ConfigurationError(f"key id {key_id!r} is longer than 255 bytes")
            if not isinstance(material, (bytes, bytearray)) or len(material) != KEY_BYTES:
                raise ConfigurationError(
                    f"key {key_id!r} must be exactly {KEY_BYTES} bytes (AES-256); "
                    "make one with Keyring.generate() or os.urandom(32)"
                )
            checked[key_id] = bytes(material)
        if primary not in checked:
            raise ConfigurationError(
                f"primary key id {primary!r} is not among the keys {sorted(checked)}"
            )
        if not isinstance(lookup_secret, (bytes, bytearray)) or len(lookup_secret) < 32:
            raise ConfigurationError("lookup_secret must be at least 32 bytes")
        if any(hmac.compare_digest(bytes(lookup_secret), k) for k in checked.values()):
            raise ConfigurationError(
                "lookup_secret must differ from every sealing key (it must survive rotation)"
            )
        self._keys = checked
        self.primary = primary
        self._lookup = bytes(lookup_secret)
        self._aead: dict[str, Any] = {}

    # ---- building --------------------------------------------------------------

    @classmethod
    def generate(cls, key_id: str = "k1") -> Keyring:
        """A new keyring with one fresh key and a fresh lookup secret."""
        return cls({key_id: os.urandom(KEY_BYTES)}, key_id, os.urandom(32))

    @classmethod
    def from_bytes(cls, key: bytes, lookup_secret: bytes, key_id: str = "k1") -> Keyring:
        """A keyring of one key."""
        return cls({key_id: key}, key_id, lookup_secret)

    @classmethod
    def from_json(cls, text: str) -> Keyring:
        """From ``{"primary": id, "keys": {id: base64, ...}, "lookup": base64}``."""
        try:
            doc = json.loads(text)
        except ValueError:
            raise ConfigurationError("keyring document is not valid JSON") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("keys"), dict):
            raise ConfigurationError(
                'keyring document must be {"primary": ..., "keys": {...}, "lookup": ...}'
            )
        keys = {str(k): _unb64(v, f"key {k!r}") for k, v in doc["keys"].items()}
        primary = doc.get("primary")
        if not isinstance(primary, str):
            raise ConfigurationError("keyring document needs a string 'primary'")
        return cls(keys, primary, _unb64(doc.get("lookup"), "lookup"))

    @classmethod
    def from_env(cls, name: str = "IDEMLOCK_KEYRING") -> Keyring:
        """From an environment variable holding the JSON document, or its base64."""
        value = os.environ.get(name)
        if not value:
            raise ConfigurationError(f"environment variable {name} is not set or empty")
        value = value.strip()
        if not value.startswith("{"):
            value = _unb64(value, f"${name}").decode("utf-8", "replace")
        return cls.from_json(value)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Keyring:
        """From a file holding the JSON document (keep it readable by the service only)."""
        try:
            return cls.from_json(Path(path).read_text("utf-8"))
        except OSError as exc:
            raise ConfigurationError(f"cannot read keyring file {path}: {exc.strerror}") from None

    def to_json(self) -> str:
        """The JSON document (contains secrets: store it like a password)."""
        return json.dumps(
            {
                "primary": self.primary,
                "keys": {k: _b64(v) for k, v in self._keys.items()},
                "lookup": _b64(self._lookup),
            },
            indent=2,
        )

    def rotate(self, key_id: str, key: bytes | None = None) -> Keyring:
        """A keyring with a new primary key added; old keys still open old records and
        the lookup secret is unchanged."""
        keys = dict(self._keys)
        if key_id in keys and key is not None and keys[key_id] != key:
            raise ConfigurationError(f"key id {key_id!r} already names another key")
        keys.setdefault(key_id, key if key is not None else os.urandom(KEY_BYTES))
        return Keyring(keys, key_id, self._lookup)

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def __repr__(self) -> str:
        return f"Keyring(primary={self.primary!r}, key_ids={self.key_ids!r})"

    # ---- use -------------------------------------------------------------------

    def lookup(self, kind: str, data: bytes) -> str:
        """HMAC-SHA256 (hex) of ``data`` under the lookup secret, domain-separated."""
        # hmac.digest is the one-shot C path: several times faster than hmac.new.
        return hmac.digest(self._lookup, kind.encode() + b"\0" + data, "sha256").hex()

    def _cipher(self, key_id: str) -> Any:
        cipher = self._aead.get(key_id)
        if cipher is None:
            try:
                from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            except ImportError as exc:
                raise ConfigurationError(
                    "sealing needs the cryptography package: pip install 'idemlock[seal]'"
                ) from exc
            cipher = self._aead[key_id] = AESGCM(self._keys[key_id])
        return cipher

    def seal(self, plain: bytes, ad: bytes) -> bytes:
        kid = self.primary.encode()
        nonce = os.urandom(NONCE_BYTES)
        sealed: bytes = self._cipher(self.primary).encrypt(nonce, plain, ad)
        return b"s" + bytes([len(kid)]) + kid + nonce + sealed

    def open(self, data: bytes, ad: bytes) -> bytes:
        if data[:1] != b"s" or len(data) < 2:
            raise SealError(
                "the stored result is not sealed although its spec requires sealing; "
                "it was not written by this configuration: forget the key"
            )
        n = data[1]
        kid = data[2 : 2 + n].decode("utf-8", "replace")
        rest = data[2 + n :]
        if kid not in self._keys:
            raise SealError(
                f"the stored result was sealed with key id {kid!r}, which this keyring does "
                f"not have (it has {self.key_ids}); add that key to open it"
            )
        from cryptography.exceptions import InvalidTag

        try:
            plain: bytes = self._cipher(kid).decrypt(rest[:NONCE_BYTES], rest[NONCE_BYTES:], ad)
        except (InvalidTag, ValueError):
            raise SealError(
                f"the stored result does not open with key {kid!r}: wrong key, tampered "
                "data, or a record moved from another key, spec or tenant"
            ) from None
        return plain
