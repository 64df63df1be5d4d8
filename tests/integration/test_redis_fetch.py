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


def test_entries_delivered_by_a_read_whose_answer_was_lost_are_read_again(redis_url: str, prefix: str) -> None:
    """Redis delivers entries (and, with AOF, records them as this consumer's) but the answer never arrives: the
    connection drops, or Redis is killed right after writing its log. The worker must still run them; nobody else
    would while it holds the lease (found by the fault campaign: the job waited in the worker's own pending list, the
    next seq_id ran after the gap timeout, and the job was refused as already executed at the next takeover)."""
    async def go() -> None:
        q = RedisQueue(redis_url, prefix=prefix)
        assert await q.fetch(Q, timeout=0.1) == []  # takes the lease, creates the group
        held = job(1)
        await q.submit(held)
        assert [g.job_id for g in await q.fetch(Q, timeout=0)] == [held.job_id]  # in flight: never read twice
        lost, after = job(2), job(3)
        await q.submit(lost)
        client = q.consumer(Q).client
        real = client.xreadgroup

        async def answer_lost(*args, **kwargs):  # type: ignore[no-untyped-def]
            await real(*args, **kwargs)  # Redis delivers...
            client.xreadgroup = real
            raise ConnectionError("connection lost")  # ...and the answer never arrives

        client.xreadgroup = answer_lost
        with pytest.raises(ConnectionError):
            await q.fetch(Q, timeout=0)
        await q.submit(after)
        assert [g.job_id for g in await q.fetch(Q, timeout=0)] == [lost.job_id]  # its own pending, not `held`
        assert [g.job_id for g in await q.fetch(Q, timeout=0)] == [after.job_id]
        assert await q.fetch(Q, timeout=0) == []
        await q.close()

    asyncio.run(go())


def test_a_takeover_whose_claim_answer_was_lost_still_runs_the_dead_workers_jobs(redis_url: str, prefix: str) -> None:
    """The same at a takeover: Redis moves the dead worker's entries to the successor (XAUTOCLAIM) and the answer is
    lost; the successor claims them again, or finds them among its own, and runs each once."""
    async def go() -> None:
        gateway = RedisQueue(redis_url, prefix=prefix)
        dead = RedisQueue(redis_url, prefix=prefix, lease_ttl=1.0)
        jobs = [job(1), job(2)]
        for j in jobs:
            await gateway.submit(j)
        assert len(await dead.fetch(Q, timeout=2)) == 2
        dead.consumer(Q)._renewer.cancel()  # type: ignore[union-attr]  # the process "dies": no renewals
        successor = RedisQueue(redis_url, prefix=prefix, lease_ttl=1.0)
        client = successor.consumer(Q).client
        real = client.xautoclaim

        async def answer_lost(*args, **kwargs):  # type: ignore[no-untyped-def]
            await real(*args, **kwargs)
            client.xautoclaim = real
            raise ConnectionError("connection lost")

        client.xautoclaim = answer_lost
        with pytest.raises(ConnectionError):
            await successor.fetch(Q, timeout=5)
        assert sorted(g.job_id for g in await successor.fetch(Q, timeout=0)) == sorted(j.job_id for j in jobs)
        assert await successor.fetch(Q, timeout=0) == []
        for q in (gateway, dead, successor):
            await q.close()

    asyncio.run(go())
