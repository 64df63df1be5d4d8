"""Workers' metrics through Redis (jobqueue/metrics_feed.py): a worker's registry, published, shows in the gateway's
scrape with a `worker` label, merged with the gateway's own families; an expired publication is pruned. Real Redis."""

from __future__ import annotations

import asyncio
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from tests.support.prom import parse, value
from tests.unit.engine_jobs import fb

pytest.importorskip("redis")


async def _flow(redis_url: str, prefix: str) -> None:
    from jobqueue.metrics_feed import Merged, MetricsPublisher
    from jobqueue.redis_queue import RedisQueue

    queue = RedisQueue(redis_url, prefix=prefix)
    try:
        gateway, w1, w2 = CollectorRegistry(), CollectorRegistry(), CollectorRegistry()
        for registry, n in ((gateway, 1), (w1, 5), (w2, 7)):
            Counter("twinkle_feed_test", "a test counter", ["kind"], registry=registry).labels("trained").inc(n)
        p1 = MetricsPublisher(queue.client, queue.keys, "worker@a:1", period=0.2, registry=w1)
        p2 = MetricsPublisher(queue.client, queue.keys, "worker@b:2", period=0.2, registry=w2)
        await p1.publish()
        await p2.publish()
        # queue depth: what no worker has read yet (a read job is running, not queued)
        job = fb("m-depth", 0, [[5, 6, 7]])
        assert await queue.depth([job.queue_name, "nothing|train"]) == {job.queue_name: 0, "nothing|train": 0}
        await queue.submit(job, dedup_key="m-depth#0")
        assert await queue.depth([job.queue_name]) == {job.queue_name: 1}
        assert [j.job_id for j in await queue.fetch(job.queue_name, 2.0)] == [job.job_id]
        assert await queue.depth([job.queue_name]) == {job.queue_name: 0}
        published = await queue.worker_metrics()
        assert set(published) == {"worker@a:1", "worker@b:2"}
        text = generate_latest(Merged(gateway, published)).decode()  # type: ignore[arg-type]
        assert text.count("# TYPE twinkle_feed_test_total counter") == 1  # one family, every worker's samples
        s = parse(text)
        assert value(s, "twinkle_feed_test_total", kind="trained") == 13
        assert value(s, "twinkle_feed_test_total", worker="worker@a:1") == 5
        assert value(s, "twinkle_feed_test_total", worker="worker@b:2") == 7

        # a publisher that runs keeps its field fresh; one that stopped publishing expires (3 periods) and goes
        task = asyncio.create_task(p1.run())
        await asyncio.sleep(0.8)
        assert set(await queue.worker_metrics()) == {"worker@a:1"}
        assert not await queue.client.hexists(queue.keys.metrics, "worker@b:2")  # pruned
        p1.stop()
        await task
        assert await queue.worker_metrics() == {}  # a stopped publisher removes its field
    finally:
        await queue.client.delete(queue.keys.metrics)
        await queue.close()


def test_workers_metrics_reach_the_gateway(redis_url: str, prefix: str) -> None:
    t0 = time.monotonic()
    asyncio.run(_flow(redis_url, prefix))
    assert time.monotonic() - t0 < 10
