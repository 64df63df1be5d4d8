"""Session lifecycle routes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api_schemas.tinker.types import CreateSessionRequest, CreateSessionResponse, FinishSessionRequest, SessionHeartbeatRequest
from server.api.deps import Ctx, Tenant
from server.services import sessions

router = APIRouter()


@router.post("/create_session")
async def create_session(req: CreateSessionRequest, ctx: Ctx, tenant: Tenant) -> CreateSessionResponse:
    return CreateSessionResponse(session_id=await sessions.create_session(ctx, tenant, req))


@router.post("/session_heartbeat")
async def session_heartbeat(req: SessionHeartbeatRequest, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    await sessions.heartbeat(ctx, tenant, req.session_id)
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, ctx: Ctx, tenant: Tenant, req: FinishSessionRequest | None = None) -> dict[str, Any]:
    await sessions.finish(ctx, tenant, session_id, req or FinishSessionRequest())
    return {}
