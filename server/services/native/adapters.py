"""Native adapters: a twinkle client's `(session, adapter_name)` is one of our training models, plus the settings and
progress the native protocol keeps per adapter (SQL: `native_adapters`).

Every native model route names its adapter by the `X-Twinkle-Session-Id` header and the body's `adapter_name`; the
session must be the caller's (another tenant's session id finds nothing), so an adapter is reachable only with its
owner's key. Operations of one adapter run one at a time (the client waits for each anyway): `locked` serialises
them in this gateway, and `run` queues each job under the adapter's next seq_id and waits for its result, since the
native protocol has no futures.
"""

from __future__ import annotations

import asyncio
import copy
import re
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from api_schemas.jobs import CreateModel, JobResult, ModelReady, Output, Payload
from api_schemas.training import LoraSpec
from server.db import repositories as repo
from server.db.models import ModelRow, NativeAdapterRow, SessionRow
from server.errors import BadRequest, DomainError, Gone, NotFound
from server.services import jobs
from server.services.context import Context
from server.services.models import model_id_for, owned_model
from server.services.sessions import live_session
from server.services.tenant_caps import check_room

ADAPTER_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_WAIT_SECONDS = 590.0  # the client gives every request 600 s
MAX_ADAPTERS_PER_SESSION = 64

# upstream's adapter defaults: CE summed, its template, the loss, accuracy and train metrics
DEFAULT_SETTINGS: dict[str, Any] = {
    "gas": 1,
    "loss": {"name": "CrossEntropyLoss", "args": {"reduction": "sum"}},
    "optimizer": None,
    "scheduler": None,
    "metrics": [{"name": n, "args": {}, "is_training": None} for n in ("LossMetric", "Accuracy", "TrainMetric")],
    "template": {"name": "Template", "args": {}},
    "processor": {"name": "InputProcessor", "args": {}},
}


class JobFailed(DomainError):
    """A job failed in the worker with a server fault."""


@dataclass
class Adapter:
    """One native adapter as its operation sees it: copies of its rows (write back with `save_state`)."""

    model: ModelRow
    name: str
    settings: dict[str, Any]
    progress: dict[str, Any]
    reserved: int | None = None  # a seq_id taken with the adapter's state, for the op's job (see `find`)


def fresh_progress() -> dict[str, Any]:
    return {"backwards": 0, "steps": 0, "consumed_train_samples": 0, "window": {"backwards": 0, "tokens": 0},
            "metrics": {}, "started_at": time.time()}


async def native_session(ctx: Context, tenant_id: str, session_id: str | None) -> SessionRow:
    """The caller's live session named by X-Twinkle-Session-Id; 404 (never 410, which the client reads as
    StopIteration) when it is unknown, another tenant's or ended."""
    if not session_id:
        raise BadRequest("missing X-Twinkle-Session-Id header: create a session first (init_twinkle_client)")
    try:
        return await live_session(ctx, tenant_id, session_id)
    except Gone:
        raise NotFound(f"session {session_id} has ended (no heartbeat within the session timeout); "
                       "create a new client") from None


def check_adapter_name(name: object, first: str = "add_adapter_to_model") -> str:
    if not isinstance(name, str) or not ADAPTER_NAME.match(name):
        raise BadRequest(f"adapter_name {name!r} must be 1-64 letters, digits, '.', '_' or '-' "
                         f"(call {first} first)")
    return name


Reserve = Callable[[dict[str, Any], dict[str, Any]], bool]  # (settings, progress) -> will the op queue a job?


async def find(ctx: Context, tenant_id: str, session_id: str | None, adapter_name: object,
               reserve: Reserve | None = None) -> Adapter:
    """The caller's adapter `adapter_name` of its live session; 404 otherwise. One transaction on the way that
    works: when `reserve` says the op will queue a job, its seq_id is taken in it too (`Adapter.reserved`; an op
    that then queues nothing hands it back with `release_unused`)."""
    name = check_adapter_name(adapter_name)
    if not session_id:
        await native_session(ctx, tenant_id, session_id)  # raises: no session header
    reserved = None
    async with ctx.db.connection() as c:
        state = await repo.native_state(c, tenant_id, str(session_id), name)
        if state is not None and not state.released and reserve is not None and reserve(state.settings,
                                                                                        state.progress):
            reserved = await repo.take_native_seq(c, state.model_id)
    if state is None:
        await native_session(ctx, tenant_id, session_id)  # the session's own 404 (unknown, another's, ended)
        raise NotFound(f"adapter {name!r} not found in this session; call add_adapter_to_model first")
    if state.released:
        raise NotFound(f"adapter {name!r} was released when its session ended; resume from a saved checkpoint")
    model = await owned_model(ctx, tenant_id, state.model_id)  # cached: a model's owner and shape never change
    return Adapter(model, name, state.settings, state.progress, reserved)


def always(settings: dict[str, Any], progress: dict[str, Any]) -> bool:
    return True


def window_full(settings: dict[str, Any], progress: dict[str, Any]) -> bool:
    """The accumulation window holds its `gradient_accumulation_steps` backwards: optimizer calls act now."""
    return int(progress.get("window", {}).get("backwards", 0)) >= max(int(settings.get("gas", 1)), 1)


async def release_unused(ctx: Context, adapter: Adapter) -> None:
    """A reserved seq_id the op did not use becomes a Skip job, so the adapter's later jobs are not held back."""
    if adapter.reserved is not None:
        seq, adapter.reserved = adapter.reserved, None
        await jobs.queue_skip(ctx, adapter.model.tenant_id, adapter.model, seq, "the operation queued no job")


async def create(ctx: Context, tenant_id: str, session: SessionRow, base_model: str, name: str,
                 lora: LoraSpec | None, gas: int) -> Adapter:
    """A new adapter of `session` (its model created on the worker before this returns); `lora` None: a
    full-parameter run (held while the model's lease is taken: this waits for it, server/services/full_param.py)."""
    served = ctx.served(base_model)
    await check_room(ctx, tenant_id, "models")
    async with ctx.db.session() as s:
        if await repo.native_adapter(s, tenant_id, session.id, name) is not None:
            raise BadRequest(f"adapter {name!r} already exists in this session; use another adapter_name")
        taken = await repo.count_session_models(s, session.id)
        if taken >= MAX_ADAPTERS_PER_SESSION:
            raise BadRequest(f"a session holds at most {MAX_ADAPTERS_PER_SESSION} adapters")
        seed = lora.seed if lora is not None and lora.seed is not None else secrets.randbelow(2**31)
        model = ModelRow(
            id=model_id_for(session.id, taken), tenant_id=tenant_id, session_id=session.id, model_seq_id=taken,
            base_model=served.name, lora_rank=lora.rank if lora else 0, full_param=lora is None, seed=seed,
            train_attn=True, train_mlp=True,
            train_unembed=False, optimizer="adamw", create_request_id=str(uuid.uuid4()), user_metadata={},
        )
        await repo.add(s, model)
        row = NativeAdapterRow(model_id=model.id, tenant_id=tenant_id, session_id=session.id, adapter_name=name,
                               next_seq=1, settings={**DEFAULT_SETTINGS, "gas": gas,
                                                     "lora": lora.model_dump() if lora else None},
                               progress=fresh_progress())
        await repo.add(s, row)
        model.create_request_id = await jobs.queue_train(
            ctx, tenant_id=tenant_id, base_model=served.name, model_id=model.id, seq_id=0,
            payload=CreateModel(lora=lora.model_copy(update={"seed": seed}) if lora else None))
    adapter = Adapter(model, name, copy.deepcopy(row.settings), copy.deepcopy(row.progress))
    ready = await wait_output(ctx, model.create_request_id)
    if isinstance(ready, ModelReady) and ready.parameters is not None:
        adapter.settings["parameters"] = {k: list(v) for k, v in ready.parameters.items()}
        await save_state(ctx, adapter)
    return adapter


def lora_of(adapter: Adapter) -> LoraSpec | None:
    """The adapter's LoRA, None for a full-parameter run."""
    lora = adapter.settings.get("lora")
    return None if lora is None else LoraSpec.model_validate(lora)


@asynccontextmanager
async def locked(ctx: Context, tenant_id: str, session_id: str | None, name: str) -> AsyncIterator[None]:
    """One operation at a time on the adapter `name` of this session (in this gateway)."""
    async with ctx.native.lock(f"{tenant_id}/{session_id}/{name}"):
        yield


async def take_seq(ctx: Context, adapter: Adapter) -> int:
    """The seq_id of the adapter's next operation (each is used once): the reserved one, else a new one."""
    if adapter.reserved is not None:
        seq, adapter.reserved = adapter.reserved, None
        return seq
    async with ctx.db.connection() as c:
        return await repo.take_native_seq(c, adapter.model.id)


async def run(ctx: Context, adapter: Adapter, payload: Payload) -> Output:
    """Queue `payload` as the adapter's next operation and wait for its output (under `locked`)."""
    seq = await take_seq(ctx, adapter)
    request_id = await jobs.queue_train(ctx, tenant_id=adapter.model.tenant_id, base_model=adapter.model.base_model,
                                        model_id=adapter.model.id, seq_id=seq, payload=payload)
    return await wait_output(ctx, request_id)


async def wait_output(ctx: Context, request_id: str) -> Output:
    """The output of a queued job; its failure as BadRequest (the tenant's input) or JobFailed (a server fault)."""
    return output_of(await wait_result(ctx, request_id))


def output_of(result: JobResult) -> Output:
    if result.error is not None:
        if result.error.category.value == "user":
            raise BadRequest(result.error.message)
        raise JobFailed(result.error.message)
    if result.output is None:
        raise JobFailed(f"job {result.job_id} finished without a result")
    return result.output


async def wait_result(ctx: Context, request_id: str) -> JobResult:
    deadline = time.monotonic() + MAX_WAIT_SECONDS
    while time.monotonic() < deadline:
        result = await jobs.wait_result(ctx, request_id, ctx.settings.long_poll_seconds)
        if result is not None:
            ctx.recent.get(request_id, delivered=True)
            return result
        await asyncio.sleep(0)
    raise JobFailed("the worker did not answer in time; the operation may still complete")


async def save_state(ctx: Context, adapter: Adapter) -> None:
    """Write the adapter's settings and progress back."""
    async with ctx.db.connection() as c:
        await repo.update_native_adapter(c, adapter.model.id, settings=adapter.settings, progress=adapter.progress)
