"""Tenants' adapters-in-memory quotas, carried from the gateways to the workers through Redis.

A quota lives in the gateway's SQL (`tenant_quotas`, set with `twinkle-server tenants set-quota`); the engine's
pager needs it on every step (workers/engine/paging.py, `tenant_resident_limit`). In embedded mode the gateway's
TenantLimits is handed to the engine directly. A separate worker or a Ray replica reads no SQL: every gateway
rewrites one Redis hash (`Keys.resident_limits`) every few seconds with each tenant's own limit and the default,
and `ResidentLimitFeed` re-reads it into memory, so the pager's synchronous lookup never waits on Redis. A changed
quota reaches the workers within two refresh periods. Until a gateway has published, the worker's own default
(TWINKLE_QUOTA_MAX_RESIDENT_ADAPTERS) applies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from jobqueue.keys import Keys

log = logging.getLogger(__name__)

DEFAULT_FIELD = "*"  # tenant ids never start with it


async def publish_resident_limits(client: Any, keys: Keys, default: int | None, limits: Mapping[str, int]) -> None:
    """Replace the published limits at once: `limits` (tenants with their own quota) and the `default`."""
    mapping = {DEFAULT_FIELD: "" if default is None else str(default), **{t: str(n) for t, n in limits.items()}}
    async with client.pipeline(transaction=True) as pipe:
        pipe.delete(keys.resident_limits)
        pipe.hset(keys.resident_limits, mapping=mapping)
        await pipe.execute()


def _parse(raw: Mapping[Any, Any]) -> tuple[int | None, dict[str, int]]:
    def text(v: Any) -> str:
        return v.decode() if isinstance(v, bytes) else str(v)

    values = {text(k): text(v) for k, v in raw.items()}
    default = values.pop(DEFAULT_FIELD, "")
    return (int(default) if default else None), {t: int(v) for t, v in values.items() if v}


class ResidentLimitFeed:
    """`feed(tenant_id)` is the tenant's limit as last read from Redis; `run()` keeps re-reading it."""

    def __init__(self, client: Any, keys: Keys, default: int | None, refresh_seconds: float = 5.0) -> None:
        self.client, self.keys = client, keys
        self.refresh_seconds = refresh_seconds
        self._view: tuple[int | None, dict[str, int]] = (default, {})  # replaced whole: safe from other threads
        self._stopping = asyncio.Event()

    def __call__(self, tenant_id: str) -> int | None:
        default, limits = self._view
        return limits.get(tenant_id, default)

    async def refresh(self) -> bool:
        """Read the published limits; False (and the previous view kept) when no gateway has published yet."""
        raw = await self.client.hgetall(self.keys.resident_limits)
        if not raw:
            return False
        self._view = _parse(raw)
        return True

    async def run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.refresh()
            except Exception:  # Redis away for a moment: the last known limits stay in force
                log.warning("reading the tenants' resident-adapter limits failed; retrying", exc_info=True)
            try:
                await asyncio.wait_for(self._stopping.wait(), self.refresh_seconds)
            except TimeoutError:
                pass

    def stop(self) -> None:
        self._stopping.set()
