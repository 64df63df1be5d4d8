"""API keys are random `tml-` strings shown once; only their SHA-256 is stored (high entropy: no salt needed).

The gateway caches key hash -> (tenant, key id) so the hot path skips one SQL round trip per request. A cached
entry is used only while the *key generation* it was read under is still current, so a key change (revoke,
rotate: server/services/tenants.py) applies on every gateway without waiting for the cache to expire. Each gateway
re-reads the generation at most every `auth_check_seconds`, and the key commands wait that long after their change
before they return (`announce_key_change`), so a revoked key answers 401 on every gateway by the time `keys revoke`
returns:

- cluster mode (Redis): the generation is a Redis counter (`Keys.auth_generation`) that the key commands
  increment after their SQL commit;
- embedded mode (no Redis; the key commands run in another process): the generation is the newest
  `api_keys.changed_at`, read from SQL.

A rotated key's grace period ends on its own: the entry carries the key's `expires_at` and is checked against the
clock on every use. `ttl` (auth_cache_seconds) stays the bound when the generation cannot be read or bumped.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Protocol

from sqlalchemy.ext.asyncio import AsyncSession

from server.auth.rate_limits import RequestLimiter
from server.db import repositories as repo
from server.db.usage_repo import aware
from server.services.audit import KeyUse

KEY_PREFIX = "tml-"

SessionFactory = Callable[[], AbstractAsyncContextManager[AsyncSession]]  # Database.session


def generate_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class Caller:
    """Who a request's key belongs to: never the key itself."""

    tenant_id: str
    key_id: int


class Generation(Protocol):
    async def current(self, s_factory: SessionFactory) -> object: ...


@dataclass(frozen=True)
class SharedAuth:
    """What every gateway of a cluster shares: the key generation and the per-tenant request buckets (both in the
    queue's Redis; deploy/cluster.py builds it)."""

    generation: Generation
    limiter: RequestLimiter


class PolledGeneration:
    """A key generation re-read at most every `every` seconds by `read`. A read's time is taken before it starts, so
    a value read before a key change is used for less than `every` seconds after that change. A read that fails
    (Redis away) gives a value that matches no cached entry, so SQL answers, and is tried again on the next use."""

    def __init__(self, every: float, read: Callable[[SessionFactory], Awaitable[object]]) -> None:
        self.every, self._read = every, read
        self._value: object = None
        self._read_at = float("-inf")

    async def current(self, s_factory: SessionFactory) -> object:
        started = time.monotonic()
        if started - self._read_at < self.every:
            return self._value
        try:
            value = await self._read(s_factory)
        except Exception:
            return object()
        if started >= self._read_at:  # a slower read that started earlier never replaces a newer one
            self._value, self._read_at = value, started
        return value


def redis_generation(client: Any, name: str, every: float) -> PolledGeneration:
    """The cluster's key generation: a Redis counter."""
    async def read(_: SessionFactory) -> object:
        return await client.get(name)
    return PolledGeneration(every, read)


def sql_generation(every: float) -> PolledGeneration:
    """One gateway's key generation without Redis: the newest `api_keys.changed_at`."""
    async def read(s_factory: SessionFactory) -> object:
        async with s_factory() as s:
            return await repo.keys_changed_at(s)
    return PolledGeneration(every, read)


@dataclass(frozen=True)
class _Entry:
    caller: Caller
    until: float  # monotonic: the cache's ttl
    expires: float | None  # wall clock (epoch seconds): a rotated key's end of grace
    generation: object


class KeyCache:
    """`uses`: where a key's first use in each window is recorded (server/services/audit.py), None: not recorded."""

    def __init__(self, ttl: float, generation: Generation | None = None, uses: KeyUse | None = None,
                 max_entries: int = 10_000) -> None:
        self.ttl = ttl
        self.generation = generation
        self.uses = uses
        self.max_entries = max_entries
        self._entries: dict[str, _Entry] = {}

    async def caller(self, s_factory: SessionFactory, key: str | None) -> Caller | None:
        """The key's tenant and id, or None for a missing, unknown, revoked or expired key."""
        if not key or not key.startswith(KEY_PREFIX) or len(key) > 256:
            return None
        digest = hash_key(key)
        hit = self._entries.get(digest)
        generation = await self.generation.current(s_factory) if self.generation is not None else None
        if hit is not None and hit.until > time.monotonic() and hit.generation == generation:
            if hit.expires is None or time.time() < hit.expires:
                return hit.caller
        async with s_factory() as s:
            row = await repo.active_key_by_hash(s, digest)
        if row is None:
            self._entries.pop(digest, None)
            return None
        found = Caller(row.tenant_id, row.id)
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        if self.ttl > 0:
            expires = aware(row.expires_at).timestamp() if row.expires_at is not None else None
            self._entries[digest] = _Entry(found, time.monotonic() + self.ttl, expires, generation)
        return found

    async def tenant(self, s_factory: SessionFactory, key: str | None) -> str | None:
        found = await self.caller(s_factory, key)
        return found.tenant_id if found is not None else None


async def announce_key_change(redis_url: str | None, prefix: str, check_seconds: float) -> bool:
    """After a key change is committed to SQL: bump the cluster's key generation (without Redis the SQL change is
    the new generation), then wait until every gateway has read it (`check_seconds`: auth_check_seconds). False
    when Redis could not be reached (gateways then notice within auth_cache_seconds)."""
    bumped = True
    if redis_url:
        import redis.asyncio as aioredis

        from jobqueue.keys import Keys

        client = aioredis.Redis.from_url(redis_url)
        try:
            await client.incr(Keys(prefix).auth_generation)
        except Exception:
            bumped = False
        finally:
            await client.aclose()
    if bumped:
        await asyncio.sleep(check_seconds)
    return bumped
