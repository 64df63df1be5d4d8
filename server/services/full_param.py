"""Full-parameter training on a lease: which models offer it, how many runs each carries, and when a lease ends.

A full-parameter run (Tinker `create_model` without `lora_config`, as twinkle-kit's `create_full_training_client`
sends; native `add_adapter_to_model(config=None)`) is a private trainable copy of the base model on the trainer
that serves it (workers/engine/full_param.py). The operator offers it per served model
(`TWINKLE_FULL_PARAM_MODELS`, `*` for all) and says how many copies one model carries at once
(`TWINKLE_FULL_PARAM_RUNS_PER_MODEL`, default 1): the lease. A create beyond it is held by admission
(server/services/quotas.py) until a run ends; its future answers `try_again` with `queue_state: paused_capacity`
and a reason naming the lease. A lease ends when the run's session ends (its client stopped heartbeating: the same
release as for LoRA runs) or `TWINKLE_FULL_PARAM_LEASE_SECONDS` after it started (release.py), whichever is first;
the copy is then freed and the next held create goes. LoRA tenants of the model are never held back by a lease:
the shared base model is never written, so its weights stay bit-identical.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from api_schemas.jobs import CreateModel, Job, LoadWeights
from server.config import Settings
from server.db.models import utcnow
from server.errors import BadRequest

LEASE_REASON = "full-parameter lease"  # the start of a held create's reason (retrieve_future: paused_capacity)


def offered(settings: Settings, base_model: str) -> bool:
    return "*" in settings.full_param_models or base_model in settings.full_param_models


def require_offered(settings: Settings, base_model: str) -> None:
    if not offered(settings, base_model):
        where = (f"it is offered for {sorted(settings.full_param_models)}" if settings.full_param_models
                 else "it is offered for no model")
        raise BadRequest(f"full-parameter training is not enabled for base model {base_model!r} on this server "
                         f"({where}; the operator enables it with TWINKLE_FULL_PARAM_MODELS); create a LoRA "
                         "training client (lora_config with a rank)")


def creates_full_run(job: Job) -> bool:
    p = job.payload
    return (isinstance(p, CreateModel) and p.lora is None) or (isinstance(p, LoadWeights) and p.create and p.full)


def lease_started_before(settings: Settings) -> datetime:
    """Full-parameter runs created before this have used up their lease."""
    return utcnow() - timedelta(seconds=settings.full_param_lease_seconds)


def lease_wait_reason(base_model: str, live: int, limit: int) -> str:
    return (f"{LEASE_REASON} of {base_model!r}: {live} of {limit} full-parameter runs hold it; this one starts when "
            "one ends")
