"""Tenants and their API keys (operator side, used by `twinkle-server keys` and `tenants rotate-key`).

Every change sets the key's `changed_at` and writes an audit row in the same transaction; the command then bumps
the cluster's key generation (server/auth/keys.py announce_key_change) so every gateway re-reads the key at once.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from server.auth.keys import generate_key, hash_key
from server.db import repositories as repo
from server.db.database import Database
from server.db.models import ApiKeyRow, TenantRow, utcnow
from server.db.usage_repo import aware
from server.errors import NotFound
from server.services import audit


@dataclass(frozen=True)
class KeyInfo:
    key_id: int
    tenant: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    admin: bool = False  # an operator's key (the dashboard shows it every tenant)
    expires_at: datetime | None = None  # a rotated key's end of grace


async def create_key(db: Database, tenant_name: str, admin: bool = False) -> tuple[str, int]:
    """Returns (the new key, shown once; its id). Creates the tenant on first use. An `admin` key is an operator's:
    a key of its tenant like any other, which the dashboard also shows every tenant's runs, keys and usage."""
    key = generate_key()
    async with db.session() as s:
        tenant = await repo.tenant_by_name(s, tenant_name)
        if tenant is None:
            tenant = TenantRow(id=str(uuid.uuid4()), name=tenant_name)
            await repo.add(s, tenant)
        row = ApiKeyRow(tenant_id=tenant.id, key_hash=hash_key(key), prefix=key[:10], admin=admin,
                        changed_at=utcnow())
        await repo.add(s, row)
        audit.add(s, tenant.id, "key.create", f"key {row.id}")
        return key, row.id


async def rotate_key(db: Database, tenant_name: str, grace: timedelta) -> tuple[str, int, list[int]]:
    """A new key for the tenant (shown once); its keys in use until now keep working for `grace` (0: they stop
    now). Returns (the new key, its id, the rotated keys' ids). The new key is an operator's if one of them was."""
    async with db.session() as s:
        tenant = await repo.tenant_by_name(s, tenant_name)
        if tenant is None:
            raise NotFound(f"no tenant named {tenant_name!r} (create one with `twinkle-server keys create`)")
        now = utcnow()
        ends = now + grace
        old = list(await repo.active_keys_of(s, tenant.id))
        for row in old:
            row.expires_at = ends if row.expires_at is None else min(aware(row.expires_at), ends)
            row.changed_at = now
        key = generate_key()
        new = ApiKeyRow(tenant_id=tenant.id, key_hash=hash_key(key), prefix=key[:10],
                        admin=any(r.admin for r in old), changed_at=now)
        await repo.add(s, new)
        audit.add(s, tenant.id, "key.rotate",
                  f"key {new.id} replaces {', '.join(str(r.id) for r in old) or 'none'} (grace {grace})")
        return key, new.id, [r.id for r in old]


async def list_keys(db: Database) -> list[KeyInfo]:
    async with db.session() as s:
        return [KeyInfo(k.id, t.name, k.prefix, k.created_at, k.revoked_at, k.admin, k.expires_at)
                for k, t in await repo.list_keys(s)]


async def revoke(db: Database, key_id: int) -> None:
    async with db.session() as s:
        row = await repo.key_by_id(s, key_id)
        if row is None:
            raise NotFound(f"no key with id {key_id}")
        if row.revoked_at is None:
            row.revoked_at = row.changed_at = utcnow()
            audit.add(s, row.tenant_id, "key.revoke", f"key {key_id}")
