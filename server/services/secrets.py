"""The server secret and what it protects: signed download URLs (HMAC-SHA256) and hub tokens at rest.

The secret comes from settings (`TWINKLE_SIGNING_SECRET`; every gateway of a cluster must share it) or, by default,
from `<data dir>/server-secret` (created once, mode 0600). Tokens are encrypted with an HMAC-SHA256 keystream
(counter mode, fresh 16-byte nonce) and authenticated with an HMAC-SHA256 tag over nonce and ciphertext
(encrypt-then-MAC, separate derived keys); only the standard library is needed.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
from pathlib import Path

from server.config import Settings

_NONCE, _TAG = 16, 32


class SecretError(ValueError):
    """A ciphertext failed authentication (tampered with, or made under another secret)."""


def load_secret(settings: Settings) -> bytes:
    if settings.signing_secret is not None:
        value = settings.signing_secret.get_secret_value().encode()
        if len(value) < 16:
            raise ValueError("TWINKLE_SIGNING_SECRET must be at least 16 characters")
        return hashlib.sha256(value).digest()
    path = settings.data_dir / "server-secret"
    if not path.exists():
        _create(path)
    return bytes.fromhex(path.read_text().strip())


def _create(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    try:
        os.link(tmp, path)  # first writer wins; a concurrent start reads the same secret
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)


class Keyring:
    """Keys derived from the server secret, one per purpose."""

    def __init__(self, secret: bytes) -> None:
        self._sign = _derive(secret, b"download-url")
        self._enc = _derive(secret, b"token-encryption")
        self._mac = _derive(secret, b"token-mac")

    def sign(self, message: str) -> str:
        return base64.urlsafe_b64encode(hmac.new(self._sign, message.encode(), hashlib.sha256).digest()).decode().rstrip("=")

    def verify(self, message: str, signature: str) -> bool:
        return hmac.compare_digest(self.sign(message), signature)

    def encrypt(self, plaintext: str) -> str:
        nonce = secrets.token_bytes(_NONCE)
        data = plaintext.encode()
        ct = bytes(a ^ b for a, b in zip(data, self._keystream(nonce, len(data))))
        tag = hmac.new(self._mac, nonce + ct, hashlib.sha256).digest()
        return base64.urlsafe_b64encode(nonce + ct + tag).decode()

    def decrypt(self, token: str) -> str:
        try:
            raw = base64.urlsafe_b64decode(token.encode())
        except (binascii.Error, ValueError) as e:
            raise SecretError("ciphertext is not valid base64") from e
        if len(raw) < _NONCE + _TAG:
            raise SecretError("ciphertext too short")
        nonce, ct, tag = raw[:_NONCE], raw[_NONCE:-_TAG], raw[-_TAG:]
        if not hmac.compare_digest(tag, hmac.new(self._mac, nonce + ct, hashlib.sha256).digest()):
            raise SecretError("ciphertext failed authentication")
        return bytes(a ^ b for a, b in zip(ct, self._keystream(nonce, len(ct)))).decode()

    def _keystream(self, nonce: bytes, n: int) -> bytes:
        blocks = (hmac.new(self._enc, nonce + i.to_bytes(8, "big"), hashlib.sha256).digest() for i in range(n // 32 + 1))
        return b"".join(blocks)[:n]


def _derive(secret: bytes, purpose: bytes) -> bytes:
    return hmac.new(secret, purpose, hashlib.sha256).digest()
