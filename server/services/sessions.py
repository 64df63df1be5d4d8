"""Client sessions: create, heartbeat, finish (first reason wins; later heartbeats get 410).

A session that sent no heartbeat for `session_timeout_seconds` has ended too: it is finished with reason
`timeout` when next seen (a heartbeat, a new model in it) or by maintenance (`expire_stale`), and stays ended; its
models are released (server/services/release.py)."""

from __future__ import annotations

import uuid
from datetime import UTC, timedelta

from api_schemas.tinker.types import CreateSessionRequest, FinishSessionRequest
from server.db import repositories as repo
from server.db.models import SessionRow, utcnow
from server.errors import Gone, NotFound
from server.services.context import Context
from server.services.release import release_ended_models
from server.services.tenant_caps import check_room


async def create_session(ctx: Context, tenant_id: str, req: CreateSessionRequest) -> str:
    await check_room(ctx, tenant_id, "sessions")
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


TIMEOUT_REASON = "timeout"


def _expired(ctx: Context, row: SessionRow) -> bool:
    """Finish `row` (in its open transaction) if its last heartbeat is older than the session timeout."""
    last = row.last_heartbeat_at if row.last_heartbeat_at.tzinfo else row.last_heartbeat_at.replace(tzinfo=UTC)
    if row.finished_at is None and last < utcnow() - timedelta(seconds=ctx.settings.session_timeout_seconds):
        row.finished_at, row.finish_reason = utcnow(), TIMEOUT_REASON
        row.finish_detail = "no heartbeat within the session timeout"
    return row.finished_at is not None


async def heartbeat(ctx: Context, tenant_id: str, session_id: str) -> None:
    async with ctx.db.session() as s:
        row = await repo.session_of(s, tenant_id, session_id)
        if row is None:
            raise NotFound(f"session {session_id} not found")
        if _expired(ctx, row):
            raise Gone(f"session {session_id} has finished ({row.finish_reason})")
        await repo.touch_session(s, row)


async def finish(ctx: Context, tenant_id: str, session_id: str, req: FinishSessionRequest) -> None:
    """End the session; its models are released now (not at the next maintenance round), so what they held (memory,
    a full-parameter lease) goes to whoever waits for it at once."""
    async with ctx.db.session() as s:
        row = await repo.session_of(s, tenant_id, session_id)
        if row is None:
            raise NotFound(f"session {session_id} not found")
        newly = row.finished_at is None
        if newly:
            row.finished_at, row.finish_reason, row.finish_detail = utcnow(), req.reason.type, req.detail
    if newly:
        await release_ended_models(ctx)
        ctx.admission.kick()  # a create held for the lease or a models limit looks again now


async def live_session(ctx: Context, tenant_id: str, session_id: str) -> SessionRow:
    async with ctx.db.session() as s:
        row = await repo.session_of(s, tenant_id, session_id)
        ended = row is not None and _expired(ctx, row)
    if row is None:
        raise NotFound(f"session {session_id} not found")
    if ended:
        raise Gone(f"session {session_id} has finished ({row.finish_reason}); create a new one")
    return row


async def expire_stale(ctx: Context) -> int:
    """Maintenance: finish the sessions whose heartbeats stopped (so none comes back to life)."""
    stale_before = utcnow() - timedelta(seconds=ctx.settings.session_timeout_seconds)
    async with ctx.db.session() as s:
        return await repo.expire_sessions(s, stale_before, utcnow(), TIMEOUT_REASON)
