"""A worker's non-blocking fetch on the Redis queue (the dispatcher's look between steps): it takes what is queued
and, with nothing queued, answers at once (XREADGROUP without BLOCK; BLOCK 0 would wait forever)."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from api_schemas.jobs import Job, OptimStep, queue_name
from api_schemas.training import AdamW
from jobqueue.redis_queue import RedisQueue

pytest.importorskip("redis")

Q = queue_name("base", "train")


def job(seq: int) -> Job:
    adam = AdamW(learning_rate=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
    return Job(job_id=str(uuid.uuid4()), tenant_id="t1", base_model="base", model_id="m1", seq_id=seq,
               payload=OptimStep(optimizer=adam))


def test_fetch_with_timeout_zero_takes_what_is_queued_and_never_blocks(redis_url: str, prefix: str) -> None:
    async def go() -> None:
        q = RedisQueue(redis_url, prefix=prefix)
        assert await q.fetch(Q, timeout=0.1) == []  # takes the lease, creates the group
        started = time.monotonic()
        assert await asyncio.wait_for(q.fetch(Q, timeout=0), 5) == []
        assert time.monotonic() - started < 1.0
        jobs = [job(1), job(2)]
        for j in jobs:
            await q.submit(j)
        assert [g.job_id for g in await q.fetch(Q, timeout=0)] == [j.job_id for j in jobs]
        assert await asyncio.wait_for(q.fetch(Q, timeout=0), 5) == []
        await q.close()

    asyncio.run(go())
