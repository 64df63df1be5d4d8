"""The native protocol's sampler routes (`/api/v1/sampler/{model}/twinkle/<op>`, twinkle_client's vLLMSampler).
Services: server/services/native/sampler.py."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Header

from api_schemas.native.components import ComponentError, resolve
from server.api.deps import Ctx, Tenant
from server.errors import BadRequest
from server.services.native import sampler, sampler_adapters, settings

router = APIRouter(prefix="/sampler/{model:path}/twinkle")

JsonBody = Annotated[dict[str, Any], Body(default_factory=dict)]
SessionId = Annotated[str | None, Header(alias="X-Twinkle-Session-Id")]  # missing where needed: the service's 400


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
async def add_adapter_to_sampler(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody,
                                 session: SessionId = None) -> dict[str, Any]:
    """A LoRA slot of the caller's session on this sampler: a name and a config, no weights (the protocol's weight
    sync is not offered), so sample(adapter_name=...) with it samples the base model; trained weights are sampled by
    sample(adapter_uri=<a twinkle:// path of save(is_sampler=True)>)."""
    name = await sampler_adapters.add(ctx, tenant, session, model, body)
    return {"status": "ok", "adapter_name": name}


@router.post("/apply_patch")
async def apply_patch(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody) -> dict[str, Any]:
    ctx.served(model)
    settings.apply_patch(body.get("patch_cls"))
    return {"status": "ok"}


@router.post("/sample")
async def sample(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    return await sampler.sample(ctx, tenant, model, body, session)
