"""API keys are random `tml-` strings shown once; only their SHA-256 is stored (high entropy: no salt needed)."""

from __future__ import annotations

import hashlib
import secrets

from sqlalchemy.ext.asyncio import AsyncSession

from server.db import repositories as repo

KEY_PREFIX = "tml-"


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


async def tenant_for_key(s: AsyncSession, key: str | None) -> str | None:
    if not key or not key.startswith(KEY_PREFIX) or len(key) > 256:
        return None
    row = await repo.active_key_by_hash(s, hash_key(key))
    return row.tenant_id if row is not None else None
