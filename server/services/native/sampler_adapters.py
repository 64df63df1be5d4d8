"""The native sampler's LoRA slots: `add_adapter_to_sampler(adapter_name, config)` and `sample(adapter_name=...)`.

Upstream's route hands `<session>-<adapter_name>` and a peft LoraConfig to its sampler (twinkle-kit 0.5.1's
vLLMSampler leaves the call unimplemented, and its `sample(adapter_name=...)` selects no LoRA); a slot's weights
would arrive only by a weight sync, which this server's HTTP protocol does not offer. A fresh LoRA (peft's default
init: B = 0) computes exactly the base model, so a slot here is its name and validated config (SQL
`native_sampler_adapters`) and sampling with its name samples the base model's weights. `adapter_uri` (the
caller's own saved checkpoint) is how trained weights are sampled, and it wins when both are given.

A slot belongs to the caller's tenant, its native session (`X-Twinkle-Session-Id`, which must be the key's tenant's
and live) and the served model whose sampler it was added to: another tenant's session is a 404, and so is a name
this session did not add to this model's sampler. The config passes the same validation and limits as
`add_adapter_to_model`'s (api_schemas/native/lora.py, `TWINKLE_MAX_LORA_RANK`); adding a name again replaces its
config; a session holds at most MAX_PER_SESSION slots. The slots of ended sessions are deleted by the maintenance
loop (`drop_ended`).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from sqlalchemy.exc import IntegrityError

from api_schemas.native.lora import LoraConfigError, parse_lora_config
from api_schemas.training import LoraSpec
from server.db import repositories as repo
from server.db.models import NativeSamplerAdapterRow, utcnow
from server.errors import BadRequest, NotFound
from server.services.context import Context
from server.services.native import adapters

MAX_PER_SESSION = 64
ACCEPTED = ("adapter_name", "config")


def _spec(ctx: Context, config: object) -> LoraSpec:
    if config is None:
        raise BadRequest("config is required: a LoRA config such as {\"r\": 8, \"target_modules\": \"all-linear\"} "
                         "(the sampler has no full-parameter slots)")
    try:  # the seed does not matter: a fresh slot holds no weights of its own
        return parse_lora_config(config, ctx.settings.max_lora_rank, 0)
    except LoraConfigError as e:
        raise BadRequest(str(e)) from None


async def add(ctx: Context, tenant_id: str, session_id: str | None, model: str, body: dict[str, Any]) -> str:
    """add_adapter_to_sampler: the slot `adapter_name` of the caller's session on `model`'s sampler; its name."""
    served = ctx.served(model)
    session = await adapters.native_session(ctx, tenant_id, session_id)
    name = adapters.check_adapter_name(body.get("adapter_name"), first="add_adapter_to_sampler")
    unknown = sorted(set(body) - set(ACCEPTED))
    if unknown:
        raise BadRequest(f"add_adapter_to_sampler: unknown arguments {unknown}; accepted: {list(ACCEPTED)}")
    lora = _spec(ctx, body.get("config")).model_dump(mode="json")
    try:
        async with ctx.db.session() as s:
            row = await repo.sampler_adapter(s, tenant_id, session.id, served.name, name)
            if row is not None:
                row.lora = lora  # added again: the new config replaces the old one
            else:
                if await repo.count_sampler_adapters(s, session.id) >= MAX_PER_SESSION:
                    raise BadRequest(f"a session holds at most {MAX_PER_SESSION} sampler adapters")
                await repo.add(s, NativeSamplerAdapterRow(session_id=session.id, base_model=served.name,
                                                          adapter_name=name, tenant_id=tenant_id, lora=lora))
    except IntegrityError:  # the same name added concurrently: the other request's slot stands
        pass
    return name


async def check(ctx: Context, tenant_id: str, session_id: str | None, model: str, adapter_name: object) -> None:
    """sample(adapter_name=...) without adapter_uri: the name must be a slot the caller's session added to `model`'s
    sampler (it then samples the base model); 400 / 404 otherwise."""
    if not isinstance(adapter_name, str):
        raise BadRequest("adapter_name must be a string ('' samples the base model)")
    session = await adapters.native_session(ctx, tenant_id, session_id)
    name = adapters.check_adapter_name(adapter_name, first="add_adapter_to_sampler")
    async with ctx.db.session() as s:
        row = await repo.sampler_adapter(s, tenant_id, session.id, model, name)
    if row is None:
        raise NotFound(f"adapter_name {name!r} was not added to the sampler of {model} in this session: call "
                       "add_adapter_to_sampler first, pass adapter_uri (a twinkle:// path of your saved checkpoint) "
                       "to sample trained weights, or leave adapter_name empty to sample the base model")


async def drop_ended(ctx: Context) -> int:
    """Maintenance step: delete the sampler adapters of finished or timed-out sessions; returns how many went."""
    stale_before = utcnow() - timedelta(seconds=ctx.settings.session_timeout_seconds)
    async with ctx.db.session() as s:
        return await repo.delete_sampler_adapters_of_ended_sessions(s, stale_before)
