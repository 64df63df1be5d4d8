"""Client sessions: create, heartbeat, finish (first reason wins; later heartbeats get 410)."""

from __future__ import annotations

import uuid

from api_schemas.tinker.types import CreateSessionRequest, FinishSessionRequest
from server.db import repositories as repo
from server.db.models import SessionRow, utcnow
from server.errors import Gone, NotFound
from server.services.context import Context


async def create_session(ctx: Context, tenant_id: str, req: CreateSessionRequest) -> str:
    row = SessionRow(
        id=str(uuid.uuid4()),
        tenant_id=tenant_id,
        tags=sorted(set(req.tags)),
        user_metadata=req.user_metadata or {},
        project_id=req.project_id,
        display_name=req.display_name,
        sdk_version=req.sdk_version,
    )
    async with ctx.db.session() as s:
        await repo.add(s, row)
    return row.id


async def heartbeat(ctx: Context, tenant_id: str, session_id: str) -> None:
    async with ctx.db.session() as s:
        row = await repo.session_of(s, tenant_id, session_id)
        if row is None:
            raise NotFound(f"session {session_id} not found")
        if row.finished_at is not None:
            raise Gone(f"session {session_id} has finished")
        await repo.touch_session(s, row)


async def finish(ctx: Context, tenant_id: str, session_id: str, req: FinishSessionRequest) -> None:
    async with ctx.db.session() as s:
        row = await repo.session_of(s, tenant_id, session_id)
        if row is None:
            raise NotFound(f"session {session_id} not found")
        if row.finished_at is None:
            row.finished_at, row.finish_reason, row.finish_detail = utcnow(), req.reason.type, req.detail


async def live_session(ctx: Context, tenant_id: str, session_id: str) -> SessionRow:
    async with ctx.db.session() as s:
        row = await repo.session_of(s, tenant_id, session_id)
    if row is None:
        raise NotFound(f"session {session_id} not found")
    if row.finished_at is not None:
        raise Gone(f"session {session_id} has finished; create a new one")
    return row
