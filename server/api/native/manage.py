"""The native protocol's management routes (`/api/v1/twinkle/...`, twinkle_client's TwinkleClient): sessions,
health, capabilities, capacity, training runs, checkpoints, checkpoint paths, delete, weights info.
Services: server/services/native/manage.py."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Query

from server.api.deps import Ctx, Tenant
from server.services.native import manage

router = APIRouter(prefix="/twinkle")

JsonBody = Annotated[dict[str, Any], Body(default_factory=dict)]


@router.post("/create_session")
async def create_session(ctx: Ctx, tenant: Tenant, body: JsonBody) -> dict[str, Any]:
    return {"session_id": await manage.create_session(ctx, tenant, body.get("metadata"))}


@router.post("/session_heartbeat")
async def session_heartbeat(ctx: Ctx, tenant: Tenant, body: JsonBody) -> dict[str, Any]:
    await manage.heartbeat(ctx, tenant, body.get("session_id"))
    return {}


@router.get("/healthz")
async def healthz() -> dict[str, Any]:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
async def get_server_capabilities(ctx: Ctx) -> dict[str, Any]:
    """Also without a key: twinkle_client's TUI probes it before it has one (it lists only model names)."""
    return manage.capabilities(ctx)


@router.get("/capacity_info")
async def capacity_info(ctx: Ctx, tenant: Tenant) -> dict[str, int]:
    return await manage.capacity(ctx, tenant)


@router.get("/training_runs")
async def training_runs(ctx: Ctx, tenant: Tenant, limit: Annotated[int, Query()] = 20,
                        offset: Annotated[int, Query()] = 0,
                        all_users: Annotated[bool, Query()] = False) -> dict[str, Any]:
    """`all_users` is accepted and ignored: a tenant sees its own runs."""
    return await manage.list_runs(ctx, tenant, limit, offset)


@router.get("/training_runs/{run_id}")
async def training_run(run_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    return await manage.get_run(ctx, tenant, run_id)


@router.get("/training_runs/{run_id}/checkpoints")
async def checkpoints(run_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    return await manage.list_checkpoints(ctx, tenant, run_id)


@router.get("/checkpoint_path/{run_id}/{checkpoint_id:path}")
async def checkpoint_path(run_id: str, checkpoint_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, str]:
    return await manage.checkpoint_path(ctx, tenant, run_id, checkpoint_id)


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(run_id: str, checkpoint_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    return await manage.delete_checkpoint(ctx, tenant, run_id, checkpoint_id)


@router.post("/weights_info")
async def weights_info(ctx: Ctx, tenant: Tenant, body: JsonBody) -> dict[str, Any]:
    return await manage.weights_info(ctx, tenant, body.get("twinkle_path"))
