"""Checkpoints: tinker:// paths and storage keys, ownership and publication rules, listing, delete, publish, TTL,
the per-tenant storage quota and the maintenance that expires checkpoints and settles saves nobody collected.

A checkpoint row is owned by one tenant; a published one is readable (load, weights_info, download, copy) by every
tenant but changed (delete, publish, TTL, overwrite) only by its owner. Copies share storage with their source, so
files are removed only when the last row that names them is gone.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from api_schemas.jobs import SaveResult
from api_schemas.tinker.results import SavedAs
from api_schemas.tinker.rest import SEGMENT_TYPES, Checkpoint, CheckpointsListResponse, Cursor
from jobqueue.base import JobState
from jobqueue.storage import CheckpointStorage
from server.db import lifecycle_repo as lrepo
from server.db import repositories as repo
from server.db.models import CheckpointRow, utcnow
from server.errors import BadRequest, DomainError, NotFound
from server.services import audit, jobs
from server.services.context import Context

log = logging.getLogger(__name__)

KINDS = ("weights", "sampler_weights", "external_weights")
SCHEMES = ("tinker://", "twinkle://")
MIN_TTL, MAX_TTL = 3600, 10 * 365 * 24 * 3600


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: str
    name: str

    @classmethod
    def parse(cls, path: str) -> "TinkerPath":
        """`tinker://<run>/<kind>/<name>`; `twinkle://` (twinkle-kit's spelling of the same path) names the same."""
        scheme = next((s for s in SCHEMES if path.startswith(s)), None)
        if scheme is None:
            raise BadRequest(f"{path!r} is not a tinker:// path")
        parts = path[len(scheme) :].split("/")
        if len(parts) != 3 or not all(parts) or parts[1] not in KINDS:
            raise BadRequest(f"{path!r} is not tinker://<run>/<{'|'.join(KINDS)}>/<name>")
        return cls(*parts)


def storage_key(tenant_id: str, model_id: str, kind: str, name: str) -> str:
    return f"{tenant_id}/{model_id}/{kind}/{name}"


def expiry(ttl_seconds: int | None) -> datetime | None:
    if ttl_seconds is None:
        return None
    if not MIN_TTL <= ttl_seconds <= MAX_TTL:
        raise BadRequest(f"ttl_seconds must be between {MIN_TTL} and {MAX_TTL}, or null for no expiry")
    return utcnow() + timedelta(seconds=ttl_seconds)


async def readable(ctx: Context, tenant_id: str, path: str) -> CheckpointRow:
    """A ready checkpoint the tenant owns or that is published; 404 otherwise (no hint that it exists)."""
    p = TinkerPath.parse(path)
    async with ctx.db.session() as s:
        row = await repo.checkpoint(s, p.model_id, p.kind, p.name)
    if row is None or (row.tenant_id != tenant_id and not row.public):
        raise NotFound(f"checkpoint {path} not found")
    if row.status != "ready":
        raise BadRequest(f"checkpoint {path} is not ready (status: {row.status})")
    return row


async def record_result(ctx: Context, request_id: str, result: SaveResult | None) -> SavedAs | None:
    """Called when a save job's result is seen (`result` None: the save failed): the pending row becomes ready (with
    its size). A failed save wrote nothing (writes are atomic): an overwritten checkpoint is ready again as it was, a
    new one is dropped. Returns what the save's answer names: its checkpoint, or the ephemeral sampling session."""
    async with ctx.db.session() as s:
        rows = list(await repo.checkpoints_by_request(s, request_id))
        if not rows and result is not None:
            eph = await repo.sampling_session_by_storage_key(s, result.storage_key)
            return SavedAs(kind="sampler_weights", sampling_session_id=eph.id) if eph is not None else None
    for row in rows:
        if row.status != "pending":
            continue
        files = None if result is not None else await asyncio.to_thread(storage(ctx).files, row.storage_key)
        async with ctx.db.session() as s:
            fresh = await s.get(CheckpointRow, row.id)
            if fresh is None or fresh.status != "pending":
                continue
            if result is not None:
                fresh.status, fresh.size_bytes = "ready", result.size_bytes
            elif files:
                fresh.status, fresh.size_bytes = "ready", sum(files.values())
            else:
                await lrepo.delete_checkpoint(s, fresh)
    if not rows:
        return None
    row = rows[0]
    return SavedAs(kind=row.kind, path=f"tinker://{row.model_id}/{row.kind}/{row.name}")


class QuotaExceeded(DomainError):
    status, category = 403, "user"


class StorageUnavailable(DomainError):
    status, category = 503, "server"


def aware(t: datetime | None) -> datetime | None:
    """SQLite hands datetimes back without a zone; every stored time is UTC."""
    return t.replace(tzinfo=timezone.utc) if t is not None and t.tzinfo is None else t


def to_wire(row: CheckpointRow) -> Checkpoint:
    created = aware(row.created_at)
    assert created is not None
    return Checkpoint(
        checkpoint_id=f"{row.kind}/{row.name}", checkpoint_type=SEGMENT_TYPES[row.kind], time=created,
        tinker_path=row.tinker_path, size_bytes=row.size_bytes, public=row.public,
        user_metadata={str(k): str(v) for k, v in (row.user_metadata or {}).items()} or None,
        expires_at=aware(row.expires_at),
    )


def storage(ctx: Context) -> CheckpointStorage:
    if ctx.storage is None:
        raise StorageUnavailable("checkpoint storage is not configured in this gateway")
    return ctx.storage


async def owned(ctx: Context, tenant_id: str, model_id: str, kind: str, name: str) -> CheckpointRow:
    """The tenant's own checkpoint (any status); 404 for another tenant's, published or not."""
    if kind not in KINDS:
        raise NotFound(f"checkpoint {kind}/{name} not found")
    async with ctx.db.session() as s:
        row = await repo.checkpoint(s, model_id, kind, name)
    if row is None or row.tenant_id != tenant_id:
        raise NotFound(f"checkpoint tinker://{model_id}/{kind}/{name} not found")
    return row


async def list_run(ctx: Context, tenant_id: str, model_id: str) -> CheckpointsListResponse:
    async with ctx.db.session() as s:
        if await repo.model_of(s, tenant_id, model_id) is None:
            raise NotFound(f"training run {model_id} not found")
        rows = await lrepo.checkpoints_of_run(s, model_id)
    return CheckpointsListResponse(checkpoints=[to_wire(r) for r in rows])


async def list_tenant(ctx: Context, tenant_id: str, limit: int, offset: int) -> CheckpointsListResponse:
    async with ctx.db.session() as s:
        rows, total = await lrepo.checkpoints_of_tenant(s, tenant_id, limit, offset)
    return CheckpointsListResponse(
        checkpoints=[to_wire(r) for r in rows], cursor=Cursor(offset=offset, limit=limit, total_count=total)
    )


async def delete(ctx: Context, tenant_id: str, model_id: str, kind: str, name: str) -> None:
    row = await owned(ctx, tenant_id, model_id, kind, name)
    if row.status == "pending":
        raise BadRequest(f"checkpoint {row.tinker_path} is still being saved; delete it once the save has finished")
    await _remove(ctx, row)
    await audit.record(ctx.db, tenant_id, "checkpoint.delete", row.tinker_path)


async def _remove(ctx: Context, row: CheckpointRow) -> None:
    """Delete the row, then its files unless another row (a copy) still names them."""
    async with ctx.db.session() as s:
        fresh = await s.get(CheckpointRow, row.id)
        if fresh is None:
            return
        key = fresh.storage_key
        await lrepo.delete_checkpoint(s, fresh)
        refs = await lrepo.storage_key_refs(s, key)
    if refs == 0:
        await asyncio.to_thread(storage(ctx).delete, key)


async def set_public(ctx: Context, tenant_id: str, model_id: str, kind: str, name: str, public: bool) -> None:
    """Idempotent: publishing a published checkpoint is a success (a 409 would be retried by the SDK for minutes)."""
    row = await owned(ctx, tenant_id, model_id, kind, name)
    if public and row.status != "ready":
        raise BadRequest(f"checkpoint {row.tinker_path} is not ready (status: {row.status})")
    async with ctx.db.session() as s:
        fresh = await s.get(CheckpointRow, row.id)
        if fresh is not None:
            fresh.public = public
        audit.add(s, tenant_id, "checkpoint.publish" if public else "checkpoint.unpublish", row.tinker_path)


async def set_ttl(ctx: Context, tenant_id: str, model_id: str, kind: str, name: str, ttl: int | None) -> None:
    expires = expiry(ttl)
    row = await owned(ctx, tenant_id, model_id, kind, name)
    async with ctx.db.session() as s:
        fresh = await s.get(CheckpointRow, row.id)
        if fresh is not None:
            fresh.expires_at = expires
        audit.add(s, tenant_id, "checkpoint.ttl", f"{row.tinker_path} ttl={ttl}")


async def quota_left(ctx: Context, tenant_id: str, model_id: str, kind: str, name: str) -> int | None:
    """Bytes the tenant may still store (a checkpoint being overwritten does not count); None: no quota.
    Raises QuotaExceeded when even a checkpoint the size of this run's last one of that kind would not fit."""
    quota = ctx.settings.tenant_storage_quota_bytes
    if quota is None:
        return None
    async with ctx.db.session() as s:
        replaced = await repo.checkpoint(s, model_id, kind, name)
        _, used = await lrepo.tenant_usage(s, tenant_id, exclude_id=replaced.id if replaced else None)
        last = await lrepo.latest_checkpoint(s, model_id, kind)
    expected = (last.size_bytes or 0) if last is not None else 0
    if used + max(expected, 1) > quota:
        raise QuotaExceeded(
            f"storage quota exceeded: {used} of {quota} bytes in use"
            + (f" and this run's last {kind} checkpoint took {expected}" if expected else "")
            + "; delete checkpoints (RestClient.delete_checkpoint) to free space"
        )
    return quota - used


async def sweep_expired(ctx: Context) -> int:
    """Delete every checkpoint past its expiry, files and rows; returns how many went."""
    async with ctx.db.session() as s:
        rows = await lrepo.expired_checkpoints(s, utcnow())
    for row in rows:
        try:
            await _remove(ctx, row)
            log.info("checkpoint %s expired and was deleted", row.tinker_path)
        except Exception:  # one broken delete must not stop the sweep
            log.exception("could not delete expired checkpoint %s", row.tinker_path)
    return len(rows)


async def settle_pending(ctx: Context, older_than_seconds: float = 5.0) -> None:
    """Saves whose future nobody retrieved stay pending; settle them from the queue's result or the storage."""
    async with ctx.db.session() as s:
        rows = await repo.pending_checkpoints(s, utcnow() - timedelta(seconds=older_than_seconds))
    for row in rows:
        if not row.request_id:
            continue
        info = await jobs.info(ctx, row.request_id)  # a save held by admission is still queued
        if info is not None and info.state != JobState.DONE:
            continue  # still queued or running
        result = await jobs.wait_result(ctx, row.request_id, 0.01) if info is not None else None
        # without a result (failed, or expired) the files tell whether the save happened
        out = result.output if result is not None and isinstance(result.output, SaveResult) else None
        await record_result(ctx, row.request_id, out)
