"""Per-tenant adapters-in-memory quotas reach workers that read no SQL: the gateway publishes them from SQL into
Redis (deploy/cluster.publish_resident_limits), the worker's feed (jobqueue/resident_limits.py) reads them, and the
cluster worker's runtime pages by them (deploy/worker.build_cluster_runtime). Real Redis, SQLite."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("redis")


async def _wait_for(check, timeout: float = 15.0) -> None:  # type: ignore[no-untyped-def]
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.1)


async def _publish_and_follow(settings, redis_url: str, prefix: str) -> None:  # type: ignore[no-untyped-def]
    from deploy.cluster import publish_resident_limits
    from jobqueue.redis_queue import RedisQueue
    from jobqueue.resident_limits import ResidentLimitFeed
    from server.db import repositories as repo
    from server.db.database import Database
    from server.services.tenant_limits import set_quota
    from server.services.tenants import create_key

    db = Database(settings.sqlalchemy_url)
    await db.create_schema()
    await create_key(db, "alice")
    await create_key(db, "bob")
    await set_quota(db, "alice", max_resident_adapters=2)
    async with db.session() as s:
        alice, bob = (await repo.tenant_by_name(s, "alice")).id, (await repo.tenant_by_name(s, "bob")).id
    queue = RedisQueue(redis_url, prefix=prefix)
    feed = ResidentLimitFeed(queue.client, queue.keys, default=9, refresh_seconds=0.1)
    assert not await feed.refresh() and feed(alice) == 9  # nothing published yet: the worker's own default
    gateway = asyncio.create_task(publish_resident_limits(settings, queue))
    follower = asyncio.create_task(feed.run())
    try:
        await _wait_for(lambda: _is(feed, alice, 2))
        assert feed(bob) == 5 and feed("unknown-tenant") == 5  # the gateway's default (quota_max_resident_adapters)
        await set_quota(db, "alice", max_resident_adapters=None)  # back to the default
        await set_quota(db, "bob", max_resident_adapters=1)
        await _wait_for(lambda: _is(feed, bob, 1))
        assert feed(alice) == 5
    finally:
        feed.stop()
        gateway.cancel()
        await asyncio.gather(gateway, follower, return_exceptions=True)
        await queue.close()
        await db.close()


async def _is(feed, tenant: str, value: int) -> bool:  # type: ignore[no-untyped-def]
    return feed(tenant) == value


def test_gateway_publishes_sql_quotas_and_worker_feed_follows(redis_url: str, prefix: str, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from server.config import Settings

    monkeypatch.delenv("TWINKLE_DATABASE_URL", raising=False)
    settings = Settings(data_dir=tmp_path, redis_url=redis_url, redis_prefix=prefix, quota_max_resident_adapters=5,
                        quota_cache_seconds=0)  # publishes every second
    asyncio.run(_publish_and_follow(settings, redis_url, prefix))


def test_published_default_of_unlimited(redis_url: str, prefix: str) -> None:
    from jobqueue.keys import Keys
    from jobqueue.resident_limits import ResidentLimitFeed, publish_resident_limits

    async def body() -> None:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_url)
        try:
            feed = ResidentLimitFeed(client, Keys(prefix), default=3)
            await publish_resident_limits(client, Keys(prefix), None, {"t1": 4})
            assert await feed.refresh() and (feed("t1"), feed("t2")) == (4, None)
            await publish_resident_limits(client, Keys(prefix), 2, {})  # replaced whole: t1's entry is gone
            assert await feed.refresh() and (feed("t1"), feed("t2")) == (2, 2)
        finally:
            await client.aclose()

    asyncio.run(body())


def test_cluster_worker_runtime_pages_by_the_published_quota(redis_url: str, prefix: str, tiny_model_dir: Path,
                                                             tmp_path: Path) -> None:
    from deploy.worker import build_cluster_runtime
    from jobqueue.redis_queue import RedisQueue
    from jobqueue.resident_limits import publish_resident_limits
    from tests.unit.engine_jobs import create
    from workers.runtime import StorageSpec, WorkerSpec

    spec = WorkerSpec(base_model="tiny", source=str(tiny_model_dir), default_resident_adapters=7,
                      storage=StorageSpec(data_dir=tmp_path, location=str(tmp_path / "ckpt"),
                                          cache_dir=tmp_path / "cache"), train_token_budget=555)

    async def body() -> None:
        queue = RedisQueue(redis_url, prefix=prefix)
        try:
            runtime, feed = await asyncio.to_thread(build_cluster_runtime, spec, queue, ("train",))
            assert runtime.dispatcher is not None and runtime.dispatcher.recovery is not None  # durable queue
            assert runtime.dispatcher.scheduler.token_budget == 555
            assert runtime.trainer is not None
            limit = runtime.trainer.pool.pager.config.tenant_resident_limit
            assert limit is feed and limit("t") == 7  # before any gateway published: the spec's default
            await publish_resident_limits(queue.client, queue.keys, None, {"t": 1})
            await feed.refresh()
            for model in ("m1", "m2", "m3"):
                assert runtime.trainer.execute(create(model, tenant="t")).ok
            tiers = runtime.status()["paging"]["tiers"]  # type: ignore[index]
            assert tiers["device"] == 1 and tiers["host"] == 2, tiers  # the tenant's quota of 1 on the device
        finally:
            await queue.close()

    asyncio.run(body())
