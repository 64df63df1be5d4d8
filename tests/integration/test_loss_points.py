"""The loss curves' SQL (server/services/loss_history.py, server/db/loss_repo.py, migration 0013) on SQLite and on a
real Postgres: a batch written per flush, each run bounded to its newest points, read back by a new history (a
restarted gateway) and by several gateways' histories together, never across tenants; a failed write keeps the
points for the next round."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from api_schemas.jobs import ForwardBackward, ForwardBackwardResult, Job, JobResult
from server.db.database import Database
from server.services.loss_history import LossHistory

pytest.importorskip("alembic")


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite+aiosqlite:///{tmp_path / 'twinkle.db'}"
    else:
        yield request.getfixturevalue("postgres_url")


def _deliver(h: LossHistory, tenant: str, run: str, seq: int, loss: float) -> None:
    tokens = np.arange(4, dtype=np.int64)
    payload = ForwardBackward.build([(tokens, {"target_tokens": tokens})], forward_only=False, loss_fn="cross_entropy")
    job = Job(job_id=str(uuid.uuid4()), tenant_id=tenant, base_model="m", model_id=run, seq_id=seq, payload=payload)
    h.queued(job)
    h.delivered(job.job_id, JobResult(job_id=job.job_id, output=ForwardBackwardResult(outputs={},
                                                                                      metrics={"loss:sum": loss})))


def _curve(points: list) -> list[tuple[int, float]]:  # type: ignore[type-arg]
    return [(p.seq_id, p.loss) for p in points]


async def _scenario(url: str) -> None:
    db = Database(url)
    await db.create_schema()
    try:
        one = LossHistory(points=3)
        for seq in range(1, 6):
            _deliver(one, "ta", "run-a", seq, 10.0 - seq)
        _deliver(one, "tb", "run-b", 1, 7.5)
        await one.flush(db)
        assert one.unwritten == 0
        await one.flush(db)  # nothing to write: no statement

        restarted = LossHistory(points=3)  # a new gateway on the same database
        got = await restarted.curves(db, "ta", [("run-a", True), ("run-b", True)])
        assert _curve(got["run-a"]) == [(3, 7.0), (4, 6.0), (5, 5.0)]  # the newest 3 seq_ids, in SQL too
        assert "run-b" in got and got["run-b"] == []  # another tenant's run: nothing of it
        assert _curve((await restarted.curves(db, "tb", [("run-b", False)]))["run-b"]) == [(1, 7.5)]
        async with db.connection() as conn:
            from sqlalchemy import text

            count = (await conn.execute(text("SELECT count(*) FROM loss_points WHERE model_id = 'run-a'"))).scalar()
            assert count == 3

        # two gateways deliver steps of the same run; each reads the other's once it wrote them (refresh)
        other = LossHistory(points=3)
        _deliver(other, "ta", "run-a", 6, 4.0)
        assert _curve((await restarted.curves(db, "ta", [("run-a", True)], refresh=0.0))["run-a"])[-1] == (5, 5.0)
        await other.flush(db)
        assert _curve((await restarted.curves(db, "ta", [("run-a", True)], refresh=3600.0))["run-a"])[-1] == (5, 5.0)
        assert _curve((await restarted.curves(db, "ta", [("run-a", True)], refresh=0.0))["run-a"]) == [
            (4, 6.0), (5, 5.0), (6, 4.0)]
        # an ended run read once is not read again
        assert _curve((await restarted.curves(db, "tb", [("run-b", False)], refresh=0.0))["run-b"]) == [(1, 7.5)]
    finally:
        await db.close()



def test_loss_points_on_each_database(database_url: str) -> None:
    asyncio.run(_scenario(database_url))


class _Away:
    """A database that is down."""

    def connection(self) -> object:
        raise ConnectionError("database away")


def test_a_failed_write_keeps_the_points_for_the_next_round(tmp_path: Path) -> None:
    async def go() -> None:
        h = LossHistory(points=3, unwritten=4)
        _deliver(h, "ta", "run-a", 1, 3.0)
        _deliver(h, "ta", "run-a", 2, 2.0)
        with pytest.raises(ConnectionError):
            await h.flush(_Away())  # type: ignore[arg-type]
        assert h.unwritten == 2
        for seq in (3, 4, 5):  # over the bound of unwritten points: the oldest go
            _deliver(h, "ta", "run-a", seq, 1.0)
        assert h.unwritten == 4
        db = Database(f"sqlite+aiosqlite:///{tmp_path / 'twinkle.db'}")
        await db.create_schema()
        try:
            await h.flush(db)
            got = await LossHistory(points=3).curves(db, "ta", [("run-a", False)])
            assert _curve(got["run-a"]) == [(3, 1.0), (4, 1.0), (5, 1.0)]
        finally:
            await db.close()

    asyncio.run(go())
