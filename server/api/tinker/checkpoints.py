"""Checkpoint routes of the RestClient: list (per run, per tenant), delete, publish / unpublish, TTL, external weights
(save + signed URLs), weights_info and copy_weights. Checkpoint ids are "{segment}/{name}", two path segments."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from api_schemas.tinker.rest import (
    CheckpointsListResponse,
    CopyWeightsRequest,
    CopyWeightsResponse,
    ExternalWeightsUrlsResponse,
    SaveWeightsExternalRequest,
    SetTtlRequest,
    WeightsInfoRequest,
    WeightsInfoResponse,
)
from api_schemas.tinker.types import UntypedFuture
from server.api.deps import Ctx, Offset, Tenant
from server.services import checkpoints, downloads, runs, training

router = APIRouter()
_ONE = "/training_runs/{run_id}/checkpoints/{kind}/{name}"


@router.get("/training_runs/{run_id}/checkpoints")
async def list_checkpoints(run_id: str, ctx: Ctx, tenant: Tenant) -> CheckpointsListResponse:
    return await checkpoints.list_run(ctx, tenant, run_id)


@router.get("/checkpoints")
async def list_user_checkpoints(
    ctx: Ctx, tenant: Tenant, limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Offset = 0,
) -> CheckpointsListResponse:
    return await checkpoints.list_tenant(ctx, tenant, limit, offset)


@router.delete(_ONE, status_code=204)
async def delete_checkpoint(run_id: str, kind: str, name: str, ctx: Ctx, tenant: Tenant) -> Response:
    await checkpoints.delete(ctx, tenant, run_id, kind, name)
    return Response(status_code=204)


@router.post(_ONE + "/publish", status_code=204)
async def publish_checkpoint(run_id: str, kind: str, name: str, ctx: Ctx, tenant: Tenant) -> Response:
    await checkpoints.set_public(ctx, tenant, run_id, kind, name, True)
    return Response(status_code=204)


@router.delete(_ONE + "/publish", status_code=204)
async def unpublish_checkpoint(run_id: str, kind: str, name: str, ctx: Ctx, tenant: Tenant) -> Response:
    await checkpoints.set_public(ctx, tenant, run_id, kind, name, False)
    return Response(status_code=204)


@router.put(_ONE + "/ttl", status_code=204)
async def set_checkpoint_ttl(run_id: str, kind: str, name: str, req: SetTtlRequest, ctx: Ctx, tenant: Tenant) -> Response:
    await checkpoints.set_ttl(ctx, tenant, run_id, kind, name, req.ttl_seconds)
    return Response(status_code=204)


@router.get("/training_runs/{run_id}/checkpoints/external_weights/{name}/external_weights_urls")
async def get_external_weights_urls(
    run_id: str, name: str, request: Request, ctx: Ctx, tenant: Tenant
) -> ExternalWeightsUrlsResponse:
    return await downloads.external_weights_urls(ctx, tenant, run_id, name, str(request.base_url))


@router.post("/save_weights_external")
async def save_weights_external(req: SaveWeightsExternalRequest, ctx: Ctx, tenant: Tenant) -> UntypedFuture:
    return await training.save_weights_external(ctx, tenant, req)


@router.post("/weights_info")
async def weights_info(req: WeightsInfoRequest, ctx: Ctx, tenant: Tenant) -> WeightsInfoResponse:
    return await runs.weights_info(ctx, tenant, req.tinker_path)


@router.post("/copy_weights")
async def copy_weights(
    req: CopyWeightsRequest, ctx: Ctx, tenant: Tenant,
    x_idempotency_key: Annotated[str | None, Header(max_length=256)] = None,
) -> CopyWeightsResponse:
    return CopyWeightsResponse(tinker_path=await runs.copy_weights(ctx, tenant, req, x_idempotency_key))
