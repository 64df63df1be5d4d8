"""The native management routes' answers (twinkle_client's TwinkleClient): sessions, capabilities, capacity,
training runs, checkpoints, checkpoint paths, delete, weights info.

They are the Tinker REST services' answers in twinkle_client's shapes: the same runs and checkpoints, named by
`twinkle://` paths (`tinker://` ones name the same). The owner is an opaque id, never a key; no answer names a server
path (`path` of checkpoint_path is the twinkle:// path too). A session ends like a Tinker session (no heartbeat
within the timeout): its adapters are released, their saved checkpoints stay.
"""

from __future__ import annotations

from typing import Any

from api_schemas.tinker.types import MAX_METADATA_ITEMS, MAX_METADATA_KEY, MAX_METADATA_VALUE, CreateSessionRequest
from server.db import repositories as repo
from server.db.models import SQL_INT_MAX
from server.errors import BadRequest, Gone, NotFound
from server.services import checkpoints as ckpt
from server.services import runs, sessions
from server.services.context import Context

NATIVE_SDK = "twinkle_client"


async def create_session(ctx: Context, tenant_id: str, metadata: object) -> str:
    if metadata is not None and not isinstance(metadata, dict):
        raise BadRequest("metadata must be an object or null")
    items = list((metadata or {}).items())
    if len(items) > MAX_METADATA_ITEMS:
        raise BadRequest(f"metadata holds at most {MAX_METADATA_ITEMS} entries")
    user_metadata = {str(k)[:MAX_METADATA_KEY]: str(v)[:MAX_METADATA_VALUE] for k, v in items}
    req = CreateSessionRequest(tags=["twinkle-native"], user_metadata=user_metadata, sdk_version=NATIVE_SDK)
    return await sessions.create_session(ctx, tenant_id, req)


async def heartbeat(ctx: Context, tenant_id: str, session_id: object) -> None:
    if not isinstance(session_id, str) or not session_id:
        raise BadRequest("session_id must be a non-empty string")
    try:
        await sessions.heartbeat(ctx, tenant_id, session_id)
    except Gone as e:  # 410 means StopIteration to this client: an ended session is a 404 here
        raise NotFound(e.message) from None


def capabilities(ctx: Context) -> dict[str, Any]:
    return {"supported_models": [{"model_name": m.name, "max_context_length": m.max_context}
                                 for m in ctx.models.values()]}


async def capacity(ctx: Context, tenant_id: str) -> dict[str, int]:
    """The caller's live adapters against its live-model quota (else the server's configured capacity), never more
    than the hard cap of live models a tenant may hold (max_models_per_tenant)."""
    async with ctx.db.session() as s:
        used = await repo.count_live_models(s, tenant_id)
    limit = (await ctx.admission.limits.get(tenant_id)).max_models
    cap = limit if limit is not None else max(used, ctx.settings.native_capacity_adapters)
    cap = min(cap, ctx.settings.max_models_per_tenant)
    return {"max_loras": cap, "used_loras": used, "free_loras": max(cap - used, 0)}


def _twinkle(path: str) -> str:
    return "twinkle://" + path.split("://", 1)[1] if "://" in path else path


def checkpoint(c: dict[str, Any], base_model: str, lora_rank: int) -> dict[str, Any]:
    return {"checkpoint_id": c["checkpoint_id"], "checkpoint_type": c["checkpoint_type"], "time": c["time"],
            "size_bytes": c.get("size_bytes") or 0, "twinkle_path": _twinkle(c["tinker_path"]),
            "public": c.get("public", False), "base_model": base_model, "is_lora": True, "lora_rank": lora_rank,
            "user_metadata": c.get("user_metadata")}


def _run(r: dict[str, Any]) -> dict[str, Any]:
    def ck(c: dict[str, Any] | None) -> dict[str, Any] | None:
        return checkpoint(c, r["base_model"], r["lora_rank"]) if c else None

    return {"training_run_id": r["training_run_id"], "base_model": r["base_model"], "model_owner": r["model_owner"],
            "is_lora": True, "corrupted": False, "lora_rank": r["lora_rank"],
            "last_request_time": r["last_request_time"], "last_checkpoint": ck(r.get("last_checkpoint")),
            "last_sampler_checkpoint": ck(r.get("last_sampler_checkpoint")), "user_metadata": r.get("user_metadata")}


async def list_runs(ctx: Context, tenant_id: str, limit: int, offset: int) -> dict[str, Any]:
    if not 1 <= limit <= 1000 or not 0 <= offset <= SQL_INT_MAX:
        raise BadRequest(f"limit must be 1-1000 and offset 0-{SQL_INT_MAX}")
    page = (await runs.list_runs(ctx, tenant_id, limit, offset, "owned", None)).model_dump(mode="json")
    return {"training_runs": [_run(r) for r in page["training_runs"]], "cursor": page["cursor"]}


async def get_run(ctx: Context, tenant_id: str, run_id: str) -> dict[str, Any]:
    return _run((await runs.get_run(ctx, tenant_id, run_id, "owned")).model_dump(mode="json"))


async def list_checkpoints(ctx: Context, tenant_id: str, run_id: str) -> dict[str, Any]:
    run = await runs.get_run(ctx, tenant_id, run_id, "owned")
    page = (await ckpt.list_run(ctx, tenant_id, run_id)).model_dump(mode="json")
    rows = sorted(page["checkpoints"], key=lambda c: c["time"])  # the client takes the last one as the latest
    return {"checkpoints": [checkpoint(c, run.base_model, run.lora_rank or 0) for c in rows], "cursor": None}


def split_checkpoint_id(checkpoint_id: str) -> tuple[str, str]:
    kind, _, name = checkpoint_id.partition("/")
    if kind not in ("weights", "sampler_weights") or not name or "/" in name or name in (".", ".."):
        raise BadRequest(f"checkpoint id {checkpoint_id!r} must be weights/<name> or sampler_weights/<name>")
    return kind, name


async def checkpoint_path(ctx: Context, tenant_id: str, run_id: str, checkpoint_id: str) -> dict[str, str]:
    kind, name = split_checkpoint_id(checkpoint_id)
    row = await ckpt.owned(ctx, tenant_id, run_id, kind, name)
    path = _twinkle(row.tinker_path)
    return {"path": path, "twinkle_path": path}  # never a server directory


async def delete_checkpoint(ctx: Context, tenant_id: str, run_id: str, checkpoint_id: str) -> dict[str, Any]:
    kind, name = split_checkpoint_id(checkpoint_id)
    await ckpt.delete(ctx, tenant_id, run_id, kind, name)
    return {"success": True, "message": f"deleted twinkle://{run_id}/{checkpoint_id}"}


async def weights_info(ctx: Context, tenant_id: str, path: object) -> dict[str, Any]:
    if not isinstance(path, str) or not path.startswith(ckpt.SCHEMES):
        raise BadRequest("twinkle_path must be a twinkle:// path of one of your checkpoints (hub ids are not read)")
    p = ckpt.TinkerPath.parse(path)
    info = await runs.weights_info(ctx, tenant_id, path)
    run = await runs.get_run(ctx, tenant_id, p.model_id, "accessible")
    return {"training_run_id": p.model_id, "base_model": info.base_model, "model_owner": run.model_owner,
            "is_lora": True, "lora_rank": info.lora_rank}
