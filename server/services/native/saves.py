"""Native saves and loads: save (training or sampler weights), load, resume_from_checkpoint.

A native save is an ordinary checkpoint of the adapter's training run, so `twinkle://<run>/weights/<name>` and
`tinker://<run>/weights/<name>` name the same files and either client family can load or sample it. The answer never
names a server path (`checkpoint_dir` is null). A save with `save_optimizer=True` also records the trainer progress
(`trainer_state`: backwards so far, accumulation steps, consumed samples) that `resume_from_checkpoint` answers.
Only the caller's own (or published) checkpoints load; anything but a twinkle:// or tinker:// path is refused.
"""

from __future__ import annotations

import re
import time
from typing import Any

from api_schemas.jobs import LoadWeights, ModelReady, SaveResult
from server.db import repositories as repo
from server.db.models import CheckpointRow
from server.errors import BadRequest
from server.services import checkpoints as ckpt
from server.services import training
from server.services.context import Context
from server.services.native.adapters import Adapter, JobFailed, output_of, run, save_state, take_seq, wait_result

TRAINER_STATE_VERSION = 1


def checkpoint_name(name: object) -> str:
    """Upstream's sanitising: characters outside [A-Za-z0-9_-] become '_'; empty: a timestamp."""
    if name is not None and not isinstance(name, str):
        raise BadRequest("name must be a string")
    cleaned = re.sub(r"[^A-Za-z0-9_-]", "_", name or "")[:128]
    return cleaned or time.strftime("%Y%m%d_%H%M%S")


def twinkle_path(model_id: str, kind: str, name: str) -> str:
    return f"twinkle://{model_id}/{kind}/{name}"


async def save(ctx: Context, adapter: Adapter, name: object, kwargs: dict[str, Any]) -> dict[str, Any]:
    save_optimizer = bool(kwargs.pop("save_optimizer", False))
    is_sampler = bool(kwargs.pop("is_sampler", False))
    consumed = kwargs.pop("consumed_train_samples", None)
    if consumed is not None and (not isinstance(consumed, int) or isinstance(consumed, bool) or consumed < 0):
        raise BadRequest("consumed_train_samples must be an integer >= 0")
    kwargs.pop("save_dir", None)  # a client path: ignored, the checkpoint stays in this server's store
    if kwargs:
        raise BadRequest(f"unknown arguments {sorted(kwargs)}; accepted: name, save_optimizer, is_sampler, "
                         "consumed_train_samples")
    kind = "sampler_weights" if is_sampler else "weights"
    clean = checkpoint_name(name)
    seq = await take_seq(ctx, adapter)
    fut = await training.save_checkpoint(ctx, adapter.model.tenant_id, adapter.model, seq, kind, clean, None, True,
                                         None)
    result = await wait_result(ctx, fut.request_id)
    out = result.output if isinstance(result.output, SaveResult) else None
    await ckpt.record_result(ctx, fut.request_id, out)  # the row becomes ready (or is dropped if the save failed)
    output_of(result)  # raises the job's failure
    if consumed is not None:
        adapter.progress["consumed_train_samples"] = consumed
    if save_optimizer and not is_sampler:
        state = {"checkpoint_version": TRAINER_STATE_VERSION, "cur_step": adapter.progress.get("backwards", 0),
                 "gradient_accumulation_steps": adapter.settings.get("gas", 1),
                 "consumed_train_samples": adapter.progress.get("consumed_train_samples", 0)}
        async with ctx.db.session() as s:
            row = await repo.checkpoint(s, adapter.model.id, kind, clean)
            if row is not None:
                row.trainer_state = state
    await save_state(ctx, adapter)
    return {"twinkle_path": twinkle_path(adapter.model.id, kind, clean), "checkpoint_dir": None}


async def _readable(ctx: Context, adapter: Adapter, name: object) -> CheckpointRow:
    if not isinstance(name, str) or not name.startswith(ckpt.SCHEMES):
        raise BadRequest(f"name must be a twinkle:// (or tinker://) path of one of your checkpoints, got {name!r}; "
                         "server directories and hub ids are not loaded")
    row = await ckpt.readable(ctx, adapter.model.tenant_id, name)
    if row.kind == "external_weights":
        raise BadRequest("external_weights exports cannot be loaded for training; load a weights/ checkpoint")
    return row


async def load(ctx: Context, adapter: Adapter, name: object, load_optimizer: bool) -> None:
    row = await _readable(ctx, adapter, name)
    if load_optimizer and row.kind != "weights":
        raise BadRequest("optimizer state exists only in weights/ checkpoints (save with save_optimizer=True)")
    out = await run(ctx, adapter, LoadWeights(storage_key=row.storage_key, with_optimizer=load_optimizer,
                                              create=False))
    if not isinstance(out, ModelReady):
        raise JobFailed("the worker answered a load with another result")
    adapter.progress["window"] = {"backwards": 0, "tokens": 0}  # a load starts with no accumulated gradients
    await save_state(ctx, adapter)


async def resume(ctx: Context, adapter: Adapter, name: object, resume_only_model: bool) -> dict[str, int]:
    """Weights (and, unless `resume_only_model`, optimizer state and progress) of a training save."""
    row = await _readable(ctx, adapter, name)
    with_optimizer = not resume_only_model and row.kind == "weights"
    await load(ctx, adapter, name, with_optimizer)
    state = row.trainer_state or {}
    progress = {"cur_step": int(state.get("cur_step", 0)),
                "consumed_train_samples": int(state.get("consumed_train_samples", 0)),
                "gradient_accumulation_steps": int(state.get("gradient_accumulation_steps",
                                                             adapter.settings.get("gas", 1)))}
    if not resume_only_model:
        adapter.progress["backwards"] = progress["cur_step"]
        adapter.progress["consumed_train_samples"] = progress["consumed_train_samples"]
        await save_state(ctx, adapter)
    return progress
