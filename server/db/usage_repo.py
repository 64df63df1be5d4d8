"""SQL of usage accounting: the meter's token rows, and the stored bytes and adapter lifetimes reports add."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from sqlalchemy import func, or_, select
from sqlalchemy.ext.asyncio import AsyncSession

from server.db.models import CheckpointRow, ModelRow, TenantRow, UsageRow

TOKEN_COLUMNS = ("tokens_trained", "tokens_forward", "tokens_sampled", "tokens_prefilled")


def aware(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)  # SQLite hands back naive UTC times


def add(s: AsyncSession, tenant_id: str, tokens: dict[str, int]) -> None:
    s.add(UsageRow(tenant_id=tenant_id, **{c: tokens.get(c, 0) for c in TOKEN_COLUMNS}))


async def tenants(s: AsyncSession, name: str | None = None, tenant_id: str | None = None) -> Sequence[TenantRow]:
    q = select(TenantRow).order_by(TenantRow.name)
    if name is not None:
        q = q.where(TenantRow.name == name)
    if tenant_id is not None:
        q = q.where(TenantRow.id == tenant_id)
    return (await s.execute(q)).scalars().all()


async def token_sums(s: AsyncSession, tenant_id: str, since: datetime | None) -> dict[str, int]:
    q = select(*(func.coalesce(func.sum(getattr(UsageRow, c)), 0) for c in TOKEN_COLUMNS)).where(
        UsageRow.tenant_id == tenant_id)
    if since is not None:
        q = q.where(UsageRow.recorded_at >= since)
    row = (await s.execute(q)).one()
    return {c: int(v) for c, v in zip(TOKEN_COLUMNS, row)}


async def storage_bytes(s: AsyncSession, tenant_id: str) -> int:
    """Bytes of the tenant's stored checkpoints now (ready ones; exports included)."""
    q = select(func.coalesce(func.sum(CheckpointRow.size_bytes), 0)).where(
        CheckpointRow.tenant_id == tenant_id, CheckpointRow.status == "ready")
    return int((await s.execute(q)).scalar_one() or 0)


async def adapter_spans(s: AsyncSession, tenant_id: str, since: datetime | None) -> list[tuple[datetime, datetime | None]]:
    """(created, released or None) of the tenant's training runs that lived after `since`."""
    q = select(ModelRow.created_at, ModelRow.released_at).where(ModelRow.tenant_id == tenant_id)
    if since is not None:
        q = q.where(or_(ModelRow.released_at.is_(None), ModelRow.released_at >= since))
    return [(aware(c), aware(r) if r is not None else None) for c, r in (await s.execute(q)).all()]
