"""Admission (quotas) in front of the gateway's queue: over a limit a training request is held (paused_rate_limit)
and released in its model's seq order as soon as the limit allows; a sampling request gets 429 + Retry-After;
nothing is lost."""

from __future__ import annotations

import asyncio
import time

import pytest

from api_schemas.jobs import (
    CreateModel,
    ErrorCategory,
    Job,
    JobError,
    JobResult,
    Sample,
    SampleParams,
    Skip,
    queue_name,
)
from api_schemas.training import LoraSpec
from jobqueue.base import DuplicateJobMismatch
from jobqueue.local_queue import LocalQueue
from server.auth.rate_limits import TokenBucket
from server.config import Settings
from server.services.quotas import Admission, RateLimited, job_tokens
from server.services.tenant_limits import Limits, TenantLimits
from tests.unit.engine_jobs import fb, optim

TRAIN = queue_name("tiny", "train")


@pytest.mark.parametrize(
    "per_minute, takes, ask, at, wait",
    [
        (600, [], 600, 0, 0.0),  # a full bucket holds one minute of tokens
        (600, [600], 10, 0, 1.0),  # 10 tokens/s refill
        (600, [600], 10, 1.0, 0.0),
        (600, [300], 400, 0, 10.0),
        (600, [], 5000, 0, 0.0),  # bigger than a minute: goes when the bucket is full...
        (600, [5000], 1, 0, 440.1),  # ...and leaves it in debt
        (600, [600], 600, 120, 0.0),  # refills up to the capacity, no further
    ],
)
def test_token_bucket(per_minute: int, takes: list[int], ask: int, at: float, wait: float) -> None:
    b = TokenBucket.full(per_minute, now=0)
    for n in takes:
        b.take(n, now=0)
    assert b.wait(ask, now=at) == pytest.approx(wait, abs=1e-6)


class FixedLimits(TenantLimits):
    def __init__(self, limits: dict[str, Limits], live: dict[str, int] | None = None) -> None:
        super().__init__(Settings())
        self.fixed, self.live = limits, live or {}

    async def get(self, tenant_id: str) -> Limits:
        return self.fixed.get(tenant_id, Limits())

    async def live_models(self, tenant_id: str, exclude: str = "") -> int:
        return self.live.get(tenant_id, 0)


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 30))


async def _fetched(inner: LocalQueue, n: int) -> list[Job]:
    got: list[Job] = []
    while len(got) < n:
        got += await inner.fetch(TRAIN, 5)
    return got


def test_tokens_per_minute_holds_in_seq_order_and_releases() -> None:
    async def main() -> None:
        inner = LocalQueue()
        gate = Admission(inner, FixedLimits({"t": Limits(tokens_per_minute=6000)}))  # 100 tokens/s
        first = fb("m", 1, [[5] * 5991], tenant="t")  # 5990 tokens: 10 are left in the bucket
        assert job_tokens(first) == 5990
        second, third = fb("m", 2, [[5] * 61], tenant="t"), optim("m", 3)
        third = third.model_copy(update={"tenant_id": "t"})
        for j in (first, second, third):
            assert await gate.admit(j, dedup_key=f"m#{j.seq_id}") == j.job_id
        assert gate.paused_reason(first.job_id) is None
        assert "tokens per minute" in (gate.paused_reason(second.job_id) or "")
        assert "behind" in (gate.paused_reason(third.job_id) or "")  # no tokens, but it keeps the model's order
        info = await gate.info(second.job_id)
        assert info is not None and info.state.value == "queued" and info.tenant_id == "t"
        assert await gate.wait_result(second.job_id, 0.05) is None
        with pytest.raises(DuplicateJobMismatch):
            await gate.admit(fb("m", 2, [[6] * 61], tenant="t"), dedup_key="m#2")
        assert await gate.admit(second, dedup_key="m#2") == second.job_id  # a retry: the same future
        start = time.monotonic()
        got = await _fetched(inner, 3)
        assert [j.seq_id for j in got] == [1, 2, 3]
        assert 0.3 < time.monotonic() - start < 5  # ~0.5 s: 50 missing tokens at 100 tokens/s
        assert gate.paused_reason(second.job_id) is None and gate.paused_reason(third.job_id) is None
        await gate.close()

    run(main())


def test_late_chunk_of_an_admitted_request_is_never_held() -> None:
    async def main() -> None:
        inner = LocalQueue()
        gate = Admission(inner, FixedLimits({"t": Limits(tokens_per_minute=600)}))
        await gate.admit(fb("m", 3, [[5] * 601], tenant="t"))  # chunks sent in parallel, the first one last
        await gate.admit(fb("m", 2, [[5] * 101], tenant="t"))  # over the limit, but seq 3 is already queued
        assert [j.seq_id for j in await _fetched(inner, 2)] == [3, 2]
        held = fb("m", 4, [[5] * 101], tenant="t")
        await gate.admit(held)
        assert gate.paused_reason(held.job_id) is not None
        await gate.close()

    run(main())


def test_concurrent_requests_limit_wakes_on_a_finished_request() -> None:
    async def main() -> None:
        inner = LocalQueue()
        gate = Admission(inner, FixedLimits({"t": Limits(max_concurrent_requests=2)}))
        jobs = [fb(f"m{i}", 1, [[5, 6, 7]], tenant="t") for i in range(3)]
        for j in jobs:
            await gate.admit(j)
        assert "concurrent" in (gate.paused_reason(jobs[2].job_id) or "")
        running = await _fetched(inner, 2)
        await inner.complete(JobResult(job_id=running[0].job_id, error=JobError(category=ErrorCategory.USER,
                                                                               message="x")))
        assert [j.job_id for j in await _fetched(inner, 1)] == [jobs[2].job_id]  # released by the completion
        assert (await gate.wait_result(jobs[0].job_id, 1)) is not None
        await gate.close()

    run(main())


def test_models_limit_holds_a_create_until_a_run_ends() -> None:
    async def main() -> None:
        inner = LocalQueue()
        limits = FixedLimits({"t": Limits(max_models=1)}, live={"t": 1})  # one other live run
        gate = Admission(inner, limits)
        create = Job(job_id="c", tenant_id="t", base_model="tiny", model_id="new", seq_id=0,
                     payload=CreateModel(lora=LoraSpec(rank=2)))
        await gate.admit(create)
        assert "models limit" in (gate.paused_reason("c") or "")
        limits.live["t"] = 0  # its session finished
        assert [j.job_id for j in await _fetched(inner, 1)] == ["c"]
        await gate.close()

    run(main())


def test_cancel_of_a_held_request_still_consumes_its_seq_id() -> None:
    async def main() -> None:
        inner = LocalQueue()
        gate = Admission(inner, FixedLimits({"t": Limits(tokens_per_minute=600)}))
        await gate.admit(fb("m", 1, [[5] * 601], tenant="t"))
        held = fb("m", 2, [[5] * 301], tenant="t")  # would wait 30 s
        await gate.admit(held)
        assert await gate.cancel(held.job_id)
        result = await gate.wait_result(held.job_id, 0.1)
        assert result is not None and result.error is not None and "cancel" in result.error.message
        got = await _fetched(inner, 2)
        assert got[1].seq_id == 2 and isinstance(got[1].payload, Skip)  # reaches the worker as a skip, at once
        await gate.close()

    run(main())


def test_sampling_over_the_limit_gets_429_with_retry_after() -> None:
    async def main() -> None:
        inner = LocalQueue()
        gate = Admission(inner, FixedLimits({"t": Limits(tokens_per_minute=120)}))

        def sample(i: int) -> Job:
            return Job(job_id=f"s{i}", tenant_id="t", base_model="tiny", lane="sample", model_id="sess", seq_id=i,
                       payload=Sample(prompt_tokens=(1, 2, 3), num_samples=2, params=SampleParams(max_tokens=50,
                                      temperature=1.0)))

        assert await gate.admit(sample(0)) == "s0"  # 103 tokens of 120
        with pytest.raises(RateLimited) as e:
            await gate.admit(sample(1))
        assert e.value.status == 429 and int(e.value.headers["Retry-After"]) == 43  # 86 missing at 2 tokens/s
        assert await gate.info("s1") is None  # nothing queued: the client resubmits the same seq_id
        await gate.close()

    run(main())
