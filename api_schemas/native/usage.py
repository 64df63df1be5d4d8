"""A tenant's usage (GET /native/v1/usage, `twinkle-server usage`): tokens, stored bytes, adapter-hours."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel


class TenantUsage(BaseModel):
    tenant: str  # the tenant's name
    tenant_id: str  # its id: the `tenant` label of the per-tenant metrics (/metrics)
    since: datetime | None  # None: since the tenant began
    until: datetime
    tokens_trained: int  # forward_backward datums' tokens (accepted requests)
    tokens_forward: int  # forward-only datums' tokens
    tokens_sampled: int  # generated tokens delivered
    tokens_prefilled: int  # sample prompts' tokens (accepted requests)
    storage_bytes: int  # checkpoints stored now
    adapter_hours: float  # training runs' lifetimes (created until released, or now) within the period
