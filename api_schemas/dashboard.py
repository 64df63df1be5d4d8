"""The web dashboard's JSON (`GET /dashboard/api/overview`, server/api/dashboard.py): what one key may see.

A tenant's key gets its own tenant only (runs with their loss points, checkpoints, usage); an operator's key
(`twinkle-server keys create --admin`) gets every tenant, their keys (id, prefix, state: never a secret or a
hash) and the service (queue depth, held jobs, adapters per tier).
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel

from api_schemas.native.usage import TenantUsage


class LossPointView(BaseModel):
    seq_id: int  # the run's operation number
    loss: float  # the forward_backward's `loss:sum`
    tokens: int
    at: float  # unix time


class RunView(BaseModel):
    run_id: str
    base_model: str
    lora_rank: int | None  # None: a full-parameter run
    last_request_time: datetime
    live: bool  # not released: its client session has not ended (server/services/release.py)
    last_checkpoint: str | None  # its tinker:// path
    losses: list[LossPointView]  # oldest first; what this gateway delivered (server/services/loss_history.py)


class CheckpointView(BaseModel):
    tinker_path: str
    kind: str  # training | sampler
    time: datetime
    size_bytes: int | None
    public: bool


class KeyView(BaseModel):
    key_id: int
    prefix: str  # the first characters, as `twinkle-server keys list` shows them
    created_at: datetime
    revoked: bool
    admin: bool


class TenantView(BaseModel):
    name: str
    tenant_id: str
    keys: list[KeyView] | None  # only in an operator's view
    runs: list[RunView]
    runs_total: int
    checkpoints: list[CheckpointView]
    checkpoints_total: int
    usage: TenantUsage


class QueueView(BaseModel):
    base_model: str
    lane: str
    depth: int


class AdapterTierView(BaseModel):
    base_model: str
    tier: str  # device | host | disk
    adapters: int
    worker: str | None  # the publishing worker (cluster and Ray); None in the gateway's own process


class ServiceView(BaseModel):
    queues: list[QueueView]
    held_jobs: int
    adapters: list[AdapterTierView]


class Overview(BaseModel):
    role: Literal["operator", "tenant"]
    viewer: str  # the key's tenant's name
    tenants: list[TenantView]
    service: ServiceView | None  # only in an operator's view
