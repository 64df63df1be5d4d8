"""The native sampler adapters' SQL (add_adapter_to_sampler): lookups bound to the tenant, the session and the
served model, and the maintenance step that deletes those of ended sessions (finished or timed out)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from server.config import Settings
from server.db import repositories as repo
from server.db.database import Database
from server.db.models import NativeSamplerAdapterRow, SessionRow, utcnow
from server.services import tenants
from server.services.context import Context
from server.services.native import sampler_adapters


def test_lookup_is_bound_and_ended_sessions_are_dropped(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path)

    async def main() -> None:
        db = Database(settings.sqlalchemy_url)
        await db.create_schema()
        try:
            await tenants.create_key(db, "alice")
            await tenants.create_key(db, "bob")
            async with db.session() as s:
                alice = (await repo.tenant_by_name(s, "alice")).id  # type: ignore[union-attr]
                bob = (await repo.tenant_by_name(s, "bob")).id  # type: ignore[union-attr]
                old = utcnow() - timedelta(seconds=settings.session_timeout_seconds + 60)
                s.add_all([SessionRow(id="live", tenant_id=alice), SessionRow(id="done", tenant_id=alice,
                           finished_at=utcnow()), SessionRow(id="stale", tenant_id=alice, last_heartbeat_at=old)])
                await s.flush()
                for sess in ("live", "done", "stale"):
                    s.add(NativeSamplerAdapterRow(session_id=sess, base_model="m", adapter_name="a", tenant_id=alice,
                                                  lora={"rank": 8}))
            async with db.session() as s:
                assert (await repo.sampler_adapter(s, alice, "live", "m", "a")) is not None
                assert await repo.sampler_adapter(s, bob, "live", "m", "a") is None  # another tenant
                assert await repo.sampler_adapter(s, alice, "live", "other", "a") is None  # another model's sampler
                assert await repo.count_sampler_adapters(s, "live") == 1
            ctx = cast(Context, SimpleNamespace(settings=settings, db=db))
            assert await sampler_adapters.drop_ended(ctx) == 2
            assert await sampler_adapters.drop_ended(ctx) == 0
            async with db.session() as s:
                left: Any = await s.execute(NativeSamplerAdapterRow.__table__.select())
                assert [r.session_id for r in left] == ["live"]
        finally:
            await db.close()

    asyncio.run(main())
