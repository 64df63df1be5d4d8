"""Native hub-push routes: per-tenant hub tokens, push a checkpoint and poll the push, per-run auto-push."""

from __future__ import annotations

from fastapi import APIRouter, Response

from api_schemas.hub import Provider
from api_schemas.native.hub import AutoPushRequest, AutoPushStatus, HubTokenRequest, HubTokenStatus, PushRequest, PushStatus
from server.api.deps import Ctx, Tenant
from server.services import hub_push

router = APIRouter()


@router.put("/hub/tokens/{provider}")
async def set_hub_token(provider: Provider, req: HubTokenRequest, ctx: Ctx, tenant: Tenant) -> HubTokenStatus:
    return await hub_push.set_token(ctx, tenant, provider, req.token.get_secret_value())


@router.get("/hub/tokens/{provider}")
async def get_hub_token(provider: Provider, ctx: Ctx, tenant: Tenant) -> HubTokenStatus:
    return await hub_push.token_status(ctx, tenant, provider)


@router.delete("/hub/tokens/{provider}")
async def delete_hub_token(provider: Provider, ctx: Ctx, tenant: Tenant) -> HubTokenStatus:
    return await hub_push.delete_token(ctx, tenant, provider)


@router.post("/checkpoints/push", status_code=202)
async def push_checkpoint(req: PushRequest, ctx: Ctx, tenant: Tenant) -> PushStatus:
    return await hub_push.start_push(ctx, tenant, req)


@router.get("/pushes/{push_id}")
async def get_push(push_id: str, ctx: Ctx, tenant: Tenant) -> PushStatus:
    return await hub_push.get_push(ctx, tenant, push_id)


@router.put("/training_runs/{run_id}/auto_push")
async def set_auto_push(run_id: str, req: AutoPushRequest, ctx: Ctx, tenant: Tenant) -> AutoPushStatus:
    return await hub_push.set_auto_push(ctx, tenant, run_id, req)


@router.get("/training_runs/{run_id}/auto_push")
async def get_auto_push(run_id: str, ctx: Ctx, tenant: Tenant) -> AutoPushStatus:
    return await hub_push.get_auto_push(ctx, tenant, run_id)


@router.delete("/training_runs/{run_id}/auto_push", status_code=204)
async def delete_auto_push(run_id: str, ctx: Ctx, tenant: Tenant) -> Response:
    await hub_push.delete_auto_push(ctx, tenant, run_id)
    return Response(status_code=204)
