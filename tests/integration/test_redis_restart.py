"""Redis restarted with AOF (appendfsync everysec) in a test-owned instance on its own port: acknowledged futures,
dedup keys and unacknowledged jobs survive a SHUTDOWN/restart, and a running gateway-side queue reconnects (its
push subscription too) without being rebuilt."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from api_schemas.jobs import JobResult, JobState, OptimStepResult
from jobqueue.redis_queue import RedisQueue
from tests.integration.test_redis_queue import Q, job, stepped
from tests.support.redis_server import RedisServer

pytest.importorskip("redis")


def test_acknowledged_futures_survive_shutdown_and_restart(tmp_path: Path) -> None:
    if not RedisServer.available():
        pytest.skip("no redis-server binary")
    server = RedisServer(tmp_path / "redis", aof=True).start()
    try:
        asyncio.run(_scenario(server))
    finally:
        server.stop()


async def _scenario(server: RedisServer) -> None:
    gateway = RedisQueue(server.url, prefix="aof", lease_ttl=1.0)
    worker = RedisQueue(server.url, prefix="aof", lease_ttl=1.0)
    jobs = [job(seq=i) for i in range(3)]
    for j in jobs:
        await gateway.submit(j, dedup_key=f"m1#{j.seq_id}")
    fetched = await worker.fetch(Q, timeout=2)
    assert len(fetched) == 3
    for j in fetched[:2]:
        await worker.complete(JobResult(job_id=j.job_id, output=stepped(j.seq_id)), job=j)
    worker.consumer(Q)._renewer.cancel()  # type: ignore[union-attr]  # the worker dies with the third unacknowledged
    assert await gateway.wait_result(jobs[0].job_id, 1) is not None  # the gateway's subscription is live

    server.shutdown()
    server.start()

    for j in jobs[:2]:  # the same gateway-side object: its connections come back by themselves
        res = await gateway.wait_result(j.job_id, 2)
        assert res is not None and res.output == stepped(j.seq_id)
        assert (await gateway.info(j.job_id)).state is JobState.DONE  # type: ignore[union-attr]
    assert await gateway.submit(job(seq=1), dedup_key="m1#1") == jobs[1].job_id  # dedup keys survived
    successor = RedisQueue(server.url, prefix="aof", lease_ttl=1.0)
    again = await successor.fetch(Q, timeout=5)  # the unacknowledged job is still pending: reclaimed
    assert [j.job_id for j in again] == [jobs[2].job_id]
    waiter = asyncio.create_task(gateway.wait_result(jobs[2].job_id, 20))
    await asyncio.sleep(0.3)
    late = OptimStepResult(metrics={"late": 1.0}, learning_rate=0.0, step=3)
    await successor.complete(JobResult(job_id=jobs[2].job_id, output=late), job=again[0])
    res = await asyncio.wait_for(waiter, 5)  # woken by a push over the re-established subscription
    assert res is not None and res.output == late
    state = await successor.recovery_state("m1")
    assert state is not None and state.last_seq == 2
    for q in (gateway, worker, successor):
        await q.close()
