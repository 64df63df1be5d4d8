"""retrieve_future: long-poll a job's result (never a sleep loop), check its owner, return its bytes."""

from __future__ import annotations

import json
from dataclasses import dataclass

from api_schemas.tinker.types import FutureError, TryAgain
from server.errors import NotFound
from server.services import checkpoints as ckpt
from server.services.context import Context

_SAVE_RESULTS = {"SaveWeightsResponse", "SaveWeightsForSamplerResponse"}


@dataclass(frozen=True)
class FutureAnswer:
    media_type: str
    body: bytes


async def retrieve(ctx: Context, tenant_id: str, request_id: str) -> FutureAnswer:
    info = await ctx.queue.info(request_id)
    if info is None or info.tenant_id != tenant_id:
        raise NotFound(f"future {request_id} not found (unknown, expired, or not yours)")
    result = await ctx.queue.wait_result(request_id, ctx.settings.long_poll_seconds)
    if result is None:
        return _json(TryAgain(request_id=request_id).model_dump(exclude_none=True))
    if info.result_type in _SAVE_RESULTS:
        size = json.loads(result.body).get("size_bytes") if result.ok else None
        await ckpt.record_result(ctx, request_id, result.ok, size)
    if result.error is not None:
        return _json(FutureError(error=result.error.message, category=result.error.category.value).model_dump())
    return FutureAnswer(result.media_type, result.body)


def _json(payload: dict) -> FutureAnswer:
    return FutureAnswer("application/json", json.dumps(payload).encode())
