"""Training runs as the RestClient sees them: list (with a cursor) and get, weights_info, copy_weights, and the
tenant's checkpoint storage usage.

`access_scope="accessible"` adds other tenants' runs that have a published checkpoint; everything else is the
tenant's own. A copy lives in a new training run of a new (finished) session: its files are copied, so the copy
stays as it was when the source is overwritten or deleted, and it cannot be trained on (no adapter exists for it).
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from typing import Literal

from api_schemas.tinker.rest import (
    CopyWeightsRequest,
    Cursor,
    StorageUsage,
    StorageUsageResponse,
    TrainingRun,
    TrainingRunsResponse,
    WeightsInfoResponse,
)
from jobqueue.storage import CheckpointStorage
from server.db import lifecycle_repo as lrepo
from server.db import repositories as repo
from server.db.models import CheckpointRow, ModelRow, SessionRow, utcnow
from server.errors import BadRequest, NotFound
from server.services import checkpoints as ckpt
from server.services.context import Context
from server.services.models import model_id_for
from server.services.sessions import live_session

Scope = Literal["owned", "accessible"]
_COPY_NAMESPACE = uuid.UUID("9b7c1f0e-2f55-4f0c-9d7e-6a1c1e0d2b11")


def owner_urn(tenant_id: str) -> str:
    return f"twinkle:tenant:{tenant_id}"


async def _to_wire(ctx: Context, row: ModelRow, viewer: str) -> TrainingRun:
    """Another tenant's run (accessible through a published checkpoint) shows only published checkpoints and no
    user metadata."""
    other = row.tenant_id != viewer
    async with ctx.db.session() as s:
        last = await lrepo.latest_checkpoint(s, row.id, "weights", public_only=other)
        last_sampler = await lrepo.latest_checkpoint(s, row.id, "sampler_weights", public_only=other)
    owner_view = {} if other else {str(k): str(v) for k, v in (row.user_metadata or {}).items()}
    last_request = ckpt.aware(row.last_request_at) or ckpt.aware(row.created_at)
    assert last_request is not None
    return TrainingRun(
        training_run_id=row.id, base_model=row.base_model, model_owner=owner_urn(row.tenant_id),
        is_lora=not row.full_param, lora_rank=None if row.full_param else row.lora_rank, last_request_time=last_request,
        last_checkpoint=ckpt.to_wire(last) if last is not None else None,
        last_sampler_checkpoint=ckpt.to_wire(last_sampler) if last_sampler is not None else None,
        user_metadata=owner_view or None,
    )


async def list_runs(
    ctx: Context, tenant_id: str, limit: int, offset: int, scope: Scope, project_id: str | None
) -> TrainingRunsResponse:
    async with ctx.db.session() as s:
        rows, total = await lrepo.runs(s, tenant_id, limit, offset, scope == "accessible", project_id)
    return TrainingRunsResponse(
        training_runs=[await _to_wire(ctx, r, tenant_id) for r in rows],
        cursor=Cursor(offset=offset, limit=limit, total_count=total),
    )


async def get_run(ctx: Context, tenant_id: str, model_id: str, scope: Scope) -> TrainingRun:
    async with ctx.db.session() as s:
        row = await lrepo.run_visible(s, tenant_id, model_id, scope == "accessible")
    if row is None:
        raise NotFound(f"training run {model_id} not found")
    return await _to_wire(ctx, row, tenant_id)


async def weights_info(ctx: Context, tenant_id: str, tinker_path: str) -> WeightsInfoResponse:
    source = await ckpt.readable(ctx, tenant_id, tinker_path)
    async with ctx.db.session() as s:
        run = await repo.model_by_id(s, source.model_id)
    if run is None:
        raise NotFound(f"checkpoint {tinker_path} not found")
    return WeightsInfoResponse(
        base_model=run.base_model, is_lora=not run.full_param,
        lora_rank=None if run.full_param else run.lora_rank, optimizer_config={"type": run.optimizer},
        train_unembed=run.train_unembed, train_mlp=run.train_mlp, train_attn=run.train_attn,
    )


async def copy_weights(ctx: Context, tenant_id: str, req: CopyWeightsRequest, idempotency_key: str | None) -> str:
    source = await ckpt.readable(ctx, tenant_id, req.source_path)
    expires = ckpt.expiry(req.ttl_seconds)
    if req.session_id is not None and req.model_seq_id is not None:
        await live_session(ctx, tenant_id, req.session_id)
        session_id, seq = req.session_id, req.model_seq_id
    elif req.destination_project_id is not None:
        token = f"{tenant_id}:{idempotency_key}" if idempotency_key else str(uuid.uuid4())
        session_id, seq = str(uuid.uuid5(_COPY_NAMESPACE, token)), 0  # a retried copy lands on the same run
    else:
        raise BadRequest("copy_weights needs destination_project_id, or session_id with model_seq_id")
    model_id = model_id_for(session_id, seq)
    copy_path = f"tinker://{model_id}/{source.kind}/{source.name}"
    async with ctx.db.session() as s:
        existing = await repo.model_by_id(s, model_id)
        if existing is not None:
            if existing.tenant_id != tenant_id or await repo.checkpoint(s, model_id, source.kind, source.name) is None:
                raise BadRequest(f"training run slot {model_id} is already taken")
            return copy_path
        origin = await repo.model_by_id(s, source.model_id)
        _, used = await lrepo.tenant_usage(s, tenant_id)
    quota = ctx.settings.tenant_storage_quota_bytes
    if quota is not None and used + (source.size_bytes or 0) > quota:
        raise ckpt.QuotaExceeded(f"storage quota exceeded: {used} of {quota} bytes in use, the copy needs "
                                 f"{source.size_bytes}")
    assert origin is not None
    key = ckpt.storage_key(tenant_id, model_id, source.kind, source.name)
    await asyncio.to_thread(_copy_files, ckpt.storage(ctx), source.storage_key, key)
    async with ctx.db.session() as s:
        if await s.get(SessionRow, session_id) is None:
            now = utcnow()
            s.add(SessionRow(id=session_id, tenant_id=tenant_id, project_id=req.destination_project_id,
                             display_name=f"copy of {req.source_path}", tags=["copy"], user_metadata={},
                             finished_at=now, finish_reason="success", finish_detail="created by copy_weights"))
            await s.flush()
        await repo.add(s, ModelRow(
            id=model_id, tenant_id=tenant_id, session_id=session_id, model_seq_id=seq, base_model=origin.base_model,
            lora_rank=origin.lora_rank, full_param=origin.full_param, seed=origin.seed, train_attn=origin.train_attn,
            train_mlp=origin.train_mlp, train_unembed=origin.train_unembed, optimizer=origin.optimizer,
            create_request_id="", user_metadata={"copied_from": req.source_path},
        ))
        await repo.add(s, CheckpointRow(
            tenant_id=tenant_id, model_id=model_id, kind=source.kind, name=source.name, storage_key=key,
            request_id="", status="ready", size_bytes=source.size_bytes, expires_at=expires,
            user_metadata=dict(source.user_metadata or {}),
        ))
    return copy_path


def _copy_files(store: CheckpointStorage, src: str, dst: str) -> None:
    folder = store.existing(src)
    if folder is None:
        raise NotFound("the source checkpoint's files are gone (deleted or expired)")
    with store.writing(dst) as out:
        shutil.copytree(folder, out, dirs_exist_ok=True)


async def storage_usage(ctx: Context, tenant_id: str) -> StorageUsageResponse:
    async with ctx.db.session() as s:
        count, size = await lrepo.tenant_usage(s, tenant_id)
    return StorageUsageResponse(data=[StorageUsage(
        checkpoint_count=count, size_bytes=size, size_gigabytes=size / 1e9, org_user_urn=owner_urn(tenant_id),
    )])
