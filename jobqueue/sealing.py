"""The server secret and the one sealing scheme for what it protects: hub tokens at rest and in flight.

Both sides use it: the gateway seals a tenant's hub token for its SQL table and for the trip across Redis, the
checkpoint pusher (workers/) unseals it there. So it lives on the floor both import. The server secret is found the
same way everywhere: `TWINKLE_SIGNING_SECRET` (hashed), else `<data dir>/server-secret` (32 random bytes, hex,
created once with mode 0600). A worker on another machine therefore needs `TWINKLE_SIGNING_SECRET` in its
environment (docker-compose and the KubeRay example pass it from the same secret as the gateway's).

Scheme: AES-256-GCM (`cryptography`), a fresh 96-bit nonce per message, one key per purpose derived from the secret
with HKDF-SHA256; optional associated data binds a ciphertext to where it belongs (a token to its tenant and hub).
A binary blob is `MAGIC | nonce | ciphertext+tag`; its text form (SQL) is `PREFIX + urlsafe base64(blob)`.

Blobs made by the old stdlib scheme (HMAC-SHA256 keystream, encrypt-then-MAC) are still opened: `LegacyKeys` keeps
only their decryption, and `Opened.legacy` tells the reader to re-seal what it read.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"TWS\x02"  # a binary blob of this scheme (an old blob starts with a random nonce instead)
PREFIX = "tws2:"  # a text blob of this scheme (':' is outside the urlsafe base64 alphabet of the old text form)
_NONCE = 12
_SECRET_FILE = "server-secret"


class SealError(ValueError):
    """A blob failed authentication: tampered with, sealed under another secret, or not a sealed blob at all."""


# ---- the server secret ----------------------------------------------------------------------------------------

def secret_from_value(value: str) -> bytes:
    """The secret a configured `TWINKLE_SIGNING_SECRET` stands for (at least 16 characters)."""
    if len(value) < 16:
        raise ValueError("TWINKLE_SIGNING_SECRET must be at least 16 characters")
    return hashlib.sha256(value.encode()).digest()


def secret_file(data_dir: Path | str, create: bool = False) -> bytes | None:
    """The secret of `<data dir>/server-secret`, created first when `create` (a concurrent start reads the same)."""
    path = Path(data_dir) / _SECRET_FILE
    if create and not path.exists():
        _create(path)
    if not path.is_file():
        return None
    return bytes.fromhex(path.read_text().strip())


def cluster_secret(data_dir: Path | str | None) -> bytes | None:
    """The server secret as the gateway derives it, or None where this process cannot know it."""
    value = os.environ.get("TWINKLE_SIGNING_SECRET")
    if value:
        return secret_from_value(value)
    return secret_file(data_dir) if data_dir is not None else None


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    try:
        os.link(tmp, path)  # first writer wins
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


def derive_key(secret: bytes, purpose: bytes) -> bytes:
    """A 256-bit key for one purpose; keys of different purposes are independent."""
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=b"twinkle/" + purpose).derive(secret)


# ---- sealing ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Opened:
    data: bytes
    legacy: bool  # sealed by the old scheme: seal it again and store that


class Sealer:
    """AES-256-GCM under the key of `purpose`. `legacy` opens what the old scheme sealed for the same purpose."""

    def __init__(self, secret: bytes, purpose: bytes, legacy: LegacyKeys | None = None) -> None:
        self._aead = AESGCM(derive_key(secret, purpose))
        self._legacy = legacy if legacy is not None else LegacyKeys.for_purpose(secret, purpose)

    def seal(self, data: bytes, aad: bytes = b"") -> bytes:
        nonce = secrets.token_bytes(_NONCE)
        return MAGIC + nonce + self._aead.encrypt(nonce, data, aad or None)

    def unseal(self, blob: bytes, aad: bytes = b"") -> bytes:
        return self.open(blob, aad).data

    def open(self, blob: bytes, aad: bytes = b"") -> Opened:
        """A blob of `seal`, or (binary, from Redis) of the old scheme."""
        data = self._decrypt(blob, aad)
        if data is not None:
            return Opened(data, legacy=False)
        # not ours, or one old blob in 2**32 that starts with MAGIC by chance: the legacy check decides
        return Opened(self._legacy.decrypt(blob), legacy=True)

    def seal_text(self, data: str, aad: bytes = b"") -> str:
        return PREFIX + base64.urlsafe_b64encode(self.seal(data.encode(), aad)).decode()

    def open_text(self, text: str, aad: bytes = b"") -> tuple[str, bool]:
        """(plaintext, legacy) of a text blob: `seal_text`'s, or the old scheme's (urlsafe base64, no prefix)."""
        ours = text.startswith(PREFIX)
        try:
            raw = base64.urlsafe_b64decode(text.removeprefix(PREFIX).encode())
        except (binascii.Error, ValueError) as e:
            raise SealError("sealed text is not valid base64") from e
        if ours:
            data = self._decrypt(raw, aad)
            if data is None:
                raise SealError("sealed text failed authentication (tampered with, or a different server secret?)")
        else:
            data = self._legacy.decrypt(raw)
        try:
            return data.decode(), not ours
        except UnicodeDecodeError as e:
            raise SealError("sealed text is not text") from e

    def _decrypt(self, blob: bytes, aad: bytes) -> bytes | None:
        if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + _NONCE + 16:
            return None
        body = blob[len(MAGIC):]
        try:
            return self._aead.decrypt(body[:_NONCE], body[_NONCE:], aad or None)
        except InvalidTag:
            return None


# ---- LEGACY: the old stdlib scheme, decryption only --------------------------------------------------------------

_LEGACY_NONCE, _LEGACY_TAG = 16, 32


@dataclass(frozen=True)
class LegacyKeys:
    """LEGACY (read-only): keys of the old HMAC-SHA256 keystream + HMAC-SHA256 tag scheme, for blobs sealed before
    the move to AES-GCM (hub tokens in SQL, pushes in flight in Redis). Nothing is sealed with it any more."""

    enc: bytes
    mac: bytes

    @classmethod
    def for_purpose(cls, secret: bytes, purpose: bytes) -> LegacyKeys:
        """The labels jobqueue/sealing.py used (Redis blobs)."""
        return cls.from_labels(secret, purpose + b"/enc", purpose + b"/mac")

    @classmethod
    def from_labels(cls, secret: bytes, enc_label: bytes, mac_label: bytes) -> LegacyKeys:
        return cls(hmac.new(secret, enc_label, hashlib.sha256).digest(), hmac.new(secret, mac_label, hashlib.sha256).digest())

    def decrypt(self, blob: bytes) -> bytes:
        """`nonce(16) | keystream XOR plaintext | HMAC(mac, nonce | ciphertext)(32)`."""
        if len(blob) < _LEGACY_NONCE + _LEGACY_TAG:
            raise SealError("sealed blob too short")
        nonce, ct, tag = blob[:_LEGACY_NONCE], blob[_LEGACY_NONCE:-_LEGACY_TAG], blob[-_LEGACY_TAG:]
        if not hmac.compare_digest(tag, hmac.new(self.mac, nonce + ct, hashlib.sha256).digest()):
            raise SealError("sealed blob failed authentication (tampered with, or a different server secret?)")
        blocks = (hmac.new(self.enc, nonce + i.to_bytes(8, "big"), hashlib.sha256).digest()
                  for i in range(len(ct) // 32 + 1))
        return bytes(a ^ b for a, b in zip(ct, b"".join(blocks)[:len(ct)]))
