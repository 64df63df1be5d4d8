"""Sessions as the RestClient reads them: list, get, search (newest first, with a cursor), move to a project.

A tenant sees only its own sessions; "accessible" means the same here (sessions are never shared between
tenants), and a search by owner URN matches only the caller's own URN. Statuses: a finished session is
`client_finished` with its reason; an unfinished one is `active` while its heartbeats are recent and has no status
once they stopped (the SDK's "neither finished nor known to be running").
"""

from __future__ import annotations

from datetime import timedelta, timezone

from api_schemas.tinker.rest import (
    ActiveStatus,
    ClientFinishedStatus,
    FinishReasonBody,
    GetSessionResponse,
    ListSessionsResponse,
    SessionSearchRequest,
    SessionSearchResponse,
    SessionStatus,
    SessionSummary,
    StatusQuery,
    TraceExportResponse,
)
from server.db import lifecycle_repo as lrepo
from server.db import repositories as repo
from server.db.models import SessionRow, utcnow
from server.errors import NotFound
from server.services.checkpoints import aware
from server.services.context import Context
from server.services.runs import owner_urn

_BATCH = 200


async def list_sessions(ctx: Context, tenant_id: str, limit: int, offset: int) -> ListSessionsResponse:
    async with ctx.db.session() as s:
        return ListSessionsResponse(sessions=await lrepo.session_ids(s, tenant_id, limit, offset))


async def get_session(ctx: Context, tenant_id: str, session_id: str) -> GetSessionResponse:
    async with ctx.db.session() as s:
        row = await repo.session_of(s, tenant_id, session_id)
        if row is None:
            raise NotFound(f"session {session_id} not found")
        runs = await lrepo.run_ids_of_session(s, session_id)
        samplers = await lrepo.sampler_ids_of_session(s, session_id)
    return GetSessionResponse(
        training_run_ids=runs, sampler_ids=samplers, user_metadata=_str_dict(row.user_metadata),
        display_name=row.display_name,
    )


async def assign_project(ctx: Context, tenant_id: str, session_id: str, project_id: str) -> None:
    async with ctx.db.session() as s:
        row = await repo.session_of(s, tenant_id, session_id)
        if row is None:
            raise NotFound(f"session {session_id} not found")
        row.project_id = project_id


async def trace_export(ctx: Context, tenant_id: str, session_id: str) -> TraceExportResponse:
    async with ctx.db.session() as s:
        if await repo.session_of(s, tenant_id, session_id) is None:
            raise NotFound(f"session {session_id} not found")
    return TraceExportResponse(status="failed", error="session trace export is not offered by this server")


def _str_dict(d: dict | None) -> dict[str, str] | None:
    return {str(k): str(v) for k, v in d.items()} or None if d else None


def status_of(ctx: Context, row: SessionRow) -> SessionStatus | None:
    if row.finished_at is not None:
        reason = row.finish_reason if row.finish_reason in ("success", "errored", "interrupted") else "success"
        return ClientFinishedStatus(reason=FinishReasonBody(type=reason), detail=row.finish_detail)  # type: ignore[arg-type]
    heartbeat = aware(row.last_heartbeat_at)
    if heartbeat is not None and utcnow() - heartbeat < timedelta(seconds=ctx.settings.session_timeout_seconds):
        return ActiveStatus()
    return None


def _matches_status(status: SessionStatus | None, queries: list[StatusQuery] | None) -> bool:
    if queries is None:
        return True
    for q in queries:
        if q.type == "active" and isinstance(status, ActiveStatus):
            return True
        if q.type == "client_finished" and isinstance(status, ClientFinishedStatus):
            if q.reasons is None or status.reason.type in q.reasons:
                return True
    return False  # cancelled / failed: this server never ends a session that way


async def search(ctx: Context, tenant_id: str, req: SessionSearchRequest) -> SessionSearchResponse:
    if req.owner.type == "user" and owner_urn(tenant_id) not in (req.owner.owner_urns or []):
        return SessionSearchResponse(sessions=[])
    words = req.display_name.split() if req.display_name else []
    before = (req.cursor.last_created_at.astimezone(timezone.utc), req.cursor.last_session_id) if req.cursor else None
    found: list[tuple[SessionRow, SessionStatus | None]] = []
    exhausted = False
    while len(found) < req.limit and not exhausted:
        async with ctx.db.session() as s:
            rows = await lrepo.search_sessions(
                s, tenant_id, before=before, project_ids=req.project_ids, session_id=req.session_id,
                name_words=words, batch=_BATCH,
            )
        exhausted = len(rows) < _BATCH
        for row in rows:
            before = (row.created_at, row.id)
            meta = row.user_metadata or {}
            if any(str(meta.get(k)) != v or k not in meta for k, v in req.user_metadata.items()):
                continue
            status = status_of(ctx, row)
            if _matches_status(status, req.statuses):
                found.append((row, status))
                if len(found) == req.limit:
                    break
    async with ctx.db.session() as s:
        stats = await lrepo.session_checkpoint_stats(s, [r.id for r, _ in found])
    sessions = [
        SessionSummary(
            session_id=r.id, created_at=aware(r.created_at), owner=owner_urn(r.tenant_id),  # type: ignore[arg-type]
            project_id=r.project_id or "", status=st, checkpoints_count=stats.get(r.id, (0, 0))[0],
            display_name=r.display_name, user_metadata=_str_dict(r.user_metadata),
            checkpoint_storage_bytes=stats.get(r.id, (0, 0))[1],
        )
        for r, st in found
    ]
    next_cursor = None
    if len(found) == req.limit:  # maybe more: the next page starts after the last one shown
        last = found[-1][0]
        next_cursor = {"last_created_at": aware(last.created_at).isoformat(), "last_session_id": last.id}  # type: ignore[union-attr]
    return SessionSearchResponse(sessions=sessions, next_cursor=next_cursor)
