"""SQL of tenant quotas: the per-tenant limits rows, and the live sessions, models and sampling sessions the limits
are checked against."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from server.db.models import ModelRow, SamplingSessionRow, SessionRow, TenantQuotaRow, TenantRow


async def quota_of(s: AsyncSession, tenant_id: str) -> TenantQuotaRow | None:
    return await s.get(TenantQuotaRow, tenant_id)


async def quotas(s: AsyncSession) -> Sequence[tuple[TenantRow, TenantQuotaRow | None]]:
    q = select(TenantRow, TenantQuotaRow).outerjoin(TenantQuotaRow, TenantQuotaRow.tenant_id == TenantRow.id)
    return [(t, r) for t, r in (await s.execute(q.order_by(TenantRow.name))).all()]


async def live_models(s: AsyncSession, tenant_id: str, heartbeat_after: datetime, exclude: str = "") -> int:
    """Training runs of the tenant (other than `exclude`) whose session is neither finished nor timed out."""
    q = (
        select(func.count())
        .select_from(ModelRow)
        .join(SessionRow, SessionRow.id == ModelRow.session_id)
        .where(ModelRow.tenant_id == tenant_id, ModelRow.id != exclude, SessionRow.finished_at.is_(None),
               SessionRow.last_heartbeat_at >= heartbeat_after)
    )
    return int((await s.execute(q)).scalar_one())


async def live_sessions(s: AsyncSession, tenant_id: str, heartbeat_after: datetime) -> int:
    """Sessions of the tenant that are neither finished nor timed out."""
    q = select(func.count()).select_from(SessionRow).where(
        SessionRow.tenant_id == tenant_id, SessionRow.finished_at.is_(None),
        SessionRow.last_heartbeat_at >= heartbeat_after)
    return int((await s.execute(q)).scalar_one())


async def live_sampling_sessions(s: AsyncSession, tenant_id: str, heartbeat_after: datetime) -> int:
    """The tenant's sampling sessions made by create_sampling_session (not the ephemeral ones of
    save_weights_and_get_sampling_client, which a training run keeps a few of) whose session is live."""
    q = (
        select(func.count())
        .select_from(SamplingSessionRow)
        .join(SessionRow, SessionRow.id == SamplingSessionRow.session_id)
        .where(SamplingSessionRow.tenant_id == tenant_id, SamplingSessionRow.ephemeral.is_(False),
               SessionRow.finished_at.is_(None), SessionRow.last_heartbeat_at >= heartbeat_after)
    )
    return int((await s.execute(q)).scalar_one())
