"""Tenants' quotas: the operator sets them (`twinkle-server tenants set-quota`), the gateway and the engine read them.

A tenant's limits are its `tenant_quotas` row, with NULL (or no row) meaning the server default from the
settings (`quota_*`). Reads go through a cache refreshed every `quota_cache_seconds`, so a changed quota applies
within seconds without a restart. `peek` is the synchronous view the engine's adapter pager calls from its
compute thread (embedded mode): it never touches the database.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields, replace
from datetime import timedelta

from server.config import Settings
from server.db import quota_repo
from server.db import repositories as repo
from server.db.database import Database
from server.db.models import TenantQuotaRow, utcnow
from server.errors import NotFound
from server.services import audit


@dataclass(frozen=True)
class Limits:
    """None = unlimited."""

    max_models: int | None = None
    max_resident_adapters: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent_requests: int | None = None
    requests_per_minute: int | None = None  # HTTP requests the gate lets through (server/auth/rate_limits.py)
    request_burst: int | None = None  # requests at once above that rate (None: a minute's worth)

    @classmethod
    def defaults(cls, settings: Settings) -> Limits:
        return cls(settings.quota_max_models, settings.quota_max_resident_adapters, settings.quota_tokens_per_minute,
                   settings.quota_max_concurrent_requests, settings.quota_requests_per_minute,
                   settings.quota_request_burst)

    def over(self, row: TenantQuotaRow | None) -> Limits:
        """These defaults, overridden by the row's non-NULL values."""
        if row is None:
            return self
        given = {f.name: getattr(row, f.name) for f in fields(self) if getattr(row, f.name) is not None}
        return replace(self, **given)


class TenantLimits:
    def __init__(self, settings: Settings) -> None:
        self.defaults = Limits.defaults(settings)
        self.ttl = settings.quota_cache_seconds
        self.session_timeout = settings.session_timeout_seconds
        self.settings = settings
        self.db: Database | None = None
        self._cache: dict[str, tuple[float, Limits]] = {}

    def bind(self, db: Database) -> None:
        self.db = db

    async def get(self, tenant_id: str) -> Limits:
        hit = self._cache.get(tenant_id)
        now = time.monotonic()
        if hit is not None and now - hit[0] < self.ttl:
            return hit[1]
        limits = self.defaults
        if self.db is not None:
            async with self.db.session() as s:
                limits = self.defaults.over(await quota_repo.quota_of(s, tenant_id))
        self._cache[tenant_id] = (now, limits)
        return limits

    def peek(self, tenant_id: str) -> Limits:
        hit = self._cache.get(tenant_id)
        return hit[1] if hit is not None else self.defaults

    def resident_adapters(self, tenant_id: str) -> int | None:
        """For workers.engine.paging.PagingConfig.tenant_resident_limit."""
        return self.peek(tenant_id).max_resident_adapters

    async def live_models(self, tenant_id: str, exclude: str = "") -> int:
        """The tenant's live training runs other than `exclude` (a run being created: its row may not be committed)."""
        if self.db is None:
            return 0
        async with self.db.session() as s:
            after = utcnow() - timedelta(seconds=self.session_timeout)
            return await quota_repo.live_models(s, tenant_id, after, exclude)


    async def live_full_runs(self, base_model: str, exclude: str = "") -> int:
        """Full-parameter runs holding a lease on `base_model` (server/services/full_param.py), other than `exclude`."""
        if self.db is None:
            return 0
        async with self.db.session() as s:
            after = utcnow() - timedelta(seconds=self.session_timeout)
            lease = utcnow() - timedelta(seconds=self.settings.full_param_lease_seconds)
            return await repo.live_full_runs(s, base_model, after, lease, exclude)


async def resident_adapter_limits(db: Database) -> dict[str, int]:
    """Every tenant's own adapters-in-memory quota (tenants on the default are left out), for the workers of a
    cluster (deploy/cluster.py publishes it through jobqueue/resident_limits.py)."""
    async with db.session() as s:
        return {t.id: row.max_resident_adapters for t, row in await quota_repo.quotas(s)
                if row is not None and row.max_resident_adapters is not None}


# --- operator side (deploy/tenants_cli.py) ---
UNSET = object()  # leave a field as it is


async def set_quota(db: Database, tenant_name: str, **values: int | None | object) -> Limits:
    """Set (an int) or clear (None: back to the default) some of a tenant's limits; returns the row's values."""
    names = {f.name for f in fields(Limits)}
    if set(values) - names:
        raise ValueError(f"unknown quota fields {sorted(set(values) - names)}; known: {sorted(names)}")
    async with db.session() as s:
        tenant = await repo.tenant_by_name(s, tenant_name)
        if tenant is None:
            raise NotFound(f"no tenant named {tenant_name!r} (create one with `twinkle-server keys create`)")
        row = await quota_repo.quota_of(s, tenant.id)
        if row is None:
            row = TenantQuotaRow(tenant_id=tenant.id)
            s.add(row)
        changed = {name: value for name, value in values.items() if value is not UNSET}
        for name, value in changed.items():
            setattr(row, name, value)
        row.updated_at = utcnow()
        audit.add(s, tenant.id, "tenant.quota", ", ".join(f"{n}={v}" for n, v in changed.items()))
        return Limits().over(row)


async def list_quotas(db: Database) -> list[tuple[str, Limits]]:
    """Every tenant with the limits set on it (None: the server default applies)."""
    async with db.session() as s:
        return [(t.name, Limits().over(row)) for t, row in await quota_repo.quotas(s)]
