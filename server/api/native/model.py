"""The native protocol's model routes (`/api/v1/model/{model}/twinkle/<op>`, twinkle_client's
MultiLoraTransformersModel). `{model}` is a served model's name and may contain slashes.

Each body is a JSON object: the op's named fields plus the method's kwargs at the top level. The adapter is the
caller's `(X-Twinkle-Session-Id, adapter_name)`; operations of one adapter run one at a time and answer when done
(the protocol has no futures). Services: server/services/native/.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header

from server.api.deps import Ctx, Tenant
from server.errors import BadRequest, NotFound
from server.services.context import Context
from server.services.native import adapters, hub, metrics, saves, settings, steps
from server.services.native.adapters import Adapter

router = APIRouter(prefix="/model/{model:path}/twinkle")

JsonBody = Annotated[dict[str, Any], Body(default_factory=dict)]
SessionId = Annotated[str | None, Header(alias="X-Twinkle-Session-Id")]  # missing: the service's clear 400
OK: dict[str, Any] = {"status": "ok"}


@asynccontextmanager
async def adapter_op(ctx: Context, tenant: str, session: str | None, model: str, body: dict[str, Any],
                     reserve: adapters.Reserve | None = None) -> AsyncIterator[tuple[Adapter, dict[str, Any]]]:
    """The caller's adapter named by the body (locked for the operation) and the body's other fields. `reserve`:
    whether the op will queue a job (its seq_id is then taken with the state; unused, it becomes a Skip)."""
    ctx.served(model)
    kwargs = dict(body)
    name = adapters.check_adapter_name(kwargs.pop("adapter_name", None))
    async with adapters.locked(ctx, tenant, session, name):  # the state read inside is the previous op's result
        adapter = await adapters.find(ctx, tenant, session, name, reserve)
        try:
            if adapter.model.base_model != model:
                raise NotFound(f"adapter {adapter.name!r} is trained on {adapter.model.base_model}, not {model}")
            yield adapter, kwargs
        finally:
            await adapters.release_unused(ctx, adapter)


def _pop(kwargs: dict[str, Any], name: str, default: Any = None) -> Any:
    return kwargs.pop(name, default)


def _no_extra(kwargs: dict[str, Any], op: str) -> None:
    if kwargs:
        raise BadRequest(f"{op}: unknown arguments {sorted(kwargs)}")


@router.post("/create")
async def create(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody) -> dict[str, Any]:
    ctx.served(model)  # the client's model object; adapters are made by add_adapter_to_model
    return OK


@router.post("/add_adapter_to_model")
async def add_adapter_to_model(model: str, ctx: Ctx, tenant: Tenant,
                               body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    kwargs = dict(body)
    name, config = kwargs.pop("adapter_name", None), kwargs.pop("config", None)
    adapter = await settings.add_adapter(ctx, tenant, session, model, name, config, kwargs)
    return {"status": "ok", "adapter_name": adapter.name}


def _setter(op: str, slot: settings.Slot, field: str) -> None:
    async def handler(model: str, ctx: Ctx, tenant: Tenant,
                      body: JsonBody, session: SessionId = None) -> dict[str, Any]:
        async with adapter_op(ctx, tenant, session, model, body) as (adapter, kwargs):
            await settings.set_component(ctx, adapter, slot, kwargs.pop(field, None), kwargs)
        return OK

    handler.__name__ = op
    router.post(f"/{op}", name=op)(handler)


for _op, _slot, _field in (("set_template", "template", "template_cls"),
                           ("set_processor", "processor", "processor_cls"), ("set_loss", "loss", "loss_cls"),
                           ("set_optimizer", "optimizer", "optimizer_cls"),
                           ("set_lr_scheduler", "scheduler", "scheduler_cls")):
    _setter(_op, _slot, _field)  # type: ignore[arg-type]


@router.post("/add_metric")
async def add_metric(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    async with adapter_op(ctx, tenant, session, model, body) as (adapter, kwargs):
        await settings.add_metric(ctx, adapter, kwargs.pop("metric_cls", None), kwargs.pop("is_training", None),
                                  kwargs)
    return OK


@router.post("/apply_patch")
async def apply_patch(model: str, ctx: Ctx, tenant: Tenant,
                      body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    ctx.served(model)
    settings.apply_patch(body.get("patch_cls"))
    return OK


@router.post("/forward_backward")
async def forward_backward(model: str, ctx: Ctx, tenant: Tenant,
                           body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    async with adapter_op(ctx, tenant, session, model, body, adapters.always) as (adapter, kwargs):
        return {"result": await steps.forward_backward(ctx, adapter, _pop(kwargs, "inputs"), kwargs)}


@router.post("/forward_only")
async def forward_only(model: str, ctx: Ctx, tenant: Tenant,
                       body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    async with adapter_op(ctx, tenant, session, model, body, adapters.always) as (adapter, kwargs):
        return {"result": await steps.forward_only(ctx, adapter, _pop(kwargs, "inputs"), kwargs)}


@router.post("/forward")
async def forward(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    async with adapter_op(ctx, tenant, session, model, body, adapters.always) as (adapter, kwargs):
        return {"result": await steps.forward(ctx, adapter, _pop(kwargs, "inputs"), kwargs)}


@router.post("/calculate_loss")
async def calculate_loss(model: str, ctx: Ctx, tenant: Tenant,
                         body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    async with adapter_op(ctx, tenant, session, model, body, adapters.always) as (adapter, kwargs):
        return {"result": await steps.calculate_loss(ctx, adapter, kwargs)}


@router.post("/backward")
async def backward(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    async with adapter_op(ctx, tenant, session, model, body, adapters.always) as (adapter, kwargs):
        await steps.backward(ctx, adapter, kwargs)
    return OK


@router.post("/clip_grad_norm")
async def clip_grad_norm(model: str, ctx: Ctx, tenant: Tenant,
                         body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    async with adapter_op(ctx, tenant, session, model, body, adapters.window_full) as (adapter, kwargs):
        norm = await steps.clip_grad_norm(ctx, adapter, _pop(kwargs, "max_grad_norm", 1.0),
                                          _pop(kwargs, "norm_type", 2))
    return {"result": norm}  # a JSON string, as the client's response model requires


@router.post("/clip_grad_and_step")
async def clip_grad_and_step(model: str, ctx: Ctx, tenant: Tenant,
                             body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    async with adapter_op(ctx, tenant, session, model, body, adapters.window_full) as (adapter, kwargs):
        norm = await steps.step(ctx, adapter, _pop(kwargs, "max_grad_norm", 1.0), _pop(kwargs, "norm_type", 2))
    return {"status": "ok", "result": norm}


@router.post("/step")
async def step(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    async with adapter_op(ctx, tenant, session, model, body, adapters.window_full) as (adapter, _):
        await steps.step(ctx, adapter, None)
    return OK


@router.post("/zero_grad")
async def zero_grad(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    async with adapter_op(ctx, tenant, session, model, body, adapters.window_full) as (adapter, _):
        await steps.zero_grad(ctx, adapter)
    return OK


@router.post("/lr_step")
async def lr_step(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    """The schedule follows the adapter's optimizer steps (the engine counts them): nothing to advance here."""
    async with adapter_op(ctx, tenant, session, model, body):
        pass
    return OK


@router.post("/calculate_metric")
async def calculate_metric(model: str, ctx: Ctx, tenant: Tenant,
                           body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    async with adapter_op(ctx, tenant, session, model, body) as (adapter, kwargs):
        result = metrics.calculate(adapter.progress, adapter.settings, bool(_pop(kwargs, "is_training", True)))
        await adapters.save_state(ctx, adapter)
    return {"result": result}


@router.post("/get_train_configs")
async def get_train_configs(model: str, ctx: Ctx, tenant: Tenant,
                            body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    async with adapter_op(ctx, tenant, session, model, body) as (adapter, _):
        return {"result": settings.train_configs(adapter)}


@router.post("/upload_to_hub")
async def upload_to_hub(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody) -> dict[str, Any]:
    ctx.served(model)
    return await hub.upload(ctx, tenant, body)


@router.get("/upload_status/{request_id}")
async def upload_status(model: str, request_id: str, ctx: Ctx, tenant: Tenant) -> dict[str, Any]:
    return await hub.status(ctx, tenant, request_id)


@router.post("/get_state_dict")
async def get_state_dict(model: str, ctx: Ctx, tenant: Tenant,
                         body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    """The adapter's parameter names and shapes (the tensors themselves are not JSON: save() and download)."""
    async with adapter_op(ctx, tenant, session, model, body) as (adapter, _):
        return {"result": adapter.settings.get("parameters", {})}


@router.post("/save")
async def save(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    async with adapter_op(ctx, tenant, session, model, body, adapters.always) as (adapter, kwargs):
        return await saves.save(ctx, adapter, _pop(kwargs, "name"), kwargs)


@router.post("/load")
async def load(model: str, ctx: Ctx, tenant: Tenant, body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    async with adapter_op(ctx, tenant, session, model, body, adapters.always) as (adapter, kwargs):
        name, with_optimizer = _pop(kwargs, "name"), bool(_pop(kwargs, "load_optimizer", False))
        _no_extra(kwargs, "load")
        await saves.load(ctx, adapter, name, with_optimizer)
    return OK


@router.post("/resume_from_checkpoint")
async def resume_from_checkpoint(model: str, ctx: Ctx, tenant: Tenant,
                                 body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    async with adapter_op(ctx, tenant, session, model, body, adapters.always) as (adapter, kwargs):
        name, only_model = _pop(kwargs, "name"), bool(_pop(kwargs, "resume_only_model", False))
        _no_extra(kwargs, "resume_from_checkpoint")
        return {"result": await saves.resume(ctx, adapter, name, only_model)}
