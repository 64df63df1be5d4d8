"""Training routes: forward_backward (protobuf body, or JSON from older SDKs), forward (older SDKs), optim_step,
save/load weights. Each returns a future."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api_schemas.tinker.types import (
    LoadWeightsRequest,
    OptimStepRequest,
    SaveWeightsForSamplerRequest,
    SaveWeightsRequest,
    UntypedFuture,
)
from server.api.deps import Ctx, Tenant
from server.services import training

router = APIRouter()


@router.post("/forward_backward",
             openapi_extra={"requestBody": {"content": {"application/x-protobuf": {}, "application/json": {}}}})
async def forward_backward(request: Request, ctx: Ctx, tenant: Tenant) -> UntypedFuture:
    """A protobuf ForwardBackwardRequest (SDK 0.38), or its JSON form (older SDKs, e.g. 0.16.1)."""
    body = await request.body()  # read by the gate, bounded by max_request_bytes (server/api/gate.py)
    return await training.forward_backward(ctx, tenant, body, request.headers.get("content-encoding"),
                                           request.headers.get("content-type"))


@router.post("/forward", openapi_extra={"requestBody": {"content": {"application/json": {}}}})
async def forward(request: Request, ctx: Ctx, tenant: Tenant) -> UntypedFuture:
    """Older SDKs' (0.16.1) forward: a JSON ForwardRequest (`forward_input`); 0.38 sends forward_backward with
    forward_only instead."""
    body = await request.body()
    return await training.forward(ctx, tenant, body, request.headers.get("content-encoding"))


@router.post("/optim_step")
async def optim_step(req: OptimStepRequest, ctx: Ctx, tenant: Tenant) -> UntypedFuture:
    return await training.optim_step(ctx, tenant, req)


@router.post("/save_weights")
async def save_weights(req: SaveWeightsRequest, ctx: Ctx, tenant: Tenant) -> UntypedFuture:
    return await training.save_weights(ctx, tenant, req)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(req: SaveWeightsForSamplerRequest, ctx: Ctx, tenant: Tenant) -> UntypedFuture:
    return await training.save_weights_for_sampler(ctx, tenant, req)


@router.post("/load_weights")
async def load_weights(req: LoadWeightsRequest, ctx: Ctx, tenant: Tenant) -> UntypedFuture:
    return await training.load_weights(ctx, tenant, req)
