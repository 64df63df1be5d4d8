"""The Redis Streams queue against a real Redis: delivery, results, waiters, dedup, redelivery, TTL, cancel, feeds."""

from __future__ import annotations

import asyncio
import time
import uuid

import numpy as np
import pytest

from api_schemas.arrays import Column
from api_schemas.jobs import (
    ErrorCategory,
    ForwardBackward,
    ForwardBackwardResult,
    Job,
    JobError,
    JobResult,
    JobState,
    OptimStep,
    OptimStepResult,
    ResultKind,
    Skip,
    Skipped,
    queue_name,
)
from api_schemas.training import AdamW
from jobqueue.base import CANCELLED, DuplicateJobMismatch, LeaseLost
from jobqueue.redis_queue import RedisQueue

pytest.importorskip("redis")


Q = queue_name("base", "train")


def job(seq: int = 1, lr: float = 1e-3, model: str = "m1", base: str = "base") -> Job:
    adam = AdamW(learning_rate=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip_norm=0.0)
    return Job(job_id=str(uuid.uuid4()), tenant_id="t1", base_model=base, model_id=model, seq_id=seq,
               payload=OptimStep(optimizer=adam))


def stepped(step: int = 1) -> OptimStepResult:
    return OptimStepResult(metrics={}, learning_rate=1e-3, step=step)


def ok(j: Job, output: OptimStepResult | Skipped | None = None) -> JobResult:
    return JobResult(job_id=j.job_id, output=output or stepped())


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def make(redis_url: str, prefix: str, **kw: float) -> RedisQueue:
    return RedisQueue(redis_url, prefix=prefix, **kw)  # type: ignore[arg-type]


def test_submit_fetch_complete_roundtrip_keeps_bytes(redis_url: str, prefix: str) -> None:
    async def go() -> None:
        q = make(redis_url, prefix)
        fb = ForwardBackward.build([(np.arange(5), {"target_tokens": np.arange(1, 6)})], forward_only=True,
                                   loss_fn="cross_entropy")
        j = job().model_copy(update={"payload": fb})
        assert await q.submit(j) == j.job_id
        assert (await q.info(j.job_id)).state is JobState.QUEUED  # type: ignore[union-attr]
        got = await q.fetch(Q, timeout=2)
        assert [g.job_id for g in got] == [j.job_id] and got[0] == j
        assert (await q.info(j.job_id)).state is JobState.QUEUED  # type: ignore[union-attr]  # read = running
        raw = bytes(range(256)) * 3  # not UTF-8: arrays travel as bytes inside the typed output
        logprobs = Column(dtype="float32", shapes=((len(raw) // 4,),), data=raw)
        out = ForwardBackwardResult(outputs={"logprobs": logprobs}, metrics={"loss:sum": float("nan")})
        await q.complete(JobResult(job_id=j.job_id, output=out), job=j)
        info = await q.info(j.job_id)
        assert info is not None and info.state is JobState.DONE and info.tenant_id == "t1"
        assert info.result_kind is ResultKind.FORWARD_BACKWARD
        for _ in range(2):  # a result may be fetched more than once
            res = await q.wait_result(j.job_id, timeout=1)
            assert res is not None and isinstance(res.output, ForwardBackwardResult)
            assert res.output.outputs["logprobs"].data == raw and np.isnan(res.output.metrics["loss:sum"])
            assert res.body == JobResult(job_id=j.job_id, output=out).body
        assert await q.client.xlen(q.keys.stream(Q)) == 0  # acknowledged entries are deleted
        assert await q.fetch(Q, timeout=0.2) == []
        await q.close()

    run(go())


def test_waiter_is_woken_by_push_not_timeout(redis_url: str, prefix: str) -> None:
    async def go() -> None:
        gateway, worker = make(redis_url, prefix), make(redis_url, prefix)
        j = job()
        await gateway.submit(j)
        waiter = asyncio.create_task(gateway.wait_result(j.job_id, timeout=20))
        await asyncio.sleep(0.3)
        assert not waiter.done()
        (fetched,) = await worker.fetch(Q, timeout=2)
        t0 = time.monotonic()
        await worker.complete(ok(fetched, Skipped(reason="x" * 10)), job=fetched)
        res = await asyncio.wait_for(waiter, 5)
        woke = time.monotonic() - t0
        assert res is not None and res.output == Skipped(reason="x" * 10)
        assert woke < 0.5, woke  # far below the 20 s timeout: a push, not a poll
        assert await gateway.wait_result(str(uuid.uuid4()), timeout=0.2) is None
        await gateway.close()
        await worker.close()

    run(go())


def test_small_results_ride_on_the_push_and_large_ones_are_read_back(redis_url: str, prefix: str) -> None:
    async def go() -> None:
        gateway, worker = make(redis_url, prefix), make(redis_url, prefix, inline_result_max=64)
        reads: list[bool] = []  # record_only flag of every DELIVER the gateway runs
        deliver = gateway._deliver

        async def counted(job_id: str, record_only: bool = False) -> JobResult | None:
            reads.append(record_only)
            return await deliver(job_id, record_only)

        gateway._deliver = counted  # type: ignore[method-assign]
        tricky = Skipped(reason="|1|a|\x00\n\u00e9\U0001f600")  # separators, escapes, multi-byte UTF-8 in a small body
        assert len(ok(job(), tricky).body) <= 64
        cases = [
            (ok(job(seq=1), tricky), [True]),  # the push holds the result: the delivery is only recorded
            (JobResult(job_id="", error=JobError(category=ErrorCategory.USER, message="bad | input\n")), [True]),
            (ok(job(seq=3), Skipped(reason="y" * 40)), [False]),  # over the limit: read back once woken
        ]
        assert len(cases[2][0].body) > 64
        for i, (result, expected) in enumerate(cases):
            j = job(seq=i + 1)
            await gateway.submit(j)
            waiter = asyncio.create_task(gateway.wait_result(j.job_id, timeout=20))
            await asyncio.sleep(0.2)
            for junk in (b"r:\xff|x", f"r:{j.job_id}|not a result".encode()):  # ignored or read back, never fatal
                await gateway.client.publish(gateway.keys.done_channel, junk)
            await asyncio.sleep(0.1)
            reads.clear()
            (fetched,) = await worker.fetch(Q, timeout=2)
            await worker.complete(result.model_copy(update={"job_id": fetched.job_id}), job=fetched)
            got = await asyncio.wait_for(waiter, 5)
            assert got == result.model_copy(update={"job_id": j.job_id})
            await asyncio.sleep(0.2)  # the delivery is recorded in the background
            assert reads == expected
            assert await gateway.client.hget(gateway.keys.result(j.job_id), "delivered") == b"1"
        await gateway.close()
        await worker.close()

    run(go())


def test_dedup_same_payload_returns_first_id_and_different_payload_is_rejected(redis_url: str, prefix: str) -> None:
    async def go() -> None:
        q = make(redis_url, prefix)
        first, retry, other = job(seq=3), job(seq=3), job(seq=3, lr=0.5)
        assert await q.submit(first, dedup_key="m1#3") == first.job_id
        assert await q.submit(retry, dedup_key="m1#3") == first.job_id
        with pytest.raises(DuplicateJobMismatch):
            await q.submit(other, dedup_key="m1#3")
        assert await q.dedup_id("m1#3") == first.job_id
        assert await q.dedup_id("m1#4") is None
        assert await q.info(retry.job_id) is None
        assert await q.client.xlen(q.keys.stream(Q)) == 1  # queued once
        await q.close()

    run(go())


def test_dead_workers_jobs_are_redelivered_and_its_late_ack_is_refused(redis_url: str, prefix: str) -> None:
    async def go() -> None:
        gateway = make(redis_url, prefix)
        dead = make(redis_url, prefix, lease_ttl=1.0)
        jobs = [job(seq=i) for i in range(3)]
        for j in jobs:
            await gateway.submit(j)
        got = await dead.fetch(Q, timeout=2)
        assert len(got) == 3
        await dead.complete(ok(got[0]), job=got[0])
        dead.consumer(Q)._renewer.cancel()  # type: ignore[union-attr]  # the process "dies": no renewals
        successor = make(redis_url, prefix, lease_ttl=1.0)
        t0 = time.monotonic()
        again = await successor.fetch(Q, timeout=5)
        assert 0.3 < time.monotonic() - t0 < 3  # it waited for the dead worker's lease to run out
        assert sorted(j.job_id for j in again) == sorted(j.job_id for j in jobs[1:])
        for j in again:
            await successor.complete(ok(j, stepped(2)), job=j)
        with pytest.raises(LeaseLost):  # the stale worker cannot acknowledge or overwrite anything
            await dead.complete(ok(got[1], stepped(3)), job=got[1])
        assert (await gateway.wait_result(jobs[1].job_id, 1)).output == stepped(2)  # type: ignore[union-attr]
        assert (await gateway.wait_result(jobs[0].job_id, 1)).output == stepped()  # type: ignore[union-attr]
        pending = await gateway.client.xpending(gateway.keys.stream(Q), "workers")
        assert pending["pending"] == 0
        state = await successor.recovery_state("m1")
        assert state is not None and state.last_seq == 2
        for q in (gateway, dead, successor):
            await q.close()

    run(go())


def test_results_expire_after_ttl_and_first_delivery_extends_them(redis_url: str, prefix: str) -> None:
    async def go() -> None:
        q = make(redis_url, prefix, result_ttl=2)
        a, b = job(seq=1), job(seq=2)
        await q.submit(a)
        await q.submit(b)
        for j in await q.fetch(Q, timeout=2):
            await q.complete(ok(j), job=j)
        await asyncio.sleep(1.2)
        assert await q.wait_result(a.job_id, 0) is not None  # first delivery: lives 2 s from now
        await asyncio.sleep(1.3)  # 2.5 s after completion
        assert await q.info(b.job_id) is None and await q.wait_result(b.job_id, 0) is None
        assert await q.wait_result(a.job_id, 0) is not None
        await asyncio.sleep(1.2)
        assert await q.info(a.job_id) is None and await q.wait_result(a.job_id, 0) is None
        await q.close()

    run(go())


def test_cancel_before_start_fails_the_future_and_the_worker_gets_a_skip(redis_url: str, prefix: str) -> None:
    async def go() -> None:
        q = make(redis_url, prefix)
        a, b = job(seq=1), job(seq=2)
        await q.submit(a)
        assert await q.cancel(a.job_id)
        res = await q.wait_result(a.job_id, 1)
        assert res is not None and res.error is not None and res.error.message == CANCELLED
        await q.submit(b)
        got = await q.fetch(Q, timeout=2)
        assert isinstance(got[0].payload, Skip) and got[0].job_id == a.job_id and got[1] == b
        assert not await q.cancel(b.job_id)  # running: too late
        for j in got:
            await q.complete(ok(j), job=j)
        res = await q.wait_result(a.job_id, 1)
        assert res is not None and res.error is not None  # the cancel result is kept
        assert not await q.cancel(a.job_id)
        await q.close()

    run(go())


def test_feed_reports_completions_with_cursor_and_push(redis_url: str, prefix: str) -> None:
    async def go() -> None:
        q = make(redis_url, prefix)
        jobs = [job(seq=i) for i in range(3)]
        for j in jobs:
            await q.submit(j, feed="tenant:sess:0")
        got = await q.fetch(Q, timeout=2)
        await q.complete(ok(got[0], Skipped(reason="12345")), job=got[0])
        await q.complete(JobResult(job_id=got[1].job_id, error=JobError(category=ErrorCategory.USER, message="no")))
        page = await q.wait_feed("tenant:sess:0", 0, timeout=1)
        assert [(c.request_id, c.failed, c.size) for c in page.completions] == [
            (jobs[0].job_id, False, len(ok(got[0], Skipped(reason="12345")).body)), (jobs[1].job_id, True, None)]
        waiter = asyncio.create_task(q.wait_feed("tenant:sess:0", page.cursor, timeout=20,
                                                 retrieved=[jobs[0].job_id]))
        await asyncio.sleep(0.3)
        assert not waiter.done()
        await q.complete(ok(got[2]), job=got[2])
        nxt = await asyncio.wait_for(waiter, 5)
        assert [c.request_id for c in nxt.completions] == [jobs[2].job_id] and nxt.cursor > page.cursor
        assert await q.wait_result(jobs[0].job_id, 0) is None  # retrieved: payload dropped
        empty = await q.wait_feed("tenant:sess:0", nxt.cursor, timeout=0)
        assert empty.completions == [] and empty.cursor == nxt.cursor
        assert (await q.wait_feed("other:sess:0", 0, timeout=0)).completions == []
        late = job(seq=3)  # cancelled before any worker read it: a failed completion of the feed, and a Skip
        await q.submit(late, feed="tenant:sess:0")
        assert await q.cancel(late.job_id)
        page = await q.wait_feed("tenant:sess:0", nxt.cursor, timeout=1)
        assert [(c.request_id, c.failed) for c in page.completions] == [(late.job_id, True)]
        (skipped,) = await q.fetch(Q, timeout=2)
        assert isinstance(skipped.payload, Skip) and skipped.job_id == late.job_id
        await q.close()

    run(go())


def test_replay_log_and_snapshots(redis_url: str, prefix: str) -> None:
    async def go() -> None:
        q = make(redis_url, prefix)
        jobs = [job(seq=i) for i in range(5)]
        for j in jobs:
            await q.submit(j)
        assert await q.recovery_state("m1") is None
        got = await q.fetch(Q, timeout=2)
        for j in got:
            await q.complete(ok(j), job=j, replay=j.seq_id != 2)
        state = await q.recovery_state("m1")
        assert state is not None and state.last_seq == 4 and state.snapshot_key is None
        assert [j.seq_id for j in state.ops] == [0, 1, 3, 4]
        assert await q.record_snapshot("m1", 3, "snap/a") is None
        assert await q.record_snapshot("m1", 1, "snap/old") == "snap/old"  # older than the recorded one
        state = await q.recovery_state("m1")
        assert state is not None and (state.snapshot_seq, state.snapshot_key) == (3, "snap/a")
        assert [j.seq_id for j in state.ops] == [4]
        assert await q.record_snapshot("m1", 4, "snap/b") == "snap/a"
        await q.close()

    run(go())


def test_a_released_model_leaves_no_durable_state_and_only_the_lease_holder_may_release(
    redis_url: str, prefix: str
) -> None:
    async def go() -> None:
        q = make(redis_url, prefix, lease_ttl=1.0)
        for j in [job(seq=i) for i in range(3)]:
            await q.submit(j)
        for j in await q.fetch(Q, timeout=2):
            await q.complete(ok(j), job=j, replay=True)
        await q.record_snapshot("m1", 1, "snap/a")
        stale = make(redis_url, prefix, lease_ttl=1.0)  # a worker that never held this queue's lease
        stale._queue_of["m1"] = Q  # it believes it runs m1
        with pytest.raises(LeaseLost):
            await stale.forget_model("m1")
        assert await q.recovery_state("m1") is not None
        assert await q.forget_model("m1") == ["snap/a"]
        assert await q.recovery_state("m1") is None
        keys = q.keys
        for key in (keys.oplog("m1"), keys.last_seq("m1"), keys.snapshot("m1")):
            assert not await q.client.exists(key), key
        for queue in (q, stale):
            await queue.close()

    run(go())


def test_undecodable_job_is_failed_not_left_blocking(redis_url: str, prefix: str) -> None:
    async def go() -> None:
        q = make(redis_url, prefix)
        good = job(seq=1)
        await q.client.xadd(q.keys.stream(Q), {"id": "bad-1", "job": b'{"job_id": "bad-1", "from_the_future": 1}'})
        await q.client.hset(q.keys.job("bad-1"), mapping={"tenant": "t1", "kind": "optim_step", "state": "queued"})
        await q.submit(good)
        got = await q.fetch(Q, timeout=2)
        assert [j.job_id for j in got] == [good.job_id]
        res = await q.wait_result("bad-1", 1)
        assert res is not None and res.error is not None and res.error.category is ErrorCategory.SERVER
        assert (await q.client.xpending(q.keys.stream(Q), "workers"))["pending"] == 1  # only the good one
        await q.close()

    run(go())


def test_lost_consumer_group_is_recreated(redis_url: str, prefix: str) -> None:
    async def go() -> None:
        q = make(redis_url, prefix)
        assert await q.fetch(Q, timeout=0.1) == []  # takes the lease, creates the group
        await q.client.delete(q.keys.stream(Q))  # what a Redis restart without persistence leaves behind
        assert await q.fetch(Q, timeout=0.1) == []
        j = job()
        await q.submit(j)
        assert [g.job_id for g in await q.fetch(Q, timeout=2)] == [j.job_id]
        await q.close()

    run(go())
