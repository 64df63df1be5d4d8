"""SQL of the checkpoint lifecycle: listings with cursors, usage and quota sums, expiry, sessions search, hub pushes.

Like repositories.py, every query of tenant-owned rows takes the tenant id. Kept apart from repositories.py so the
RestClient-side queries stay in one place.
"""

from __future__ import annotations

from datetime import datetime
from typing import Sequence

from sqlalchemy import ColumnElement, Select, delete, exists, func, or_, select, true, update
from sqlalchemy.ext.asyncio import AsyncSession

from server.db.models import (
    AutoPushRow,
    CheckpointRow,
    HubPushRow,
    HubTokenRow,
    ModelRow,
    SamplingSessionRow,
    SessionRow,
)

READY = CheckpointRow.status == "ready"


# --- checkpoints ---
async def checkpoints_of_run(s: AsyncSession, model_id: str) -> Sequence[CheckpointRow]:
    q = select(CheckpointRow).where(CheckpointRow.model_id == model_id, READY)
    return (await s.execute(q.order_by(CheckpointRow.created_at.desc(), CheckpointRow.id.desc()))).scalars().all()


async def checkpoints_of_tenant(
    s: AsyncSession, tenant_id: str, limit: int, offset: int
) -> tuple[Sequence[CheckpointRow], int]:
    where = (CheckpointRow.tenant_id == tenant_id, READY)
    total = int((await s.execute(select(func.count()).select_from(CheckpointRow).where(*where))).scalar_one())
    q = select(CheckpointRow).where(*where).order_by(CheckpointRow.created_at.desc(), CheckpointRow.id.desc())
    return (await s.execute(q.limit(limit).offset(offset))).scalars().all(), total


async def latest_checkpoint(s: AsyncSession, model_id: str, kind: str, public_only: bool = False) -> CheckpointRow | None:
    q = select(CheckpointRow).where(CheckpointRow.model_id == model_id, CheckpointRow.kind == kind, READY)
    if public_only:
        q = q.where(CheckpointRow.public.is_(True))
    q = q.order_by(CheckpointRow.created_at.desc(), CheckpointRow.id.desc()).limit(1)
    return (await s.execute(q)).scalar_one_or_none()


async def tenant_usage(s: AsyncSession, tenant_id: str, exclude_id: int | None = None) -> tuple[int, int]:
    """(checkpoint count, bytes) of the tenant's stored checkpoints; `exclude_id` is one about to be replaced."""
    q = select(func.count(), func.coalesce(func.sum(CheckpointRow.size_bytes), 0)).where(
        CheckpointRow.tenant_id == tenant_id, READY
    )
    if exclude_id is not None:
        q = q.where(CheckpointRow.id != exclude_id)
    count, size = (await s.execute(q)).one()
    return int(count), int(size or 0)


async def storage_key_refs(s: AsyncSession, storage_key: str) -> int:
    q = select(func.count()).select_from(CheckpointRow).where(CheckpointRow.storage_key == storage_key)
    return int((await s.execute(q)).scalar_one())


async def expired_checkpoints(s: AsyncSession, now: datetime, limit: int = 200) -> Sequence[CheckpointRow]:
    q = select(CheckpointRow).where(CheckpointRow.expires_at.is_not(None), CheckpointRow.expires_at <= now)
    return (await s.execute(q.limit(limit))).scalars().all()


async def delete_checkpoint(s: AsyncSession, row: CheckpointRow) -> None:
    await s.delete(row)
    await s.flush()


# --- training runs ---
def _runs_query(tenant_id: str, accessible: bool, project_id: str | None) -> Select[ModelRow]:
    owned = ModelRow.tenant_id == tenant_id
    if accessible:  # plus other tenants' runs that have a published checkpoint
        published = exists().where(CheckpointRow.model_id == ModelRow.id, CheckpointRow.public.is_(True), READY)
        owned = or_(owned, published)
    q = select(ModelRow).where(owned)
    if project_id is not None:
        q = q.join(SessionRow, SessionRow.id == ModelRow.session_id).where(SessionRow.project_id == project_id)
    return q


async def runs(
    s: AsyncSession, tenant_id: str, limit: int, offset: int, accessible: bool, project_id: str | None
) -> tuple[Sequence[ModelRow], int]:
    q = _runs_query(tenant_id, accessible, project_id)
    total = int((await s.execute(select(func.count()).select_from(q.subquery()))).scalar_one())
    q = q.order_by(ModelRow.created_at.desc(), ModelRow.id.desc()).limit(limit).offset(offset)
    return (await s.execute(q)).scalars().all(), total


async def run_visible(s: AsyncSession, tenant_id: str, model_id: str, accessible: bool) -> ModelRow | None:
    q = _runs_query(tenant_id, accessible, None).where(ModelRow.id == model_id)
    return (await s.execute(q)).scalar_one_or_none()


# --- sessions ---
async def session_ids(s: AsyncSession, tenant_id: str, limit: int, offset: int) -> list[str]:
    q = select(SessionRow.id).where(SessionRow.tenant_id == tenant_id)
    q = q.order_by(SessionRow.created_at.desc(), SessionRow.id.desc()).limit(limit).offset(offset)
    return list((await s.execute(q)).scalars().all())


async def run_ids_of_session(s: AsyncSession, session_id: str) -> list[str]:
    q = select(ModelRow.id).where(ModelRow.session_id == session_id).order_by(ModelRow.model_seq_id)
    return list((await s.execute(q)).scalars().all())


async def sampler_ids_of_session(s: AsyncSession, session_id: str) -> list[str]:
    q = select(SamplingSessionRow.id).where(SamplingSessionRow.session_id == session_id)
    return list((await s.execute(q.order_by(SamplingSessionRow.seq_id))).scalars().all())


async def search_sessions(
    s: AsyncSession, tenant_id: str, *, before: tuple[datetime, str] | None, project_ids: list[str] | None,
    session_id: str | None, name_words: list[str], batch: int,
) -> Sequence[SessionRow]:
    """One page of candidates, newest first, after the cursor; the caller applies the JSON-metadata filters."""
    q = select(SessionRow).where(SessionRow.tenant_id == tenant_id)
    if before is not None:
        at, sid = before
        q = q.where(or_(SessionRow.created_at < at, (SessionRow.created_at == at) & (SessionRow.id < sid)))
    if project_ids is not None:
        q = q.where(SessionRow.project_id.in_(project_ids))
    match_name: ColumnElement[bool] = true() if not name_words else SessionRow.display_name.is_not(None)
    for w in name_words:
        match_name = match_name & SessionRow.display_name.ilike(f"%{w}%")
    if session_id is not None:
        q = q.where(or_(SessionRow.id == session_id, match_name) if name_words else SessionRow.id == session_id)
    elif name_words:
        q = q.where(match_name)
    return (await s.execute(q.order_by(SessionRow.created_at.desc(), SessionRow.id.desc()).limit(batch))).scalars().all()


async def session_checkpoint_stats(s: AsyncSession, session_ids: list[str]) -> dict[str, tuple[int, int]]:
    q = (
        select(ModelRow.session_id, func.count(CheckpointRow.id), func.coalesce(func.sum(CheckpointRow.size_bytes), 0))
        .join(CheckpointRow, CheckpointRow.model_id == ModelRow.id)
        .where(ModelRow.session_id.in_(session_ids), READY)
        .group_by(ModelRow.session_id)
    )
    return {sid: (int(n), int(b or 0)) for sid, n, b in (await s.execute(q)).all()}


# --- hub tokens, pushes, auto-push ---
async def hub_token(s: AsyncSession, tenant_id: str, provider: str) -> HubTokenRow | None:
    return await s.get(HubTokenRow, (tenant_id, provider))


async def reseal_hub_token(s: AsyncSession, tenant_id: str, provider: str, old: str, new: str) -> bool:
    """Replaces a token's ciphertext with the same token sealed anew, unless the token was replaced meanwhile."""
    q = update(HubTokenRow).where(HubTokenRow.tenant_id == tenant_id, HubTokenRow.provider == provider,
                                  HubTokenRow.ciphertext == old)
    res = await s.execute(q.values(ciphertext=new))
    return bool(getattr(res, "rowcount", 0))


async def delete_hub_token(s: AsyncSession, tenant_id: str, provider: str) -> bool:
    res = await s.execute(delete(HubTokenRow).where(HubTokenRow.tenant_id == tenant_id, HubTokenRow.provider == provider))
    return bool(getattr(res, "rowcount", 0))


async def push_of(s: AsyncSession, tenant_id: str, push_id: str) -> HubPushRow | None:
    row = await s.get(HubPushRow, push_id)
    return row if row is not None and row.tenant_id == tenant_id else None


async def push_by_id(s: AsyncSession, push_id: str) -> HubPushRow | None:
    return await s.get(HubPushRow, push_id)


async def unfinished_pushes(s: AsyncSession) -> Sequence[HubPushRow]:
    q = select(HubPushRow).where(HubPushRow.status.in_(("queued", "running")))
    return (await s.execute(q)).scalars().all()


async def auto_push_of(s: AsyncSession, tenant_id: str, model_id: str) -> AutoPushRow | None:
    row = await s.get(AutoPushRow, model_id)
    return row if row is not None and row.tenant_id == tenant_id else None


async def due_auto_pushes(s: AsyncSession) -> Sequence[tuple[AutoPushRow, ModelRow]]:
    """Untriggered rules whose run's session has finished."""
    q = (
        select(AutoPushRow, ModelRow)
        .join(ModelRow, ModelRow.id == AutoPushRow.model_id)
        .join(SessionRow, SessionRow.id == ModelRow.session_id)
        .where(AutoPushRow.push_id.is_(None), SessionRow.finished_at.is_not(None))
    )
    return [(a, m) for a, m in (await s.execute(q)).all()]


async def pending_saves_of_run(s: AsyncSession, model_id: str) -> int:
    q = select(func.count()).select_from(CheckpointRow).where(
        CheckpointRow.model_id == model_id, CheckpointRow.status == "pending"
    )
    return int((await s.execute(q)).scalar_one())


async def claim_auto_push(s: AsyncSession, model_id: str, push_id: str) -> bool:
    q = update(AutoPushRow).where(AutoPushRow.model_id == model_id, AutoPushRow.push_id.is_(None))
    res = await s.execute(q.values(push_id=push_id))
    return bool(getattr(res, "rowcount", 0))
