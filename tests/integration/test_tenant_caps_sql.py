"""The live counts behind the tenant caps (server/db/quota_repo.py, server/services/tenant_caps.py) on SQLite and
Postgres: finished and timed-out sessions, and the models and sampling sessions in them, do not count; ephemeral
sampling sessions and other tenants' rows do not either."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from pathlib import Path

import pytest

from server.db import quota_repo
from server.db.database import Database
from server.db.models import ModelRow, SamplingSessionRow, SessionRow, TenantRow, utcnow


async def _counts(url: str) -> list[int]:
    db = Database(url)
    await db.create_schema()
    now = utcnow()
    old = now - timedelta(hours=1)
    async with db.session() as s:
        s.add_all([TenantRow(id="t", name="t"), TenantRow(id="u", name="u")])
        await s.flush()
        for sid, tenant, finished, beat in (("live", "t", None, now), ("done", "t", now, now),
                                            ("silent", "t", None, old), ("other", "u", None, now)):
            s.add(SessionRow(id=sid, tenant_id=tenant, tags=[], user_metadata={}, finished_at=finished,
                             last_heartbeat_at=beat))
        await s.flush()
        for i, sid in enumerate(("live", "live", "done", "silent", "other")):
            tenant = "u" if sid == "other" else "t"
            s.add(ModelRow(id=f"m{i}", tenant_id=tenant, session_id=sid, model_seq_id=i, base_model="b", lora_rank=2,
                           full_param=False, seed=0, train_attn=True, train_mlp=True, train_unembed=True,
                           optimizer="adamw", create_request_id="", user_metadata={}))
            for j, ephemeral in enumerate((False, True)):
                s.add(SamplingSessionRow(id=f"s{i}{j}", tenant_id=tenant, session_id=sid, seq_id=10 * i + j,
                                         base_model="b", ephemeral=ephemeral))
    after = now - timedelta(minutes=15)
    async with db.session() as s:
        counts = [await quota_repo.live_sessions(s, "t", after), await quota_repo.live_models(s, "t", after),
                  await quota_repo.live_sampling_sessions(s, "t", after)]
    await db.close()
    return counts


def test_live_counts_on_sqlite(tmp_path: Path) -> None:
    assert asyncio.run(_counts(f"sqlite+aiosqlite:///{tmp_path / 'caps.db'}")) == [1, 2, 2]


def test_live_counts_on_postgres(postgres_url: str) -> None:
    assert asyncio.run(_counts(postgres_url)) == [1, 2, 2]
