"""Futures: retrieve_future (long-poll one job's result, never a sleep loop, check its owner, return its bytes),
retrieve_futures (long-poll the completions of a sampling session) and cancel_future."""

from __future__ import annotations

from typing import Literal

import json
from dataclasses import dataclass

from api_schemas.jobs import ResultKind, SaveResult
from api_schemas.tinker.futures import (
    CancelFutureResponse,
    FutureFailed,
    FutureFinished,
    RetrieveFuturesRequest,
    RetrieveFuturesResponse,
)
from api_schemas.tinker.results import encode_result, wants_json
from api_schemas.tinker.types import FutureError, TryAgain
from server.errors import DomainError, NotFound
from server.services import checkpoints as ckpt
from server.services import custom_losses
from server.services import jobs
from server.services.sampling import owned_sampler
from server.services.context import Context
from server.services.full_param import LEASE_REASON
from server.services.jobs import feed_name

@dataclass(frozen=True)
class FutureAnswer:
    media_type: str
    body: bytes


async def retrieve(ctx: Context, tenant_id: str, request_id: str, accept: str | None = None) -> FutureAnswer:
    """`accept`: the request's Accept header (older SDKs read every result as JSON: results.wants_json)."""
    if custom_losses.is_loss_id(request_id):  # create_custom_loss: done when stored, answered from SQL
        return _json((await custom_losses.answer(ctx, tenant_id, request_id)).model_dump())
    owner = await jobs.owner(ctx, request_id)
    if owner is None or owner[0] != tenant_id:
        raise NotFound(f"future {request_id} not found (unknown, expired, or not yours)")
    kind = owner[1]
    result = await jobs.wait_result(ctx, request_id, ctx.settings.long_poll_seconds)
    if result is None:
        reason = jobs.paused_reason(ctx, request_id)
        state: Literal["paused_capacity", "paused_rate_limit"] = (
            "paused_capacity" if reason is not None and reason.startswith(LEASE_REASON) else "paused_rate_limit")
        pending = TryAgain(request_id=request_id) if reason is None else TryAgain(
            request_id=request_id, queue_state=state, queue_state_reason=reason)
        return _json(pending.model_dump(exclude_none=True))
    ctx.recent.get(request_id, delivered=True)
    saved = None
    if kind is ResultKind.SAVE:
        out = result.output if isinstance(result.output, SaveResult) else None
        saved = await ckpt.record_result(ctx, request_id, out)
    if result.error is not None:
        return _json(FutureError(error=result.error.message, category=result.error.category.value).model_dump())
    if result.output is None:
        raise DomainError(f"future {request_id} finished without a result")
    media_type, body = encode_result(kind, result.output, saved, json_only=wants_json(accept))
    return FutureAnswer(media_type, body)


def _json(payload: dict) -> FutureAnswer:
    return FutureAnswer("application/json", json.dumps(payload).encode())


async def retrieve_many(ctx: Context, tenant_id: str, req: RetrieveFuturesRequest) -> RetrieveFuturesResponse:
    t = req.target
    await owned_sampler(ctx, tenant_id, t.sampling_session_id)  # another tenant's (or no) sampling session: 404
    wait = ctx.settings.long_poll_seconds if req.timeout is None else min(req.timeout, ctx.settings.long_poll_seconds)
    page = await ctx.queue.wait_feed(
        feed_name(tenant_id, t.sampling_session_id, t.cloned_sampler_id), req.prev_cursor, wait,
        req.retrieved_request_ids,
    )
    completions: list[FutureFinished | FutureFailed] = [
        FutureFailed(request_id=c.request_id) if c.failed
        else FutureFinished(request_id=c.request_id, response_payload_uncompressed_size=c.size)
        for c in page.completions
    ]
    return RetrieveFuturesResponse(completions=completions, cursor=page.cursor)


async def cancel(ctx: Context, tenant_id: str, request_id: str) -> CancelFutureResponse:
    info = await jobs.info(ctx, request_id)
    if info is None or info.tenant_id != tenant_id:
        raise NotFound(f"future {request_id} not found (unknown, expired, or not yours)")
    return CancelFutureResponse(request_id=request_id, cancelled=await jobs.cancel(ctx, request_id))
