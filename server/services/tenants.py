"""Tenants and their API keys (operator side, used by `twinkle-server keys`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime

from server.auth.keys import generate_key, hash_key
from server.db import repositories as repo
from server.db.database import Database
from server.db.models import ApiKeyRow, TenantRow, utcnow
from server.errors import NotFound


@dataclass(frozen=True)
class KeyInfo:
    key_id: int
    tenant: str
    prefix: str
    created_at: datetime
    revoked_at: datetime | None
    admin: bool = False  # an operator's key (the dashboard shows it every tenant)


async def create_key(db: Database, tenant_name: str, admin: bool = False) -> tuple[str, int]:
    """Returns (the new key, shown once; its id). Creates the tenant on first use. An `admin` key is an operator's:
    a key of its tenant like any other, which the dashboard also shows every tenant's runs, keys and usage."""
    key = generate_key()
    async with db.session() as s:
        tenant = await repo.tenant_by_name(s, tenant_name)
        if tenant is None:
            tenant = TenantRow(id=str(uuid.uuid4()), name=tenant_name)
            await repo.add(s, tenant)
        row = ApiKeyRow(tenant_id=tenant.id, key_hash=hash_key(key), prefix=key[:10], admin=admin)
        await repo.add(s, row)
        return key, row.id


async def list_keys(db: Database) -> list[KeyInfo]:
    async with db.session() as s:
        return [KeyInfo(k.id, t.name, k.prefix, k.created_at, k.revoked_at, k.admin) for k, t in await repo.list_keys(s)]


async def revoke(db: Database, key_id: int) -> None:
    async with db.session() as s:
        row = await repo.key_by_id(s, key_id)
        if row is None:
            raise NotFound(f"no key with id {key_id}")
        if row.revoked_at is None:
            row.revoked_at = utcnow()
