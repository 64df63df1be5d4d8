"""A tenant's own usage: tokens, stored bytes and adapter-hours (server/services/usage.py)."""

from __future__ import annotations

from fastapi import APIRouter

from api_schemas.native.usage import TenantUsage
from server.api.deps import Ctx, Tenant
from server.services import usage

router = APIRouter()


@router.get("/usage")
async def get_usage(ctx: Ctx, tenant: Tenant, since: str | None = None) -> TenantUsage:
    """`since`: an ISO 8601 time or a duration back from now (`7d`, `24h`, `30m`); default: since the start.
    Counts of the last maintenance round (TWINKLE_MAINTENANCE_INTERVAL_SECONDS) may not be written yet."""
    return await usage.own_usage(ctx.db, tenant, since)
