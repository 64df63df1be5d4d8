"""Tenants' quotas in SQL: set/reset per tenant, server defaults for unset limits, the cache, live-model counts."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest

from server.config import Settings
from server.db import repositories as repo
from server.db.database import Database
from server.db.models import ModelRow, SessionRow, utcnow
from server.errors import NotFound
from server.services import tenants
from server.services.tenant_limits import Limits, TenantLimits, list_quotas, set_quota


def test_quotas_roundtrip_defaults_and_live_models(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path, quota_tokens_per_minute=1000, quota_cache_seconds=0)

    async def main() -> None:
        db = Database(settings.sqlalchemy_url)
        await db.create_schema()
        try:
            await tenants.create_key(db, "alice")
            await tenants.create_key(db, "bob")
            limits = TenantLimits(settings)
            limits.bind(db)
            async with db.session() as s:
                alice = (await repo.tenant_by_name(s, "alice")).id  # type: ignore[union-attr]
            assert await limits.get(alice) == Limits(tokens_per_minute=1000)  # no row: the server defaults
            assert await set_quota(db, "alice", max_models=2, max_resident_adapters=1) == Limits(2, 1, None, None)
            assert await limits.get(alice) == Limits(2, 1, 1000, None)  # unset fields keep the default
            assert limits.peek(alice).max_resident_adapters == limits.resident_adapters(alice) == 1
            await set_quota(db, "alice", tokens_per_minute=50, max_resident_adapters=None)  # None: back to default
            assert await limits.get(alice) == Limits(2, None, 50, None)
            assert dict(await list_quotas(db)) == {"alice": Limits(2, None, 50, None), "bob": Limits()}
            with pytest.raises(NotFound):
                await set_quota(db, "carol", max_models=1)
            with pytest.raises(ValueError):
                await set_quota(db, "alice", nonsense=1)

            async with db.session() as s:  # live: session neither finished nor timed out
                old = utcnow() - timedelta(seconds=settings.session_timeout_seconds + 60)
                s.add_all([SessionRow(id="live", tenant_id=alice), SessionRow(id="done", tenant_id=alice,
                           finished_at=utcnow()), SessionRow(id="stale", tenant_id=alice, last_heartbeat_at=old)])
                await s.flush()
                for i, sess in enumerate(["live", "live", "done", "stale"]):
                    s.add(ModelRow(id=f"m{i}", tenant_id=alice, session_id=sess, model_seq_id=i, base_model="b",
                                   lora_rank=2, create_request_id="r"))
            assert await limits.live_models(alice) == 2
            assert await limits.live_models(alice, exclude="m0") == 1
        finally:
            await db.close()

    asyncio.run(main())
