"""Training-run and session routes of the RestClient: list / get runs, list / get / search sessions, move a session
to a project, trace export, and the tenant's checkpoint storage usage."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Response

from api_schemas.tinker.rest import (
    AssignProjectRequest,
    GetSessionResponse,
    ListSessionsResponse,
    SessionSearchRequest,
    SessionSearchResponse,
    StorageUsageResponse,
    TraceExportResponse,
    TrainingRun,
    TrainingRunsResponse,
)
from server.api.deps import Ctx, Offset, Tenant
from server.services import runs, session_queries

router = APIRouter()
Limit = Annotated[int, Query(ge=1, le=1000)]
Scope = Literal["owned", "accessible"]


@router.get("/training_runs")
async def list_training_runs(
    ctx: Ctx, tenant: Tenant, limit: Limit = 20, offset: Offset = 0, access_scope: Scope = "owned",
    project_id: str | None = None,
) -> TrainingRunsResponse:
    return await runs.list_runs(ctx, tenant, limit, offset, access_scope, project_id)


@router.get("/training_runs/{run_id}")
async def get_training_run(run_id: str, ctx: Ctx, tenant: Tenant, access_scope: Scope = "owned") -> TrainingRun:
    return await runs.get_run(ctx, tenant, run_id, access_scope)


@router.get("/sessions")
async def list_sessions(
    ctx: Ctx, tenant: Tenant, limit: Limit = 20, offset: Offset = 0, access_scope: Scope = "owned"
) -> ListSessionsResponse:
    return await session_queries.list_sessions(ctx, tenant, limit, offset)


@router.post("/sessions/search")
async def search_sessions(req: SessionSearchRequest, ctx: Ctx, tenant: Tenant) -> SessionSearchResponse:
    return await session_queries.search(ctx, tenant, req)


@router.get("/sessions/{session_id}")
async def get_session(session_id: str, ctx: Ctx, tenant: Tenant, access_scope: Scope = "owned") -> GetSessionResponse:
    return await session_queries.get_session(ctx, tenant, session_id)


@router.put("/sessions/{session_id}/project", status_code=204)
async def assign_session_project(session_id: str, req: AssignProjectRequest, ctx: Ctx, tenant: Tenant) -> Response:
    await session_queries.assign_project(ctx, tenant, session_id, req.project_id)
    return Response(status_code=204)


@router.get("/sessions/{session_id}/trace_export")
async def export_session_trace(session_id: str, ctx: Ctx, tenant: Tenant) -> TraceExportResponse:
    return await session_queries.trace_export(ctx, tenant, session_id)


@router.get("/billing/usage/checkpoints/current")
async def current_checkpoint_storage_usage(
    ctx: Ctx, tenant: Tenant, project_id: str | None = None
) -> StorageUsageResponse:
    return await runs.storage_usage(ctx, tenant)
