"""The in-process queue: a non-blocking fetch, results kept for their TTL (with their dedup keys) and no longer."""

from __future__ import annotations

import asyncio
import time

from api_schemas.jobs import JobResult, OptimStepResult, Skipped, queue_name
from jobqueue.local_queue import LocalQueue
from tests.unit.engine_jobs import optim

TRAIN = queue_name("tiny", "train")
STEPPED = OptimStepResult(metrics={}, learning_rate=0.01, step=1)


def test_fetch_with_timeout_zero_takes_what_is_queued_and_never_waits() -> None:
    async def run() -> None:
        q = LocalQueue()
        started = time.monotonic()
        assert await q.fetch(TRAIN, 0) == []
        assert time.monotonic() - started < 0.05
        jobs = [optim("m", 1), optim("m", 2)]
        for j in jobs:
            await q.submit(j)
        assert [j.job_id for j in await q.fetch(TRAIN, 0)] == [j.job_id for j in jobs]
        assert await q.fetch(TRAIN, 0) == []

    asyncio.run(run())


def test_fetch_with_a_timeout_waits_for_a_job() -> None:
    async def run() -> None:
        q = LocalQueue()
        job = optim("m", 1)
        asyncio.get_running_loop().call_later(0.05, lambda: asyncio.ensure_future(q.submit(job)))
        assert [j.job_id for j in await q.fetch(TRAIN, 2.0)] == [job.job_id]
        started = time.monotonic()
        assert await q.fetch(TRAIN, 0.05) == []
        assert time.monotonic() - started >= 0.04

    asyncio.run(run())


def test_results_and_dedup_keys_expire_after_the_ttl_and_not_before() -> None:
    async def run() -> None:
        q = LocalQueue(result_ttl=0.2)
        old, young = optim("m", 1), optim("m", 2)
        assert await q.submit(old, dedup_key="m#1") == old.job_id
        await q.fetch(TRAIN, 0)
        await q.complete(JobResult(job_id=old.job_id, output=STEPPED))
        await asyncio.sleep(0.25)
        assert await q.submit(young, dedup_key="m#2") == young.job_id  # a submit expires what is older than the TTL
        assert await q.info(old.job_id) is None
        assert await q.dedup_id("m#1") is None
        assert await q.wait_result(old.job_id, 0) is None
        await q.fetch(TRAIN, 0)
        await q.complete(JobResult(job_id=young.job_id, output=STEPPED))
        await q.submit(optim("m", 3), dedup_key="m#3")
        assert await q.dedup_id("m#2") == young.job_id  # finished just now: kept, result and key
        result = await q.wait_result(young.job_id, 0)
        assert result is not None and result.output == STEPPED
        retry = optim("m", 2)
        assert await q.submit(retry, dedup_key="m#2") == young.job_id

    asyncio.run(run())


def test_wait_result_times_out_without_a_result() -> None:
    async def run() -> None:
        q = LocalQueue()
        job = optim("m", 1)
        await q.submit(job)
        started = time.monotonic()
        assert await q.wait_result(job.job_id, 0.05) is None
        assert time.monotonic() - started >= 0.04
        asyncio.get_running_loop().call_later(
            0.05, lambda: asyncio.ensure_future(q.complete(JobResult(job_id=job.job_id, output=Skipped(reason="ok")))))
        result = await q.wait_result(job.job_id, 2.0)
        assert result is not None and result.output == Skipped(reason="ok")

    asyncio.run(run())


def test_depth_counts_what_no_worker_has_taken() -> None:
    async def main() -> None:
        q = LocalQueue()
        name = TRAIN
        assert await q.depth([name, "other|sample"]) == {name: 0, "other|sample": 0}
        for seq in (1, 2, 3):
            await q.submit(optim("a", seq))
        assert await q.depth([name]) == {name: 3}
        assert len(await q.fetch(name, 0)) == 3
        assert await q.depth([name]) == {name: 0}  # taken: running, no longer queued
        assert await q.worker_metrics() == {}  # the workers share this process's registry

    asyncio.run(main())
