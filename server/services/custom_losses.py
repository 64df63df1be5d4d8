"""Server-side custom losses: create_custom_loss (check, store, answer a future) and the lookup forward_backward
makes for loss_fn "custom".

The uploaded graph is checked against the allowlist (api_schemas/tinker/custom_loss.py) before anything is
stored; a rejected graph gets a 400 naming the node and target, and nothing is kept. A loss belongs to the
session that created it: only that session's training runs can use its loss_id (another session or tenant gets
404, as for any id that is not theirs). `custom_loss_seq_id` makes a create idempotent: a retry of the same
upload gets the first loss back, a different upload under the same seq_id is refused.

The SDK waits for the create as a future. Its request id is the loss id, and retrieve_future answers it from
the stored row (`answer`), so a created loss's future survives a gateway restart like the loss itself.

A session holds at most TWINKLE_MAX_CUSTOM_LOSSES_PER_SESSION losses, and the rows of ended sessions are deleted by
the maintenance loop (`drop_ended`): nothing can use them any more (queued jobs carry their own copy of the graph).
"""

from __future__ import annotations

import uuid
from datetime import timedelta

from pydantic import ValidationError
from sqlalchemy.exc import IntegrityError

from api_schemas.tinker.custom_loss import (
    MAX_REQUEST_BYTES,
    CreateCustomLossRequest,
    CreateCustomLossResponse,
    CustomLossProgram,
    CustomLossRejected,
    validate_custom_loss,
)
from api_schemas.tinker.types import UntypedFuture
from server.db import custom_loss_repo as repo
from server.db.models import CustomLossRow, ModelRow, utcnow
from server.errors import BadRequest, NotFound, PayloadTooLarge
from server.services.context import Context
from server.services.sessions import live_session

LOSS_ID_PREFIX = "custom-loss-"


def is_loss_id(request_id: str) -> bool:
    return request_id.startswith(LOSS_ID_PREFIX)


async def create(ctx: Context, tenant_id: str, body: bytes) -> UntypedFuture:
    if len(body) > MAX_REQUEST_BYTES:
        raise PayloadTooLarge(f"a create_custom_loss body may have at most {MAX_REQUEST_BYTES} bytes")
    try:
        req = CreateCustomLossRequest.model_validate_json(body)
    except ValidationError as e:
        errors = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors()[:5])
        raise BadRequest(f"invalid create_custom_loss body: {errors}") from e
    await live_session(ctx, tenant_id, req.session_id)  # 404 for a session that is not this tenant's
    try:
        program = validate_custom_loss(req, LOSS_ID_PREFIX + uuid.uuid4().hex)
    except CustomLossRejected as e:
        raise BadRequest(str(e)) from e
    digest = program.digest()
    existing = await _by_seq(ctx, tenant_id, req.session_id, req.custom_loss_seq_id)
    if existing is None:
        limit = ctx.settings.max_custom_losses_per_session
        async with ctx.db.session() as s:
            held = await repo.count_of_session(s, req.session_id)
        if held >= limit:
            raise BadRequest(f"session {req.session_id} already holds {held} custom losses, the limit of this server "
                             "(TWINKLE_MAX_CUSTOM_LOSSES_PER_SESSION); reuse them or start a new session")
        row = CustomLossRow(id=program.loss_id, tenant_id=tenant_id, session_id=req.session_id,
                            seq_id=req.custom_loss_seq_id, name=program.name, digest=digest,
                            program=program.model_dump(mode="json"))
        try:
            async with ctx.db.session() as s:
                s.add(row)
            return UntypedFuture(request_id=program.loss_id)
        except IntegrityError:  # a concurrent retry stored it first
            existing = await _by_seq(ctx, tenant_id, req.session_id, req.custom_loss_seq_id)
            if existing is None:
                raise
    if existing.digest != digest:
        raise BadRequest(f"custom_loss_seq_id {req.custom_loss_seq_id} of session {req.session_id} was already "
                         "used for a different loss")
    return UntypedFuture(request_id=existing.id)


async def _by_seq(ctx: Context, tenant_id: str, session_id: str, seq_id: int) -> CustomLossRow | None:
    async with ctx.db.session() as s:
        return await repo.custom_loss_by_seq(s, tenant_id, session_id, seq_id)


async def answer(ctx: Context, tenant_id: str, loss_id: str) -> CreateCustomLossResponse:
    """The result of a create_custom_loss future (its request id is the loss id)."""
    async with ctx.db.session() as s:
        row = await repo.custom_loss_of(s, tenant_id, loss_id)
    if row is None:
        raise NotFound(f"future {loss_id} not found (unknown, expired, or not yours)")
    return CreateCustomLossResponse(loss_id=row.id)


async def resolve(ctx: Context, tenant_id: str, model: ModelRow, loss_id: str) -> CustomLossProgram:
    """The checked graph `loss_id` names, if this model's session created it; else 404."""
    async with ctx.db.session() as s:
        row = await repo.custom_loss_of(s, tenant_id, loss_id) if is_loss_id(loss_id) else None
    if row is None or row.session_id != model.session_id:
        raise NotFound(f"custom loss {loss_id[:80]!r} not found (unknown, or not created by the session of {model.id})")
    return CustomLossProgram.model_validate(row.program)


async def drop_ended(ctx: Context) -> int:
    """Maintenance step: delete the custom losses of finished or timed-out sessions; returns how many went."""
    stale_before = utcnow() - timedelta(seconds=ctx.settings.session_timeout_seconds)
    async with ctx.db.session() as s:
        return await repo.delete_of_ended_sessions(s, stale_before)
