"""Training operations: validate, then queue in the model's seq_id order. A request rejected here still consumes
its seq_id (a Skip job), so the model's later operations are not held back waiting for it."""

from __future__ import annotations

import re

from api_schemas.jobs import ForwardBackward, LoadWeights, OptimStep, Payload, SaveWeights
from api_schemas.training import AdamW
from api_schemas.tinker.json_batch import decode_json_forward_backward, parse_json_forward_backward
from api_schemas.tinker.proto import (
    DecodedForwardBackward,
    ProtoDecodeError,
    batch_datums,
    decode_forward_backward,
    decompress,
    parse_forward_backward,
)
from api_schemas.tinker.rest import SaveWeightsExternalRequest
from api_schemas.tinker.types import (
    NAME_PATTERN,
    LoadWeightsRequest,
    OptimStepRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    UntypedFuture,
)
from server.db import repositories as repo
from server.db.models import CheckpointRow, ModelRow
from server.errors import BadRequest, PayloadTooLarge
from server.services import checkpoints as ckpt
from server.services import custom_losses
from server.services import jobs
from server.services import full_param
from server.services import sampling
from server.services.context import Context
from server.services.jobs import queue_op
from server.services.models import model_id_for, owned_model
from server.services.sessions import live_session
from server.services.tenant_caps import check_room
from server.services.validation import check_forward_backward


async def forward_backward(ctx: Context, tenant_id: str, body: bytes, content_encoding: str | None,
                           content_type: str | None = None) -> UntypedFuture:
    """A protobuf ForwardBackwardRequest, or (Content-Type application/json) the JSON one older SDKs send."""
    limit = ctx.settings.max_request_bytes
    if len(body) > limit:
        raise PayloadTooLarge(f"request body of {len(body)} bytes exceeds the limit of {limit}")
    if _is_json(content_type):
        return await _json_batch(ctx, tenant_id, body, content_encoding, forward_only=False)
    try:
        raw = decompress(body, content_encoding)
        msg = parse_forward_backward(raw)
    except ProtoDecodeError as e:
        raise BadRequest(str(e)) from e
    model = await owned_model(ctx, tenant_id, msg.model_id)

    async def build() -> Payload:
        try:
            req = decode_forward_backward(msg)
        except ProtoDecodeError as e:
            raise BadRequest(str(e)) from e
        return await _batch_payload(ctx, tenant_id, model, req)

    return await queue_op(ctx, tenant_id, model, int(msg.seq_id), build)


async def forward(ctx: Context, tenant_id: str, body: bytes, content_encoding: str | None) -> UntypedFuture:
    """Older SDKs' POST /forward: a JSON ForwardRequest, run as a forward-only batch."""
    limit = ctx.settings.max_request_bytes
    if len(body) > limit:
        raise PayloadTooLarge(f"request body of {len(body)} bytes exceeds the limit of {limit}")
    return await _json_batch(ctx, tenant_id, body, content_encoding, forward_only=True)


async def _json_batch(ctx: Context, tenant_id: str, body: bytes, content_encoding: str | None,
                      forward_only: bool) -> UntypedFuture:
    try:
        msg = parse_json_forward_backward(decompress(body, content_encoding), forward_only)
    except ProtoDecodeError as e:
        raise BadRequest(str(e)) from e
    model = await owned_model(ctx, tenant_id, msg.model_id)

    async def build() -> Payload:
        try:
            req = decode_json_forward_backward(msg, forward_only)
        except ProtoDecodeError as e:
            raise BadRequest(str(e)) from e
        return await _batch_payload(ctx, tenant_id, model, req)

    return await queue_op(ctx, tenant_id, model, msg.seq_id, build)


async def _batch_payload(ctx: Context, tenant_id: str, model: ModelRow, req: DecodedForwardBackward) -> Payload:
    """The decoded batch (from protobuf or JSON) validated against the served model, as the engine-native job."""
    loss_id = req.loss_fn_config.get("loss_id") if req.loss_fn == "custom" else None
    # A custom loss travels in the job as its checked graph (404 unless this model's session created it).
    program = await custom_losses.resolve(ctx, tenant_id, model, loss_id) if isinstance(loss_id, str) else None
    check_forward_backward(req, ctx.served(model.base_model), ctx.settings.max_datums_per_request, program)
    return ForwardBackward.build(batch_datums(req), forward_only=req.forward_only, loss_fn=req.loss_fn,
                                 loss_config=req.loss_fn_config, custom_loss=program)


def _is_json(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"


async def optim_step(ctx: Context, tenant_id: str, req: OptimStepRequest) -> UntypedFuture:
    model = await owned_model(ctx, tenant_id, req.model_id)

    async def build() -> Payload:
        if req.adam_params is None:
            kind = (req.optimizer_params or {}).get("type", "unknown")
            raise BadRequest(f"model {model.id} uses the {model.optimizer} optimizer; got parameters for {kind!r}")
        a = req.adam_params
        if a.learning_rate < 0 or not (0 <= a.beta1 < 1 and 0 <= a.beta2 < 1) or a.eps < 0:
            raise BadRequest("adam_params need learning_rate >= 0, 0 <= beta1, beta2 < 1 and eps >= 0")
        if a.weight_decay < 0 or a.grad_clip_norm < 0:
            raise BadRequest("adam_params need weight_decay >= 0 and grad_clip_norm >= 0")
        return OptimStep(optimizer=AdamW(**dict(a)))

    return await queue_op(ctx, tenant_id, model, req.seq_id, build)


async def save_weights(ctx: Context, tenant_id: str, req: SaveWeightsRequest) -> UntypedFuture:
    model = await owned_model(ctx, tenant_id, req.model_id)
    return await save_checkpoint(ctx, tenant_id, model, req.seq_id, "weights", req.path, req.ttl_seconds,
                                 req.overwrite, req.user_metadata)


async def save_weights_for_sampler(ctx: Context, tenant_id: str, req: SaveWeightsForSamplerRequest) -> UntypedFuture:
    model = await owned_model(ctx, tenant_id, req.model_id)
    if req.path is None:  # ephemeral: save_weights_and_get_sampling_client
        return await sampling.save_ephemeral(ctx, tenant_id, model, req)
    return await save_checkpoint(ctx, tenant_id, model, req.seq_id, "sampler_weights", req.path, req.ttl_seconds,
                                 True, req.user_metadata)


async def save_weights_external(ctx: Context, tenant_id: str, req: SaveWeightsExternalRequest) -> UntypedFuture:
    """A PEFT-format export under external_weights/, downloadable through signed URLs (services/downloads.py)."""
    model = await owned_model(ctx, tenant_id, req.model_id)
    if req.age_encryption_recipients:
        async def reject() -> Payload:
            raise BadRequest("age encryption of exports is not supported by this server; omit age_encryption_recipients")
        return await queue_op(ctx, tenant_id, model, req.seq_id, reject)
    return await save_checkpoint(ctx, tenant_id, model, req.seq_id, "external_weights", req.path, req.ttl_seconds,
                                 True, None)


async def save_checkpoint(ctx: Context, tenant_id: str, model: ModelRow, seq_id: int, kind: str,  # noqa: PLR0913
                          name: str, ttl: int | None, overwrite: bool, metadata: dict[str, str] | None) -> UntypedFuture:
    """Queue a save of `model` under `<kind>/<name>` at `seq_id` (also the native protocol's save)."""
    tinker_path = f"tinker://{model.id}/{kind}/{name}"
    key = ckpt.storage_key(tenant_id, model.id, kind, name)

    async def build() -> Payload:
        if not re.match(NAME_PATTERN, name):
            raise BadRequest(f"checkpoint name {name!r} must match {NAME_PATTERN} (letters, digits, . _ -)")
        expires = ckpt.expiry(ttl)
        left = await ckpt.quota_left(ctx, tenant_id, model.id, kind, name)  # 403 when the tenant's quota is full
        async with ctx.db.session() as s:
            row = await repo.checkpoint(s, model.id, kind, name)
            if row is not None and not overwrite:
                raise BadRequest(f"checkpoint {tinker_path} already exists; pass overwrite=True to replace it")
            if row is None:
                row = CheckpointRow(tenant_id=tenant_id, model_id=model.id, kind=kind, name=name, storage_key=key)
                s.add(row)
            row.status, row.request_id, row.expires_at = "pending", "", expires
            row.user_metadata = dict(metadata or {})
        return SaveWeights(storage_key=key, with_optimizer=kind == "weights", max_bytes=left)

    async with ctx.db.session() as s:  # a retry of the same save (same seq_id) gets the same future back
        existing = await repo.checkpoint(s, model.id, kind, name)
    if existing is not None and existing.request_id and await _same_seq(ctx, existing.request_id, model.id, seq_id):
        return UntypedFuture(request_id=existing.request_id, model_id=model.id)
    fut = await queue_op(ctx, tenant_id, model, seq_id, build)
    async with ctx.db.session() as s:
        row = await repo.checkpoint(s, model.id, kind, name)
        if row is not None:
            row.request_id = fut.request_id
    return fut


async def _same_seq(ctx: Context, request_id: str, model_id: str, seq_id: int) -> bool:
    return await jobs.request_at(ctx, model_id, seq_id) == request_id


async def load_weights(ctx: Context, tenant_id: str, req: LoadWeightsRequest) -> UntypedFuture:
    if req.session_id is not None and req.model_seq_id is not None:
        return await _create_via_load(ctx, tenant_id, req)
    if req.model_id is None or req.seq_id is None:
        raise BadRequest("load_weights needs either session_id + model_seq_id or model_id + seq_id")
    model = await owned_model(ctx, tenant_id, req.model_id)

    async def build() -> Payload:
        source = await ckpt.readable(ctx, tenant_id, req.path)
        return _load_payload(source, req.optimizer, create=False)

    return await queue_op(ctx, tenant_id, model, req.seq_id, build)


def _load_payload(source: CheckpointRow, optimizer: bool, create: bool) -> LoadWeights:
    if source.kind == "external_weights":
        raise BadRequest("external_weights exports cannot be loaded for training; load a weights/ checkpoint")
    if optimizer and source.kind != "weights":
        raise BadRequest("optimizer state exists only in weights/ (save_state) checkpoints")
    return LoadWeights(storage_key=source.storage_key, with_optimizer=optimizer, create=create)


async def _create_via_load(ctx: Context, tenant_id: str, req: LoadWeightsRequest) -> UntypedFuture:
    assert req.session_id is not None and req.model_seq_id is not None
    await live_session(ctx, tenant_id, req.session_id)
    model_id = model_id_for(req.session_id, req.model_seq_id)
    async with ctx.db.session() as s:
        existing = await repo.model_by_id(s, model_id)
    if existing is not None:
        if existing.tenant_id != tenant_id:
            raise BadRequest(f"model slot {model_id} is taken")
        return UntypedFuture(request_id=existing.create_request_id, model_id=model_id)
    source = await ckpt.readable(ctx, tenant_id, req.path)
    await check_room(ctx, tenant_id, "models")
    payload = _load_payload(source, req.optimizer, create=True)
    async with ctx.db.session() as s:
        origin = await repo.model_by_id(s, source.model_id)
        assert origin is not None
        if req.base_model is not None and req.base_model != origin.base_model:
            raise BadRequest(f"checkpoint was trained on {origin.base_model}, not {req.base_model}")
        if origin.full_param:  # a full-parameter run comes back on a lease of its own
            full_param.require_offered(ctx.settings, origin.base_model)
            payload = payload.model_copy(update={"full": True})
        row = ModelRow(
            id=model_id, tenant_id=tenant_id, session_id=req.session_id, model_seq_id=req.model_seq_id,
            full_param=origin.full_param,
            base_model=origin.base_model, lora_rank=origin.lora_rank, seed=origin.seed, train_attn=origin.train_attn,
            train_mlp=origin.train_mlp, train_unembed=origin.train_unembed, optimizer=origin.optimizer,
            create_request_id="", user_metadata=req.user_metadata or {},
        )
        await repo.add(s, row)
        row.create_request_id = await jobs.queue_train(
            ctx, tenant_id=tenant_id, base_model=origin.base_model, model_id=model_id, seq_id=0, payload=payload,
        )
    return UntypedFuture(request_id=row.create_request_id, model_id=model_id)
