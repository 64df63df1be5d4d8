"""Sealing (encrypt-then-MAC) of what must cross Redis but must not be readable there: a hub push's token.

Both ends derive their keys from the cluster's server secret, found the way the gateway finds it
(server/services/secrets.py): `TWINKLE_SIGNING_SECRET` (hashed), else `<data dir>/server-secret`. A worker on another
machine therefore needs `TWINKLE_SIGNING_SECRET` in its environment (docker-compose and the KubeRay example pass it
from the same secret as the gateway's). Standard library only: HMAC-SHA256 keystream, HMAC-SHA256 tag.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

_NONCE, _TAG = 16, 32


class SealError(ValueError):
    """The blob failed authentication: tampered with, or sealed under another secret."""


def cluster_secret(data_dir: Path | str | None) -> bytes | None:
    """The server secret as the gateway derives it, or None where this process cannot know it."""
    value = os.environ.get("TWINKLE_SIGNING_SECRET")
    if value:
        return hashlib.sha256(value.encode()).digest()
    if data_dir is not None:
        path = Path(data_dir) / "server-secret"
        if path.is_file():
            return bytes.fromhex(path.read_text().strip())
    return None


class Sealer:
    def __init__(self, secret: bytes, purpose: bytes) -> None:
        self._enc = hmac.new(secret, purpose + b"/enc", hashlib.sha256).digest()
        self._mac = hmac.new(secret, purpose + b"/mac", hashlib.sha256).digest()

    def seal(self, data: bytes) -> bytes:
        nonce = secrets.token_bytes(_NONCE)
        ct = bytes(a ^ b for a, b in zip(data, self._keystream(nonce, len(data))))
        return nonce + ct + hmac.new(self._mac, nonce + ct, hashlib.sha256).digest()

    def unseal(self, blob: bytes) -> bytes:
        if len(blob) < _NONCE + _TAG:
            raise SealError("sealed blob too short")
        nonce, ct, tag = blob[:_NONCE], blob[_NONCE:-_TAG], blob[-_TAG:]
        if not hmac.compare_digest(tag, hmac.new(self._mac, nonce + ct, hashlib.sha256).digest()):
            raise SealError("sealed blob failed authentication (a different server secret?)")
        return bytes(a ^ b for a, b in zip(ct, self._keystream(nonce, len(ct))))

    def _keystream(self, nonce: bytes, n: int) -> bytes:
        blocks = (hmac.new(self._enc, nonce + i.to_bytes(8, "big"), hashlib.sha256).digest() for i in range(n // 32 + 1))
        return b"".join(blocks)[:n]
