"""The native protocol's sampler routes (`/api/v1/sampler/{model}/twinkle/<op>`, twinkle_client's vLLMSampler).
Services: server/services/native/sampler.py."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body

from api_schemas.native.components import ComponentError, resolve
from server.api.deps import Ctx, Tenant
from server.errors import BadRequest
from server.services.native import sampler, settings

router = APIRouter(prefix="/sampler/{model:path}/twinkle")

JsonBody = Annotated[dict[str, Any], Body(default_factory=dict)]


@router.post("/create")
async def create(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody) -> dict[str, Any]:
    ctx.served(model)  # the shared sampler is there for every tenant; nothing is created per client
    return {"status": "ok"}


@router.post("/set_template")
async def set_template(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody) -> dict[str, Any]:
    """Trajectories are always rendered with the served model's own chat template: the name and kwargs are
    checked against the allow-list, nothing is stored for (or changed for) other tenants."""
    ctx.served(model)
    kwargs = {k: v for k, v in body.items() if k not in ("template_cls", "adapter_name", "model_id")}
    try:
        resolve("template", body.get("template_cls"), kwargs)
    except ComponentError as e:
        raise BadRequest(str(e)) from None
    return {"status": "ok"}


@router.post("/add_adapter_to_sampler")
async def add_adapter_to_sampler(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody) -> dict[str, Any]:
    ctx.served(model)
    raise BadRequest("add_adapter_to_sampler is not offered: save the adapter with save(is_sampler=True) and "
                     "pass its twinkle:// path as sample(adapter_uri=...)")


@router.post("/apply_patch")
async def apply_patch(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody) -> dict[str, Any]:
    ctx.served(model)
    settings.apply_patch(body.get("patch_cls"))
    return {"status": "ok"}


@router.post("/sample")
async def sample(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody) -> dict[str, Any]:
    return await sampler.sample(ctx, tenant, model, body)
