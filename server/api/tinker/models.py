"""Model routes: create_model (future) and get_info."""

from __future__ import annotations

from fastapi import APIRouter

from api_schemas.tinker.types import CreateModelRequest, GetInfoRequest, GetInfoResponse, UntypedFuture
from server.api.deps import Ctx, Tenant
from server.services import models

router = APIRouter()


@router.post("/create_model")
async def create_model(req: CreateModelRequest, ctx: Ctx, tenant: Tenant) -> UntypedFuture:
    return await models.create_model(ctx, tenant, req)


@router.post("/get_info")
async def get_info(req: GetInfoRequest, ctx: Ctx, tenant: Tenant) -> GetInfoResponse:
    return await models.get_info(ctx, tenant, req.model_id)
