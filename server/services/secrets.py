"""The server secret and what the gateway protects with it: signed download URLs and hub tokens at rest.

The secret comes from settings (`TWINKLE_SIGNING_SECRET`; every gateway of a cluster must share it) or, by default,
from `<data dir>/server-secret` (created once, mode 0600). Download URLs are signed with HMAC-SHA256; tokens are
sealed with the one scheme of jobqueue/sealing.py (AES-256-GCM), bound to where they are stored. A token the old
scheme sealed still opens, and `open_token` says so, for the caller to store it sealed anew.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

from jobqueue.sealing import LegacyKeys, Sealer, secret_file, secret_from_value
from jobqueue.sealing import SealError as SecretError
from server.config import Settings

__all__ = ["Keyring", "SecretError", "load_secret"]


def load_secret(settings: Settings) -> bytes:
    if settings.signing_secret is not None:
        return secret_from_value(settings.signing_secret.get_secret_value())
    secret = secret_file(settings.data_dir, create=True)
    assert secret is not None  # just created
    return secret


class Keyring:
    """Keys derived from the server secret, one per purpose."""

    def __init__(self, secret: bytes) -> None:
        self._sign = hmac.new(secret, b"download-url", hashlib.sha256).digest()
        # LEGACY: the labels the old token scheme derived its keys with, to open tokens stored before AES-GCM
        legacy = LegacyKeys.from_labels(secret, b"token-encryption", b"token-mac")
        self._tokens = Sealer(secret, b"hub-token", legacy=legacy)

    def sign(self, message: str) -> str:
        return base64.urlsafe_b64encode(hmac.new(self._sign, message.encode(), hashlib.sha256).digest()).decode().rstrip("=")

    def verify(self, message: str, signature: str) -> bool:
        # as bytes: compare_digest refuses str with non-ASCII characters (a TypeError, once a 500 for a fuzzed sig)
        return hmac.compare_digest(self.sign(message).encode(), signature.encode(errors="replace"))

    def encrypt(self, plaintext: str, context: str = "") -> str:
        """`context` (e.g. tenant and hub of a stored token) must be given again to decrypt."""
        return self._tokens.seal_text(plaintext, context.encode())

    def decrypt(self, token: str, context: str = "") -> str:
        return self.open_token(token, context)[0]

    def open_token(self, token: str, context: str = "") -> tuple[str, bool]:
        """(plaintext, legacy): legacy when the old scheme sealed it (seal it again with `encrypt`)."""
        return self._tokens.open_text(token, context.encode())
