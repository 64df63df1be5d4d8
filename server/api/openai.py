"""OpenAI-compatible routes (/v1): chat completions (plain or SSE streaming) and the model list.

An OpenAI client passes the tenant's key as `Authorization: Bearer tml-...`; X-API-Key works too
(server/api/deps.py BearerTenant, checked by the gate before the body is read).
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from api_schemas.openai import ChatCompletion, ChatCompletionRequest, ModelList
from server.api.deps import BearerTenant, Ctx
from server.services import chat

router = APIRouter()


@router.get("/models")
async def list_models(ctx: Ctx, tenant: BearerTenant) -> ModelList:
    return await chat.list_models(ctx, tenant)


@router.post("/chat/completions", response_model=None, responses={200: {
    "description": "A ChatCompletion, or with `stream` its SSE chunks",
    "model": ChatCompletion, "content": {"text/event-stream": {}}}})
async def chat_completions(req: ChatCompletionRequest, ctx: Ctx, tenant: BearerTenant) -> ChatCompletion | StreamingResponse:
    if not req.stream:
        return await chat.complete(ctx, tenant, req)
    prepared = await chat.prepare(ctx, tenant, req)  # request errors are answered before the stream starts
    return StreamingResponse(chat.stream(ctx, tenant, req, prepared), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
