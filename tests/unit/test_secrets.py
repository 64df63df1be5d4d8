"""The server secret and jobqueue/sealing.py: URL signatures, AES-GCM sealing of hub tokens (in SQL and across Redis),
and the legacy scheme: a token sealed before AES-GCM still opens and is stored sealed anew on first read."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import secrets
import stat
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest

from api_schemas.hub import HubPushOutcome, HubPushSpec, Progress
from jobqueue.sealing import MAGIC, PREFIX, SealError, Sealer, cluster_secret
from server.config import Settings
from server.db.database import Database
from server.db.models import HubPushRow, HubTokenRow, TenantRow
from server.services import hub_push
from server.services.context import Context
from server.services.secrets import Keyring, SecretError, load_secret

TOKEN = "hf_" + "x" * 40


def _old_seal(enc: bytes, mac: bytes, data: bytes) -> bytes:
    """The old stdlib scheme as it sealed (HMAC-SHA256 keystream, then an HMAC-SHA256 tag): test fixtures only."""
    nonce = secrets.token_bytes(16)
    stream = b"".join(hmac.new(enc, nonce + i.to_bytes(8, "big"), hashlib.sha256).digest()
                      for i in range(len(data) // 32 + 1))
    ct = bytes(a ^ b for a, b in zip(data, stream))
    return nonce + ct + hmac.new(mac, nonce + ct, hashlib.sha256).digest()


def _old_token(secret: bytes, token: str) -> str:
    """A hub token as the old server/services/secrets.py stored it in SQL."""
    enc, mac = (hmac.new(secret, label, hashlib.sha256).digest() for label in (b"token-encryption", b"token-mac"))
    return base64.urlsafe_b64encode(_old_seal(enc, mac, token.encode())).decode()


def _old_blob(secret: bytes, purpose: bytes, data: bytes) -> bytes:
    """A blob as the old jobqueue/sealing.py put it on Redis."""
    enc, mac = (hmac.new(secret, purpose + label, hashlib.sha256).digest() for label in (b"/enc", b"/mac"))
    return _old_seal(enc, mac, data)


def _flip(text: str, at: int) -> str:
    raw = bytearray(text.encode())
    raw[at] = ord("A") if raw[at] != ord("A") else ord("B")
    return raw.decode()


def test_secret_file_is_created_once_and_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(data_dir=tmp_path)
    first = load_secret(settings)
    assert len(first) == 32 and load_secret(settings) == first
    assert stat.S_IMODE((tmp_path / "server-secret").stat().st_mode) == 0o600
    shared = load_secret(Settings(data_dir=tmp_path, signing_secret="a shared cluster secret!"))
    assert shared != first
    monkeypatch.delenv("TWINKLE_SIGNING_SECRET", raising=False)
    assert cluster_secret(tmp_path) == first and cluster_secret(tmp_path / "elsewhere") is None
    monkeypatch.setenv("TWINKLE_SIGNING_SECRET", "a shared cluster secret!")
    assert cluster_secret(None) == shared  # a worker derives the gateway's secret the same way
    with pytest.raises(ValueError, match="16"):
        load_secret(Settings(data_dir=tmp_path, signing_secret="short"))


def test_signatures() -> None:
    keys = Keyring(b"k" * 32)
    sig = keys.sign("1|key|file|100")
    assert keys.verify("1|key|file|100", sig)
    assert not keys.verify("1|key|file|101", sig)
    assert not Keyring(b"j" * 32).verify("1|key|file|100", sig)


def test_token_round_trip_tamper_wrong_secret_and_context() -> None:
    keys = Keyring(b"k" * 32)
    sealed = keys.encrypt(TOKEN, "t1/huggingface")
    assert sealed.startswith(PREFIX) and TOKEN not in sealed
    assert keys.encrypt(TOKEN, "t1/huggingface") != sealed  # fresh nonce each time
    assert keys.open_token(sealed, "t1/huggingface") == (TOKEN, False)
    for at in (len(PREFIX) + 2, len(PREFIX) + 20, len(sealed) - 3):  # magic, nonce, tag
        with pytest.raises(SecretError):
            keys.decrypt(_flip(sealed, at), "t1/huggingface")
    with pytest.raises(SecretError):
        Keyring(b"j" * 32).decrypt(sealed, "t1/huggingface")
    with pytest.raises(SecretError):  # bound to its row: another tenant's ciphertext does not open as one's own
        keys.decrypt(sealed, "t2/huggingface")
    with pytest.raises(SecretError):
        keys.decrypt(PREFIX + "not base64!!")
    assert keys.decrypt(keys.encrypt("")) == ""


def test_legacy_token_opens_and_says_so() -> None:
    secret = b"k" * 32
    old = _old_token(secret, TOKEN)
    assert Keyring(secret).open_token(old, "any context") == (TOKEN, True)
    with pytest.raises(SecretError):
        Keyring(secret).decrypt(_flip(old, 30))
    with pytest.raises(SecretError):
        Keyring(b"j" * 32).decrypt(old)


def test_sealer_blobs_new_and_legacy() -> None:
    secret = b"s" * 32
    a, b = Sealer(secret, b"p"), Sealer(b"t" * 32, b"p")
    blob = a.seal(b'{"token": "hf_secret_token"}', aad=b"push-1")
    assert blob.startswith(MAGIC) and b"hf_secret_token" not in blob
    assert a.open(blob, aad=b"push-1").data == b'{"token": "hf_secret_token"}'
    assert not a.open(blob, aad=b"push-1").legacy
    for bad in (lambda: b.unseal(blob, aad=b"push-1"), lambda: a.unseal(blob, aad=b"push-2"),
                lambda: Sealer(secret, b"q").unseal(blob, aad=b"push-1"),
                lambda: a.unseal(blob[:-1] + bytes([blob[-1] ^ 1]), aad=b"push-1"),
                lambda: a.unseal(blob[:20] + bytes([blob[20] ^ 1]) + blob[21:], aad=b"push-1"), lambda: a.unseal(b"")):
        with pytest.raises(SealError):
            bad()
    old = _old_blob(secret, b"p", b"in flight")  # sealed by a gateway of the previous release
    assert a.open(old, aad=b"push-1").data == b"in flight" and a.open(old).legacy
    with pytest.raises(SealError):
        b.unseal(old)
    with pytest.raises(SealError):
        a.unseal(old[:-1] + bytes([old[-1] ^ 1]))
    old_with_magic = MAGIC + old[len(MAGIC):]  # an old blob whose random nonce happens to start like ours
    mac = hmac.new(secret, b"p/mac", hashlib.sha256).digest()
    forged = old_with_magic[:-32] + hmac.new(mac, old_with_magic[:-32], hashlib.sha256).digest()
    assert a.open(forged).legacy and len(a.unseal(forged)) == len(b"in flight")


def _hub_context(**given: Any) -> Context:
    """A Context for the hub push alone (it reads settings, db, keyring and pusher): the rest left unset."""
    unset: dict[str, Any] = {f.name: None for f in fields(Context)
             if f.default is MISSING and f.default_factory is MISSING and f.name not in given}
    return Context(**unset, **given)


def test_legacy_token_in_sql_is_read_and_resealed(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)
    secret = load_secret(settings)
    seen: list[str] = []

    async def pusher(spec: HubPushSpec, progress: Progress) -> HubPushOutcome:
        seen.append(spec.token.get_secret_value())
        return HubPushOutcome(url="https://hub.example/me/run")

    async def main() -> None:
        db = Database(settings.sqlalchemy_url)
        await db.create_schema()
        ctx = _hub_context(settings=settings, db=db, keyring=Keyring(secret), pusher=pusher)
        try:
            old = _old_token(secret, TOKEN)
            async with db.session() as s:
                s.add(TenantRow(id="t1", name="alice"))
                await s.flush()
                s.add(HubTokenRow(tenant_id="t1", provider="huggingface", ciphertext=old))
                for i in (1, 2):
                    s.add(HubPushRow(id=f"p{i}", tenant_id="t1", tinker_path="tinker://m/weights/a", storage_key="k",
                                     provider="huggingface", repo_id="me/run", private=True, status="queued"))
            await hub_push._run(ctx, "p1")
            async with db.session() as s:
                row = await s.get(HubTokenRow, ("t1", "huggingface"))
                push = await s.get(HubPushRow, "p1")
                assert row is not None and push is not None
                new = row.ciphertext
            assert push.status == "succeeded", push.error
            assert seen == [TOKEN]
            assert new != old and new.startswith(PREFIX) and TOKEN not in new  # rewritten in the new format
            assert ctx.keyring is not None
            assert ctx.keyring.open_token(new, "hub-token/t1/huggingface") == (TOKEN, False)
            await hub_push._run(ctx, "p2")  # read again: new format, left as it is
            async with db.session() as s:
                row = await s.get(HubTokenRow, ("t1", "huggingface"))
                assert row is not None and row.ciphertext == new
            assert seen == [TOKEN, TOKEN]
        finally:
            await db.close()

    asyncio.run(main())
