"""API keys are random `tml-` strings shown once; only their SHA-256 is stored (high entropy: no salt needed)."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from sqlalchemy.ext.asyncio import AsyncSession

from server.db import repositories as repo

KEY_PREFIX = "tml-"

SessionFactory = Callable[[], AbstractAsyncContextManager[AsyncSession]]  # Database.session


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyCache:
    """Key hash -> tenant for `ttl` seconds, so the hot path skips one SQL round trip per request.

    A revoked key stops working within `ttl` seconds (documented); unknown keys are not cached.
    """

    def __init__(self, ttl: float, max_entries: int = 10_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: dict[str, tuple[str, float]] = {}

    async def tenant(self, s_factory: SessionFactory, key: str | None) -> str | None:
        if not key or not key.startswith(KEY_PREFIX) or len(key) > 256:
            return None
        digest = hash_key(key)
        hit = self._entries.get(digest)
        now = time.monotonic()
        if hit is not None and hit[1] > now:
            return hit[0]
        async with s_factory() as s:
            row = await repo.active_key_by_hash(s, digest)
        if row is None:
            self._entries.pop(digest, None)
            return None
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        if self.ttl > 0:
            self._entries[digest] = (row.tenant_id, now + self.ttl)
        return row.tenant_id
