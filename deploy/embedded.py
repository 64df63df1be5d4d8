"""Embedded mode: gateway + in-process queue + the worker, in one process (the default `twinkle-server serve`)."""

from __future__ import annotations

import json
import logging

from fastapi import FastAPI

from api_schemas.jobs import queue_name
from api_schemas.models import ServedModel
from jobqueue.local_queue import LocalQueue
from server.app import create_app
from server.config import Settings
from server.services.tenant_limits import TenantLimits
from workers.checkpoints.hub import HubPusherPool
from workers.checkpoints.store import CheckpointStore
from workers.dispatcher import Dispatcher
from workers.engine.base_model import BaseModel
from workers.engine.model_assets import resolve_base_model, tokenizer_id_for
from workers.engine.paging import PagingConfig
from workers.engine.trainer import Trainer
from workers.sampling.factory import build_sampler
from workers.sampling.worker import SamplerWorker

log = logging.getLogger(__name__)


def build_trainer(settings: Settings, limits: TenantLimits | None = None) -> tuple[ServedModel, Trainer, CheckpointStore]:
    """Load the base model once and wrap it in a Trainer: the compute side of both wirings. With `limits` (the
    gateway's, in one process) each tenant's adapters-in-memory quota applies; else the settings' default."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    folder = resolve_base_model(settings.base_model, settings.data_dir)
    name = settings.base_model  # clients name the model as the operator did
    log.info("loading base model %s from %s", name, folder)
    base = BaseModel(name, folder, dtype=settings.dtype, device=settings.device)
    cfg = json.loads((folder / "config.json").read_text())
    served = ServedModel(
        name=name,
        vocab_size=base.vocab_size,
        max_context=base.max_context,
        tokenizer_id=tokenizer_id_for(folder),
        arch=(cfg.get("architectures") or [None])[0],
    )
    store = CheckpointStore(settings.storage_location, settings.storage_cache_dir)
    default = settings.quota_max_resident_adapters
    paging = PagingConfig(
        device_budget_bytes=settings.adapter_device_budget_bytes, host_budget_bytes=settings.adapter_host_budget_bytes,
        spill_dir=settings.data_dir / "adapter-spill",
        tenant_resident_limit=limits.resident_adapters if limits is not None else (lambda _tenant: default),
    )
    return served, Trainer(base, store, paging), store


def build_embedded_app(settings: Settings) -> FastAPI:
    limits = TenantLimits(settings)
    served, trainer, store = build_trainer(settings, limits)
    queue = LocalQueue(result_ttl=settings.result_ttl_seconds)
    dispatcher = Dispatcher(  # merged multi-tenant steps (the Trainer is a StepEngine)
        queue, queue_name(served.name, "train"), trainer.execute, gap_timeout=settings.seq_gap_timeout_seconds,
        token_budget=settings.train_token_budget,
    )
    sampler = build_sampler(
        settings.sampler, served.name, trainer.base.folder, store, dtype=settings.dtype, device=settings.device,
        max_batch_rows=settings.sampler_max_batch_rows, max_loaded_adapters=settings.sampler_max_loaded_adapters,
        max_lora_rank=settings.max_lora_rank,
        shared_base=trainer.base,  # one copy of the weights (workers/sampling/torch_sampler.py says why it is safe)
    )
    sampling = SamplerWorker(queue, queue_name(served.name, "sample"), sampler)
    pusher = HubPusherPool(store, settings.hub_push_concurrency)  # hub uploads on their own threads
    return create_app(settings, queue, {served.name: served}, background=[dispatcher.run, sampling.run], pusher=pusher,
                      limits=limits)
