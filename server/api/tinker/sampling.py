"""Sampling routes: create_sampling_session and GET /samplers/{id} (sync), asample (a future)."""

from __future__ import annotations

from fastapi import APIRouter

from api_schemas.tinker.sampling import (
    CreateSamplingSessionRequest,
    CreateSamplingSessionResponse,
    GetSamplerResponse,
    SampleFuture,
    SampleRequest,
)
from server.api.deps import Ctx, Tenant
from server.services import sampling

router = APIRouter()


@router.post("/create_sampling_session")
async def create_sampling_session(req: CreateSamplingSessionRequest, ctx: Ctx, tenant: Tenant) -> CreateSamplingSessionResponse:
    return CreateSamplingSessionResponse(sampling_session_id=await sampling.create_sampling_session(ctx, tenant, req))


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, ctx: Ctx, tenant: Tenant) -> GetSamplerResponse:
    return await sampling.get_sampler(ctx, tenant, sampler_id)


@router.post("/asample")
async def asample(req: SampleRequest, ctx: Ctx, tenant: Tenant) -> SampleFuture:
    return await sampling.asample(ctx, tenant, req)
