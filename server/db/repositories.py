"""All SQL of the gateway. Every lookup of a tenant-owned row takes the tenant id, so ownership is never skipped."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import ColumnElement, Table, and_, bindparam, delete, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

from server.db.models import (
    ApiKeyRow,
    CheckpointRow,
    ModelRow,
    NativeAdapterRow,
    NativeSamplerAdapterRow,
    SamplingSessionRow,
    SessionRow,
    TenantRow,
    utcnow,
)


# --- tenants and keys ---
async def tenant_by_name(s: AsyncSession, name: str) -> TenantRow | None:
    return (await s.execute(select(TenantRow).where(TenantRow.name == name))).scalar_one_or_none()


async def add(s: AsyncSession, row: object) -> None:
    s.add(row)
    await s.flush()


def _active() -> Any:
    """Not revoked, and not past a rotation's grace period."""
    return and_(ApiKeyRow.revoked_at.is_(None), or_(ApiKeyRow.expires_at.is_(None), ApiKeyRow.expires_at > utcnow()))


async def active_key_by_hash(s: AsyncSession, key_hash: str) -> ApiKeyRow | None:
    q = select(ApiKeyRow).where(ApiKeyRow.key_hash == key_hash, _active())
    return (await s.execute(q)).scalar_one_or_none()


async def active_keys_of(s: AsyncSession, tenant_id: str) -> Sequence[ApiKeyRow]:
    return (await s.execute(select(ApiKeyRow).where(ApiKeyRow.tenant_id == tenant_id, _active()))).scalars().all()


async def keys_changed_at(s: AsyncSession) -> datetime | None:
    """The newest create, rotate or revoke of any key (server/auth/keys.py SqlGeneration)."""
    return (await s.execute(select(func.max(ApiKeyRow.changed_at)))).scalar_one_or_none()


async def list_keys(s: AsyncSession) -> Sequence[tuple[ApiKeyRow, TenantRow]]:
    q = select(ApiKeyRow, TenantRow).join(TenantRow, TenantRow.id == ApiKeyRow.tenant_id).order_by(ApiKeyRow.id)
    return [(k, t) for k, t in (await s.execute(q)).all()]


async def key_by_id(s: AsyncSession, key_id: int) -> ApiKeyRow | None:
    return await s.get(ApiKeyRow, key_id)


# --- sessions ---
async def session_of(s: AsyncSession, tenant_id: str, session_id: str) -> SessionRow | None:
    row = await s.get(SessionRow, session_id)
    return row if row is not None and row.tenant_id == tenant_id else None


async def touch_session(s: AsyncSession, row: SessionRow) -> None:
    row.last_heartbeat_at = utcnow()


# --- models (training runs) ---
async def model_of(s: AsyncSession, tenant_id: str, model_id: str) -> ModelRow | None:
    row = await s.get(ModelRow, model_id)
    return row if row is not None and row.tenant_id == tenant_id else None


async def model_by_id(s: AsyncSession, model_id: str) -> ModelRow | None:
    return await s.get(ModelRow, model_id)


async def count_session_models(s: AsyncSession, session_id: str) -> int:
    q = select(func.count()).select_from(ModelRow).where(ModelRow.session_id == session_id)
    return int((await s.execute(q)).scalar_one())


# --- native adapters ---
async def native_adapter(s: AsyncSession, tenant_id: str, session_id: str, name: str) -> NativeAdapterRow | None:
    q = select(NativeAdapterRow).where(NativeAdapterRow.session_id == session_id,
                                       NativeAdapterRow.adapter_name == name, NativeAdapterRow.tenant_id == tenant_id)
    return (await s.execute(q)).scalar_one_or_none()


@dataclass(frozen=True)
class NativeState:
    model_id: str
    adapter_name: str
    settings: dict[str, Any]
    progress: dict[str, Any]
    released: bool


_NA: Table = NativeAdapterRow.__table__  # type: ignore[assignment]
# Built once (the native ops run them for every request; building a statement costs more than running it here).
_NATIVE_STATE = (select(_NA.c.model_id, _NA.c.adapter_name, _NA.c.settings, _NA.c.progress, ModelRow.released_at)
                 .join(ModelRow.__table__, ModelRow.id == _NA.c.model_id)
                 .join(SessionRow.__table__, SessionRow.id == _NA.c.session_id)
                 .where(_NA.c.session_id == bindparam("session_id"), _NA.c.adapter_name == bindparam("name"),
                        _NA.c.tenant_id == bindparam("tenant_id"), SessionRow.tenant_id == bindparam("tenant_id"),
                        SessionRow.finished_at.is_(None)))
_TAKE_SEQ = (update(_NA).where(_NA.c.model_id == bindparam("mid")).values(next_seq=_NA.c.next_seq + 1)
             .returning(_NA.c.next_seq))
_WRITE_STATE = update(_NA).where(_NA.c.model_id == bindparam("mid"))


async def native_state(c: AsyncConnection, tenant_id: str, session_id: str, name: str) -> NativeState | None:
    """The tenant's adapter `name` of its unfinished session `session_id` (one Core query)."""
    row = (await c.execute(_NATIVE_STATE, {"session_id": session_id, "name": name, "tenant_id": tenant_id})).first()
    if row is None:
        return None
    return NativeState(row[0], row[1], row[2], row[3], row[4] is not None)


async def take_native_seq(s: AsyncSession | AsyncConnection, model_id: str) -> int:
    """The adapter's next seq_id, counted up in one statement (atomic in SQLite and Postgres alike)."""
    return int((await s.execute(_TAKE_SEQ, {"mid": model_id})).scalar_one()) - 1


async def update_native_adapter(s: AsyncSession | AsyncConnection, model_id: str, *, settings: dict,
                                progress: dict) -> None:
    await s.execute(_WRITE_STATE, {"mid": model_id, "settings": dict(settings), "progress": dict(progress)})


# --- native sampler adapters (add_adapter_to_sampler) ---
async def sampler_adapter(s: AsyncSession, tenant_id: str, session_id: str, base_model: str,
                          name: str) -> NativeSamplerAdapterRow | None:
    row = await s.get(NativeSamplerAdapterRow, (session_id, base_model, name))
    return row if row is not None and row.tenant_id == tenant_id else None


async def count_sampler_adapters(s: AsyncSession, session_id: str) -> int:
    row = NativeSamplerAdapterRow
    q = select(func.count()).select_from(row).where(row.session_id == session_id)
    return int((await s.execute(q)).scalar_one())


async def delete_sampler_adapters_of_ended_sessions(s: AsyncSession, stale_before: datetime) -> int:
    """Delete the sampler adapters of sessions that finished or sent no heartbeat since `stale_before`."""
    ended = select(SessionRow.id).where(session_ended(stale_before))
    result = await s.execute(delete(NativeSamplerAdapterRow).where(NativeSamplerAdapterRow.session_id.in_(ended)))
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


# --- checkpoints ---
async def checkpoint(s: AsyncSession, model_id: str, kind: str, name: str) -> CheckpointRow | None:
    q = select(CheckpointRow).where(
        CheckpointRow.model_id == model_id, CheckpointRow.kind == kind, CheckpointRow.name == name
    )
    return (await s.execute(q)).scalar_one_or_none()


async def checkpoints_by_request(s: AsyncSession, request_id: str) -> Sequence[CheckpointRow]:
    return (await s.execute(select(CheckpointRow).where(CheckpointRow.request_id == request_id))).scalars().all()


async def pending_checkpoints(s: AsyncSession, older_than: datetime) -> Sequence[CheckpointRow]:
    q = select(CheckpointRow).where(CheckpointRow.status == "pending", CheckpointRow.created_at < older_than)
    return (await s.execute(q)).scalars().all()


async def count_models(s: AsyncSession, tenant_id: str) -> int:
    return int((await s.execute(select(func.count()).where(ModelRow.tenant_id == tenant_id))).scalar_one())


async def count_live_models(s: AsyncSession, tenant_id: str) -> int:
    q = select(func.count()).where(ModelRow.tenant_id == tenant_id, ModelRow.released_at.is_(None))
    return int((await s.execute(q)).scalar_one())


# --- sampling sessions ---
async def sampling_session_of(s: AsyncSession, tenant_id: str, sampling_session_id: str) -> SamplingSessionRow | None:
    row = await s.get(SamplingSessionRow, sampling_session_id)
    return row if row is not None and row.tenant_id == tenant_id else None


async def sampling_session_by_id(s: AsyncSession, sampling_session_id: str) -> SamplingSessionRow | None:
    return await s.get(SamplingSessionRow, sampling_session_id)


async def sampling_session_by_storage_key(s: AsyncSession, storage_key: str) -> SamplingSessionRow | None:
    q = select(SamplingSessionRow).where(SamplingSessionRow.storage_key == storage_key).limit(1)
    return (await s.execute(q)).scalars().first()


async def ephemeral_sampling_sessions(s: AsyncSession) -> Sequence[tuple[SamplingSessionRow, SessionRow]]:
    """Every ephemeral sampling session with its client session, newest first."""
    q = (
        select(SamplingSessionRow, SessionRow)
        .join(SessionRow, SessionRow.id == SamplingSessionRow.session_id)
        .where(SamplingSessionRow.ephemeral.is_(True))
        .order_by(SamplingSessionRow.created_at.desc(), SamplingSessionRow.seq_id.desc())
    )
    return [(a, b) for a, b in (await s.execute(q)).all()]


async def delete_sampling_session(s: AsyncSession, sampling_session_id: str) -> None:
    row = await s.get(SamplingSessionRow, sampling_session_id)
    if row is not None:
        await s.delete(row)


async def sampler_checkpoints_of(s: AsyncSession, tenant_id: str) -> Sequence[CheckpointRow]:
    q = select(CheckpointRow).where(
        CheckpointRow.tenant_id == tenant_id, CheckpointRow.kind == "sampler_weights", CheckpointRow.status == "ready"
    ).order_by(CheckpointRow.id)
    return (await s.execute(q)).scalars().all()


def session_ended(stale_before: datetime) -> ColumnElement[bool]:
    """SQL condition on SessionRow: the session finished, or sent no heartbeat since `stale_before`."""
    return or_(SessionRow.finished_at.is_not(None), SessionRow.last_heartbeat_at < stale_before)


async def expire_sessions(s: AsyncSession, stale_before: datetime, now: datetime, reason: str) -> int:
    """Finish every unfinished session whose last heartbeat is older than `stale_before`."""
    q = (update(SessionRow).where(SessionRow.finished_at.is_(None), SessionRow.last_heartbeat_at < stale_before)
         .values(finished_at=now, finish_reason=reason, finish_detail="no heartbeat within the session timeout")
         .returning(SessionRow.id))
    return len((await s.execute(q)).scalars().all())


async def live_session_ids(s: AsyncSession, session_ids: set[str], stale_before: datetime) -> set[str]:
    """Those of `session_ids` that have not ended (see session_ended)."""
    q = select(SessionRow.id).where(SessionRow.id.in_(session_ids), ~session_ended(stale_before))
    return set((await s.execute(q)).scalars().all())


async def models_to_release(s: AsyncSession, stale_before: datetime, limit: int,
                            lease_before: datetime | None = None) -> Sequence[ModelRow]:
    """Unreleased models whose client session has ended, or (full-parameter runs) created before `lease_before`."""
    ended: ColumnElement[bool] = session_ended(stale_before)
    if lease_before is not None:
        ended = or_(ended, and_(ModelRow.full_param.is_(True), ModelRow.created_at < lease_before))
    q = (
        select(ModelRow)
        .join(SessionRow, SessionRow.id == ModelRow.session_id)
        .where(ModelRow.released_at.is_(None), ended)
        .order_by(ModelRow.created_at)
        .limit(limit)
    )
    return (await s.execute(q)).scalars().all()


async def live_full_runs(s: AsyncSession, base_model: str, stale_before: datetime, lease_before: datetime,
                         exclude: str = "") -> int:
    """Full-parameter runs of `base_model` (other than `exclude`) holding a lease: not released, their session
    live, created after `lease_before`."""
    q = (
        select(func.count())
        .select_from(ModelRow)
        .join(SessionRow, SessionRow.id == ModelRow.session_id)
        .where(ModelRow.full_param.is_(True), ModelRow.base_model == base_model, ModelRow.id != exclude,
               ModelRow.released_at.is_(None), ~session_ended(stale_before), ModelRow.created_at >= lease_before)
    )
    return int((await s.execute(q)).scalar_one())


async def mark_released(s: AsyncSession, model_id: str, when: datetime) -> None:
    row = await s.get(ModelRow, model_id)
    if row is not None and row.released_at is None:
        row.released_at = when
