"""SQL of custom losses. Every lookup takes the tenant id, so another tenant's loss is never found."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from server.db.models import CustomLossRow, SessionRow
from server.db.repositories import session_ended


async def custom_loss_of(s: AsyncSession, tenant_id: str, loss_id: str) -> CustomLossRow | None:
    row = await s.get(CustomLossRow, loss_id)
    return row if row is not None and row.tenant_id == tenant_id else None


async def custom_loss_by_seq(s: AsyncSession, tenant_id: str, session_id: str, seq_id: int) -> CustomLossRow | None:
    q = select(CustomLossRow).where(CustomLossRow.session_id == session_id, CustomLossRow.seq_id == seq_id,
                                    CustomLossRow.tenant_id == tenant_id)
    return (await s.execute(q)).scalar_one_or_none()


async def count_of_session(s: AsyncSession, session_id: str) -> int:
    q = select(func.count()).select_from(CustomLossRow).where(CustomLossRow.session_id == session_id)
    return int((await s.execute(q)).scalar_one())


async def delete_of_ended_sessions(s: AsyncSession, stale_before: datetime) -> int:
    """Delete the custom losses of sessions that finished or sent no heartbeat since `stale_before`."""
    ended = select(SessionRow.id).where(session_ended(stale_before))
    result = await s.execute(delete(CustomLossRow).where(CustomLossRow.session_id.in_(ended)))
    return int(result.rowcount or 0)  # type: ignore[attr-defined]
