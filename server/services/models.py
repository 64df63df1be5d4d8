"""Training models (LoRA adapters on a served base model): create, get_info, server capabilities."""

from __future__ import annotations

import secrets
import uuid

from api_schemas.jobs import CreateModel
from api_schemas.training import LoraSpec
from api_schemas.tinker.types import (
    CreateModelRequest,
    GetInfoResponse,
    ModelData,
    ServerCapabilities,
    SupportedModel,
    UntypedFuture,
)
from server.db import repositories as repo
from server.db.models import ModelRow
from server.errors import BadRequest, Gone, NotFound
from server.services import full_param, jobs
from server.services.context import Context
from server.services.sessions import live_session
from server.services.tenant_caps import check_room

SUPPORTED_OPTIMIZERS = ("adamw",)


def model_id_for(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


async def owned_model(ctx: Context, tenant_id: str, model_id: str) -> ModelRow:
    row = ctx.model_rows.get(model_id)
    if row is None:
        async with ctx.db.session() as s:
            row = await repo.model_by_id(s, model_id)
        if row is not None:
            if len(ctx.model_rows) > 100_000:
                ctx.model_rows.clear()
            ctx.model_rows[model_id] = row
    if row is None or row.tenant_id != tenant_id:
        raise NotFound(f"model {model_id} not found")
    if row.released_at is not None:
        why = "its session ended or its full-parameter lease ran out" if row.full_param else "its session ended"
        raise Gone(f"model {model_id} was released when {why}; its saved checkpoints remain "
                   "(create_training_client_from_state continues from one)")
    return row


def lora_spec(row: ModelRow) -> LoraSpec | None:
    """The run's LoRA, or None for a full-parameter run."""
    if row.full_param:
        return None
    return LoraSpec(
        rank=row.lora_rank, seed=row.seed, train_attn=row.train_attn, train_mlp=row.train_mlp,
        train_unembed=row.train_unembed,
    )


async def create_model(ctx: Context, tenant_id: str, req: CreateModelRequest) -> UntypedFuture:
    served = ctx.served(req.base_model)
    await live_session(ctx, tenant_id, req.session_id)
    lora = req.lora_config
    if lora is None:  # twinkle-kit's create_full_training_client: a full-parameter run, on a lease
        full_param.require_offered(ctx.settings, served.name)
    elif lora.rank > ctx.settings.max_lora_rank:
        raise BadRequest(f"lora rank {lora.rank} exceeds this server's maximum {ctx.settings.max_lora_rank} "
                         "(max_lora_rank)")
    if lora is not None and not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise BadRequest("at least one of train_attn, train_mlp, train_unembed must be true")
    if req.optimizer_config.type not in SUPPORTED_OPTIMIZERS:
        raise BadRequest(
            f"optimizer {req.optimizer_config.type!r} is not supported; supported: {list(SUPPORTED_OPTIMIZERS)}"
        )
    model_id = model_id_for(req.session_id, req.model_seq_id)
    async with ctx.db.session() as s:
        existing = await repo.model_by_id(s, model_id)
    if existing is not None:  # a retry of the same create: hand back the same future
        if existing.tenant_id != tenant_id:
            raise NotFound(f"session {req.session_id} not found")
        return UntypedFuture(request_id=existing.create_request_id, model_id=model_id)
    await check_room(ctx, tenant_id, "models")
    async with ctx.db.session() as s:
        row = ModelRow(
            id=model_id, tenant_id=tenant_id, session_id=req.session_id, model_seq_id=req.model_seq_id,
            # "None means random" (SDK docs): draw it here and keep it, so a rebuild gives the same init
            base_model=served.name, lora_rank=lora.rank if lora else 0, full_param=lora is None,
            seed=lora.seed if lora and lora.seed is not None else secrets.randbelow(2**31),
            train_attn=lora.train_attn if lora else True, train_mlp=lora.train_mlp if lora else True,
            train_unembed=lora.train_unembed if lora else True, optimizer=req.optimizer_config.type,
            create_request_id=str(uuid.uuid4()), user_metadata=req.user_metadata or {},
        )
        await repo.add(s, row)
        request_id = await jobs.queue_train(
            ctx, tenant_id=tenant_id, base_model=served.name, model_id=model_id, seq_id=0,
            payload=CreateModel(lora=lora_spec(row)),
        )
        row.create_request_id = request_id
    return UntypedFuture(request_id=request_id, model_id=model_id)


async def get_info(ctx: Context, tenant_id: str, model_id: str) -> GetInfoResponse:
    row = await owned_model(ctx, tenant_id, model_id)
    served = ctx.served(row.base_model)
    return GetInfoResponse(
        model_id=row.id,
        model_data=ModelData(arch=served.arch, model_name=served.name, tokenizer_id=served.tokenizer_id),
        optimizer_config={"type": row.optimizer},
        is_lora=not row.full_param,
        lora_rank=None if row.full_param else row.lora_rank,
        model_name=served.name,
    )


def capabilities(ctx: Context) -> ServerCapabilities:
    return ServerCapabilities(
        supported_models=[
            SupportedModel(model_name=m.name, max_context_length=m.max_context) for m in ctx.models.values()
        ]
    )
