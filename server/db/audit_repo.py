"""SQL of the audit log (server/services/audit.py): append a row, read rows with their tenant's name."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from server.db.models import AuditRow, TenantRow


def add(s: AsyncSession, row: AuditRow) -> None:
    s.add(row)


async def newest(s: AsyncSession, tenant: str | None, since: datetime | None, action: str | None,
                 limit: int) -> Sequence[tuple[AuditRow, str | None]]:
    """The newest `limit` rows, newest first, with the tenant's name; `action` ending in `*` is a prefix."""
    q = select(AuditRow, TenantRow.name).outerjoin(TenantRow, TenantRow.id == AuditRow.tenant_id)
    if tenant is not None:
        q = q.where(TenantRow.name == tenant)
    if since is not None:
        q = q.where(AuditRow.at >= since)
    if action is not None:
        q = q.where(AuditRow.action.startswith(action[:-1]) if action.endswith("*") else AuditRow.action == action)
    return (await s.execute(q.order_by(AuditRow.id.desc()).limit(limit))).tuples().all()
