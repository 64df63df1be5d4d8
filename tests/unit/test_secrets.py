"""server/services/secrets.py: URL signatures and token encryption under the server secret."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from server.config import Settings
from server.services.secrets import Keyring, SecretError, load_secret


def test_secret_file_is_created_once_and_private(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    first = load_secret(settings)
    assert len(first) == 32 and load_secret(settings) == first
    assert stat.S_IMODE((tmp_path / "server-secret").stat().st_mode) == 0o600
    assert load_secret(Settings(data_dir=tmp_path, signing_secret="a shared cluster secret!")) != first


def test_signatures() -> None:
    keys = Keyring(b"k" * 32)
    sig = keys.sign("1|key|file|100")
    assert keys.verify("1|key|file|100", sig)
    assert not keys.verify("1|key|file|101", sig)
    assert not Keyring(b"j" * 32).verify("1|key|file|100", sig)


def test_token_encryption_round_trip_and_tamper() -> None:
    keys = Keyring(b"k" * 32)
    token = "hf_" + "x" * 40
    sealed = keys.encrypt(token)
    assert token not in sealed and keys.encrypt(token) != sealed  # fresh nonce each time
    assert keys.decrypt(sealed) == token
    raw = bytearray(sealed.encode())
    raw[30] = ord("A") if raw[30] != ord("A") else ord("B")
    with pytest.raises(SecretError):
        keys.decrypt(raw.decode())
    with pytest.raises(SecretError):
        Keyring(b"j" * 32).decrypt(sealed)
