"""Sampling sessions and sample requests: which immutable weights a SamplingClient samples, and queueing its jobs.

A sampling session is made from a tinker:// checkpoint path (the tenant's own or a published one), from a base
model alone, or by an ephemeral save_weights_for_sampler (save_weights_and_get_sampling_client). It records the
storage key and a weight *version*; the sampler caches adapters by that version, so a session keeps sampling the
weights it was created from whatever the tenant saves later. Sample jobs travel in the base model's "sample" lane.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import timedelta

from api_schemas.jobs import Payload, Sample, SaveWeights, WeightsRef
from api_schemas.tinker.sampling import (
    CreateSamplingSessionRequest,
    GetSamplerResponse,
    SampleFuture,
    SampleRequest,
)
from api_schemas.tinker.types import SaveWeightsForSamplerRequest, UntypedFuture
from server.db import repositories as repo
from server.db.models import CheckpointRow, ModelRow, SamplingSessionRow, utcnow
from server.errors import BadRequest, NotFound
from server.services import checkpoints as ckpt
from server.services import jobs
from server.services.context import Context
from server.services.sample_validation import sample_payload
from server.services.sessions import live_session
from server.services.tenant_caps import check_room

# Ephemeral weights kept per training run while its session lives: an RL loop saves every step, and a sampler a few
# steps stale (async RL) must keep working; older ones are reclaimed (their clients then get 404).
EPHEMERAL_KEEP_PER_RUN = 16

log = logging.getLogger(__name__)

def sampling_session_id_for(session_id: str, seq_id: int) -> str:
    return f"{session_id}:sample:{seq_id}"


def checkpoint_version(row: CheckpointRow) -> str:
    """Changes whenever the checkpoint's files are written again (each save has its own request id)."""
    return f"ckpt:{row.id}:{row.request_id}"


def weights_of(row: SamplingSessionRow) -> WeightsRef | None:
    if row.storage_key is None or row.weights_version is None:
        return None
    return WeightsRef(storage_key=row.storage_key, version=row.weights_version)


async def owned_sampler(ctx: Context, tenant_id: str, sampling_session_id: str) -> SamplingSessionRow:
    async with ctx.db.session() as s:
        row = await repo.sampling_session_of(s, tenant_id, sampling_session_id)
    if row is None:
        raise NotFound(f"sampling session {sampling_session_id} not found")
    return row


async def resolve_path(ctx: Context, tenant_id: str, path: str) -> tuple[str, str, WeightsRef]:
    """(base model, training run, weights) of a readable tinker:// checkpoint path; 404 if not the tenant's."""
    row = await ckpt.readable(ctx, tenant_id, path)
    if row.kind == "external_weights":
        raise BadRequest("external_weights exports cannot be sampled; use a sampler_weights/ or weights/ path")
    async with ctx.db.session() as s:
        origin = await repo.model_by_id(s, row.model_id)
    if origin is None:
        raise NotFound(f"checkpoint {path} not found")
    return origin.base_model, origin.id, WeightsRef(storage_key=row.storage_key, version=checkpoint_version(row))


async def create_sampling_session(ctx: Context, tenant_id: str, req: CreateSamplingSessionRequest) -> str:
    await live_session(ctx, tenant_id, req.session_id)
    sid = sampling_session_id_for(req.session_id, req.sampling_session_seq_id)
    async with ctx.db.session() as s:
        existing = await repo.sampling_session_by_id(s, sid)
    if existing is not None:  # a retry of the same create
        if existing.tenant_id != tenant_id:
            raise NotFound(f"session {req.session_id} not found")
        if existing.model_path != req.model_path or (req.base_model and existing.base_model != req.base_model):
            raise BadRequest(f"sampling_session_seq_id {req.sampling_session_seq_id} was already used differently")
        return sid
    weights: WeightsRef | None = None
    source: str | None = None
    if req.model_path:
        base_model, source, weights = await resolve_path(ctx, tenant_id, req.model_path)
        if req.base_model is not None and req.base_model != base_model:
            raise BadRequest(f"{req.model_path} was trained on {base_model}, not {req.base_model}")
    elif req.base_model:
        base_model = req.base_model
    else:
        raise BadRequest("create_sampling_session needs a model_path or a base_model")
    served = ctx.served(base_model)
    await check_room(ctx, tenant_id, "sampling_sessions")
    row = SamplingSessionRow(
        id=sid, tenant_id=tenant_id, session_id=req.session_id, seq_id=req.sampling_session_seq_id,
        base_model=served.name, model_path=req.model_path, storage_key=weights.storage_key if weights else None,
        weights_version=weights.version if weights else None, source_model_id=source, ephemeral=False,
    )
    async with ctx.db.session() as s:
        await repo.add(s, row)
    return sid


async def get_sampler(ctx: Context, tenant_id: str, sampling_session_id: str) -> GetSamplerResponse:
    row = await owned_sampler(ctx, tenant_id, sampling_session_id)
    return GetSamplerResponse(sampler_id=row.id, base_model=row.base_model, model_path=row.model_path)


async def save_ephemeral(ctx: Context, tenant_id: str, model: ModelRow,
                         req: SaveWeightsForSamplerRequest) -> UntypedFuture:
    """save_weights_for_sampler without a name: save under a fresh key and open a sampling session on it.
    The save runs in the model's seq_id order like any training operation; its result names the session."""
    first = await jobs.request_at(ctx, model.id, req.seq_id)
    if first is not None:  # a retry (the SDK draws a new sampling_session_seq_id): the first save's future
        return UntypedFuture(request_id=first, model_id=model.id)

    async def build() -> Payload:
        if req.sampling_session_seq_id is None:
            raise BadRequest("save_weights_for_sampler needs a path or a sampling_session_seq_id")
        if req.kind not in ("snapshot", "inflight"):
            raise BadRequest(f"unknown sampling client kind {req.kind!r}")
        sid = sampling_session_id_for(model.session_id, req.sampling_session_seq_id)
        key = ckpt.storage_key(tenant_id, model.id, "ephemeral", str(req.sampling_session_seq_id))
        async with ctx.db.session() as s:
            if await repo.sampling_session_by_id(s, sid) is not None:
                raise BadRequest(f"sampling_session_seq_id {req.sampling_session_seq_id} was already used")
            await repo.add(s, SamplingSessionRow(
                id=sid, tenant_id=tenant_id, session_id=model.session_id, seq_id=req.sampling_session_seq_id,
                base_model=model.base_model, model_path=None, storage_key=key, weights_version=f"eph:{uuid.uuid4()}",
                source_model_id=model.id, ephemeral=True,
            ))
        return SaveWeights(storage_key=key, with_optimizer=False)

    return await jobs.queue_op(ctx, tenant_id, model, req.seq_id, build)


async def asample(ctx: Context, tenant_id: str, req: SampleRequest) -> SampleFuture:
    if req.sampling_session_id is None or req.seq_id is None:
        raise BadRequest("asample needs a sampling_session_id and a seq_id (create a sampling session first)")
    row = await owned_sampler(ctx, tenant_id, req.sampling_session_id)
    served = ctx.served(row.base_model)
    payload = sample_payload(req, served, ctx.settings, weights_of(row))
    await check_still_there(ctx, row)
    return await submit_sample(ctx, tenant_id, row.id, row.base_model, req.seq_id, payload)


async def check_still_there(ctx: Context, row: SamplingSessionRow) -> None:
    """A session made from a checkpoint path samples those exact files: if the checkpoint was deleted or saved again
    under the same name since, say so rather than serve other weights."""
    if row.ephemeral or row.model_path is None or row.weights_version is None:
        return
    p = ckpt.TinkerPath.parse(row.model_path)
    async with ctx.db.session() as s:
        current = await repo.checkpoint(s, p.model_id, p.kind, p.name)
    if current is None:
        raise NotFound(f"{row.model_path} was deleted; this sampling session cannot sample any more")
    if checkpoint_version(current) != row.weights_version:
        raise BadRequest(f"{row.model_path} was saved again since this sampling session was created; create a new "
                         "sampling client to sample the new weights")


async def submit_sample(ctx: Context, tenant_id: str, sampler_id: str, base_model: str, seq_id: int,
                        payload: Sample) -> SampleFuture:
    """Queue one sample job in the sample lane, idempotent on (sampling session, seq_id)."""
    request_id = await jobs.queue_sample(ctx, tenant_id=tenant_id, base_model=base_model, sampler_id=sampler_id,
                                         seq_id=seq_id, payload=payload)
    n = payload.num_samples
    return SampleFuture(request_id=request_id, sample_sequence_ids=[f"{sampler_id}:{seq_id}:{i}" for i in range(n)])


async def reclaim_ephemeral(ctx: Context) -> int:
    """Maintenance step: delete the files and rows of ephemeral sampling sessions that nobody can use any more,
    those of finished or timed-out client sessions, and all but the newest EPHEMERAL_KEEP_PER_RUN of a training run.
    Returns how many went."""
    if ctx.storage is None:
        return 0
    stale_before = utcnow() - timedelta(seconds=ctx.settings.session_timeout_seconds)
    async with ctx.db.session() as s:
        rows = await repo.ephemeral_sampling_sessions(s)
    kept: dict[str | None, int] = {}
    doomed: list[SamplingSessionRow] = []
    for row, session in rows:
        heartbeat = session.last_heartbeat_at
        if heartbeat.tzinfo is None:  # SQLite returns naive datetimes (stored as UTC)
            heartbeat = heartbeat.replace(tzinfo=stale_before.tzinfo)
        if session.finished_at is not None or heartbeat < stale_before:
            doomed.append(row)
            continue
        kept[row.source_model_id] = kept.get(row.source_model_id, 0) + 1
        if kept[row.source_model_id] > EPHEMERAL_KEEP_PER_RUN:
            doomed.append(row)
    for row in doomed:
        try:
            if row.storage_key is not None:
                await asyncio.to_thread(ctx.storage.delete, row.storage_key)
            async with ctx.db.session() as s:
                await repo.delete_sampling_session(s, row.id)
        except Exception:  # one broken delete must not stop the others
            log.exception("could not reclaim ephemeral sampler %s", row.id)
    return len(doomed)
