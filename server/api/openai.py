"""OpenAI-compatible routes (/v1): chat completions (plain or SSE streaming) and the model list.

An OpenAI client passes the tenant's key as `Authorization: Bearer tml-...`; X-API-Key works too.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Header
from fastapi.responses import StreamingResponse

from api_schemas.openai import ChatCompletion, ChatCompletionRequest, ModelList
from server.api.deps import Ctx
from server.auth.keys import tenant_for_key
from server.errors import Unauthorized
from server.services import chat

router = APIRouter()


async def bearer_tenant(
    ctx: Ctx, authorization: Annotated[str | None, Header()] = None, x_api_key: Annotated[str | None, Header()] = None
) -> str:
    key = x_api_key
    if authorization and authorization.lower().startswith("bearer "):
        key = authorization[len("bearer ") :].strip()
    if not key:
        raise Unauthorized("missing API key: send Authorization: Bearer tml-... (or X-API-Key)")
    async with ctx.db.session() as s:
        tenant_id = await tenant_for_key(s, key)
    if tenant_id is None:
        raise Unauthorized("invalid or revoked API key")
    return tenant_id


BearerTenant = Annotated[str, Depends(bearer_tenant)]


@router.get("/models")
async def list_models(ctx: Ctx, tenant: BearerTenant) -> ModelList:
    return await chat.list_models(ctx, tenant)


@router.post("/chat/completions", response_model=None)
async def chat_completions(req: ChatCompletionRequest, ctx: Ctx, tenant: BearerTenant) -> ChatCompletion | StreamingResponse:
    if not req.stream:
        return await chat.complete(ctx, tenant, req)
    prepared = await chat.prepare(ctx, tenant, req)  # request errors are answered before the stream starts
    return StreamingResponse(chat.stream(ctx, tenant, req, prepared), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
