"""SQL of custom losses. Every lookup takes the tenant id, so another tenant's loss is never found."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from server.db.models import CustomLossRow


async def custom_loss_of(s: AsyncSession, tenant_id: str, loss_id: str) -> CustomLossRow | None:
    row = await s.get(CustomLossRow, loss_id)
    return row if row is not None and row.tenant_id == tenant_id else None


async def custom_loss_by_seq(s: AsyncSession, tenant_id: str, session_id: str, seq_id: int) -> CustomLossRow | None:
    q = select(CustomLossRow).where(CustomLossRow.session_id == session_id, CustomLossRow.seq_id == seq_id,
                                    CustomLossRow.tenant_id == tenant_id)
    return (await s.execute(q)).scalar_one_or_none()
