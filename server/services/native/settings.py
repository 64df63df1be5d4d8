"""Adapter creation and the per-adapter settings of the native protocol: add_adapter_to_model, set_template,
set_processor, set_loss, set_optimizer, set_lr_scheduler, add_metric, apply_patch, get_train_configs.

Every `*_cls` name goes through the allow-lists of api_schemas/native/components.py; the stored setting is the
name and its validated kwargs (plain JSON), turned into engine jobs by steps.py.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from api_schemas.native.components import ComponentError, Slot, resolve
from api_schemas.native.lora import LoraConfigError, parse_lora_config
from server.errors import BadRequest
from server.services import full_param
from server.services.context import Context
from server.services.native import adapters
from server.services.native.adapters import Adapter, save_state

MAX_METRICS = 16


def component(slot: Slot, name: object, kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        resolved, args = resolve(slot, name, kwargs)
    except ComponentError as e:
        raise BadRequest(str(e)) from None
    return {"name": resolved, "args": args.model_dump(mode="json", exclude_none=True)}


async def add_adapter(ctx: Context, tenant_id: str, session_id: str | None, base_model: str, adapter_name: object,
                      config: object, kwargs: dict[str, Any]) -> Adapter:
    session = await adapters.native_session(ctx, tenant_id, session_id)
    name = adapters.check_adapter_name(adapter_name)
    ctx.served(base_model)
    if config is None:  # a full-parameter run, where the operator offers it (server/services/full_param.py)
        full_param.require_offered(ctx.settings, base_model)
    gas = kwargs.pop("gradient_accumulation_steps", 1)
    if not isinstance(gas, int) or isinstance(gas, bool) or not 1 <= gas <= 10_000:
        raise BadRequest("gradient_accumulation_steps must be an integer from 1 to 10000")
    kwargs.pop("save_dir", None)  # a client-side path: checkpoints stay in this server's store, named twinkle://
    if kwargs:
        raise BadRequest(f"unknown arguments {sorted(kwargs)}; accepted: config, gradient_accumulation_steps, "
                         "save_dir (ignored)")
    lora = None
    if config is not None:
        try:
            lora = parse_lora_config(config, ctx.settings.max_lora_rank, secrets.randbelow(2**31))
        except LoraConfigError as e:
            raise BadRequest(str(e)) from None
    return await adapters.create(ctx, tenant_id, session, base_model, name, lora, gas)


async def set_component(ctx: Context, adapter: Adapter, slot: Slot, name: object, kwargs: dict[str, Any]) -> None:
    """set_template / set_processor / set_loss / set_optimizer / set_lr_scheduler."""
    kwargs = dict(kwargs)
    if slot == "template":
        kwargs.pop("model_id", None)  # the tokenizer is always the served model's own
    value = component(slot, name, kwargs)
    if slot == "scheduler" and adapter.settings.get("optimizer") is None:
        raise BadRequest("set_optimizer before set_lr_scheduler")
    if slot == "scheduler" and value["name"] in ("CosineWarmupScheduler", "LinearWarmupScheduler"):
        if value["args"]["num_warmup_steps"] > value["args"]["num_training_steps"]:
            raise BadRequest("num_warmup_steps must be <= num_training_steps")
    adapter.settings[slot] = value
    await save_state(ctx, adapter)


async def add_metric(ctx: Context, adapter: Adapter, name: object, is_training: object,
                     kwargs: dict[str, Any]) -> None:
    if is_training is not None and not isinstance(is_training, bool):
        raise BadRequest("is_training must be true, false or null")
    value = {**component("metric", name, kwargs), "is_training": is_training}
    present = adapter.settings.setdefault("metrics", [])
    if len(present) >= MAX_METRICS:
        raise BadRequest(f"an adapter holds at most {MAX_METRICS} metrics")
    if value not in present:
        present.append(value)
    await save_state(ctx, adapter)


def apply_patch(patch_cls: object) -> None:
    component("patch", patch_cls, {})  # the table is empty: every patch is refused, naming why


def train_configs(adapter: Adapter) -> str:
    """A readable summary of the adapter's setup (upstream logs it; no format is promised)."""
    lora = adapters.lora_of(adapter)
    s = adapter.settings
    lines = [
        f"adapter: {adapter.name} (training run {adapter.model.id}) on {adapter.model.base_model}",
        (f"lora: r={lora.rank} alpha={lora.alpha} rslora={lora.rslora} target_modules={list(lora.modules or [])}"
         if lora is not None else "full-parameter training (every weight of a private copy of the base model)"),
        f"loss: {json.dumps(s.get('loss'))}",
        f"optimizer: {json.dumps(s.get('optimizer'))}",
        f"lr_scheduler: {json.dumps(s.get('scheduler'))}",
        f"gradient_accumulation_steps: {s.get('gas', 1)}",
        f"metrics: {[m['name'] for m in s.get('metrics', [])]}",
        f"template: {json.dumps(s.get('template'))}",
        f"progress: {adapter.progress.get('backwards', 0)} backwards, {adapter.progress.get('steps', 0)} steps",
    ]
    return "\n".join(lines)
