"""Client bootstrap and service-level endpoints: client/config, dynamic_config, telemetry, capabilities."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api_schemas.tinker.types import ServerCapabilities
from server.api.deps import Ctx, Tenant
from server.services import models

router = APIRouter()


@router.post("/client/config")
async def client_config(ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    # zstd bodies save bandwidth; the server decodes both forms. custom_loss_server_side: create_custom_loss
    # uploads the traced loss and forward_backward_custom runs it here by loss id (plain callables stay client-side).
    return {"proto_compress_fwdbwd": True, "fwdbwd_max_chunk_len": ctx.settings.client_fwdbwd_max_chunk_len,
            "custom_loss_server_side": True}


@router.post("/client/dynamic_config")
async def client_dynamic_config(tenant: Tenant) -> dict[str, Any]:
    return {"refresh_interval_sec": 300}


@router.post("/telemetry")
async def telemetry(tenant: Tenant) -> dict[str, str]:
    return {"status": "accepted"}  # accepted and discarded: client diagnostics are not stored


@router.get("/get_server_capabilities")
async def get_server_capabilities(ctx: Ctx, tenant: Tenant) -> ServerCapabilities:
    return models.capabilities(ctx)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}
