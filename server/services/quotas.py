"""Admission: per-tenant quotas applied where the gateway queues its jobs, without ever losing a request.

The gateway builds and queues every job in one place (server/services/jobs.py), and that place admits each one
through `Admission` before it reaches the queue (workers never see admission). A training job over one of its
tenant's limits (tokens per minute, concurrent requests, live models for a create) is accepted with its request
id but *held* here; retrieve_future answers it with `try_again` and `queue_state: paused_rate_limit` (and the
`paused_reason`) until it is released into the queue, in arrival order, as soon as its limit allows: a refilled
bucket, a finished request, a finished session. A model's line stays in seq_id order: once one of its jobs is
held, its later ones queue behind it, and a late chunk of a request that already passed (a lower seq_id than
one already queued) is never held, so the worker never waits on a gap. Sampling requests over a limit get 429
with Retry-After instead, which the SDK answers by resubmitting the same seq_id.

Only Admission knows the jobs it holds, so the gateway looks its jobs up through it (info, wait_result, cancel,
dedup_id: a held job's answer, else the queue's). Held jobs live in this process: a gateway restart loses them
(their futures then answer 404), and with several gateways each applies the limits to the requests it receives.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from api_schemas.jobs import (
    CreateModel,
    ForwardBackward,
    Job,
    JobResult,
    JobState,
    LoadWeights,
    Sample,
)
from jobqueue.base import DuplicateJobMismatch, GatewayQueue, JobInfo, cancelled_result
from server.auth.rate_limits import TokenBucket
from server.errors import TooManyRequests
from server.services.full_param import creates_full_run, lease_wait_reason
from server.services.tenant_limits import Limits, TenantLimits

RECHECK_SECONDS = 2.0  # a held create (models limit) or a request waiting for a slot is looked at again this often
_SLOTS = "concurrent requests limit"


class RateLimited(TooManyRequests):
    category = "user"  # a sample over the tenant's token or concurrency quota


def job_tokens(job: Job) -> int:
    """Tokens a job charges to its tenant's tokens-per-minute budget (a batch's count, made when it was built)."""
    p = job.payload
    if isinstance(p, ForwardBackward):
        return p.tokens
    if isinstance(p, Sample):
        return len(p.prompt_tokens) + p.params.max_tokens * p.num_samples
    return 0


def _limited(limits: Limits) -> bool:
    """Whether any admission limit applies (max_resident_adapters is the engine's, not admission's)."""
    return (limits.max_models is not None or limits.tokens_per_minute is not None
            or limits.max_concurrent_requests is not None)


def _creates(job: Job) -> bool:
    p = job.payload
    return isinstance(p, CreateModel) or (isinstance(p, LoadWeights) and p.create)


@dataclass
class _Held:
    job: Job
    dedup_key: str | None
    feed: str | None
    tokens: int
    reason: str
    arrival: int  # release order across models
    released: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: bool = False


@dataclass
class _Tenant:
    bucket: TokenBucket | None = None
    inflight: set[str] = field(default_factory=set)  # passed jobs not known to be done (with a concurrency limit)


class Admission:
    def __init__(self, queue: GatewayQueue, limits: TenantLimits) -> None:
        self.queue = queue
        self.limits = limits
        self._held: dict[str, _Held] = {}  # job id -> held job
        self._by_key: dict[str, str] = {}  # dedup key -> held job id
        self._lines: dict[str, deque[str]] = {}  # model id -> its held job ids, in seq (arrival) order
        self._passed_seq: dict[str, int] = {}  # model id -> highest seq_id passed to the queue
        self._tenants: dict[str, _Tenant] = {}
        self._order = itertools.count()
        self._kick = asyncio.Event()
        self._releaser: asyncio.Task[None] | None = None
        self._waiting_for_slots: set[str] = set()  # tenants whose held head waits for one of its requests to end

    async def admit(self, job: Job, dedup_key: str | None = None, feed: str | None = None) -> str:
        """Pass `job` to the queue or hold it (its id either way; a retry's dedup_key gives the first job's id).
        Raises RateLimited for a sample over a limit, DuplicateJobMismatch as the queue's submit does."""
        if dedup_key is not None:
            held_id = self._by_key.get(dedup_key)
            if held_id is not None:
                if self._held[held_id].job.fingerprint() != job.fingerprint():
                    raise DuplicateJobMismatch(f"{dedup_key} was already submitted with a different payload")
                return held_id
        limits = await self.limits.get(job.tenant_id)
        # Without a limit to apply or a line to wait in, the job goes straight to the queue, whose submit is
        # idempotent itself: the look-up (one more round trip to Redis) is only needed when a retry could be
        # held or charged again.
        if dedup_key is not None and (_limited(limits) or self._lines.get(job.model_id)):
            if await self.queue.dedup_id(dedup_key) is not None:  # a retry of a queued job: the queue answers
                return await self.queue.submit(job, dedup_key, feed)
        tokens = job_tokens(job)
        if job.lane == "sample":
            wait, reason = await self._verdict(job, limits, tokens)
            if wait is not None:
                raise RateLimited(f"rate limit: {reason}; retry later", wait)
            return await self._pass(job, dedup_key, feed, tokens, limits)
        fills_gap = job.seq_id < self._passed_seq.get(job.model_id, -1)
        if not fills_gap:
            reason = "behind this model's earlier requests" if self._lines.get(job.model_id) else ""
            if not reason:
                reason = (await self._verdict(job, limits, tokens))[1]
            if reason:  # charged when released, under the limits of that time
                return self._hold(_Held(job, dedup_key, feed, tokens, reason, next(self._order)))
        return await self._pass(job, dedup_key, feed, tokens, limits)

    @property
    def held_count(self) -> int:
        """Jobs held here right now (the `twinkle_held_jobs` metric)."""
        return len(self._held)

    def paused_reason(self, job_id: str) -> str | None:
        """Why a job is held (retrieve_future reports `paused_rate_limit` with it), or None when it is not."""
        held = self._held.get(job_id)
        return held.reason if held is not None else None

    # --- looking up the gateway's jobs: the held ones answered here, the rest by the queue ---
    async def dedup_id(self, dedup_key: str) -> str | None:
        return self._by_key.get(dedup_key) or await self.queue.dedup_id(dedup_key)

    async def info(self, job_id: str) -> JobInfo | None:
        held = self._held.get(job_id)
        if held is not None:
            return JobInfo(tenant_id=held.job.tenant_id, result_kind=held.job.result_kind, state=JobState.QUEUED)
        return await self.queue.info(job_id)

    async def wait_result(self, job_id: str, timeout: float) -> JobResult | None:
        held = self._held.get(job_id)
        if held is not None:
            if held.cancelled:
                return cancelled_result(job_id)
            start = time.monotonic()
            try:
                await asyncio.wait_for(held.released.wait(), timeout)
            except TimeoutError:
                return None
            timeout = max(0.0, timeout - (time.monotonic() - start))
        return await self.queue.wait_result(job_id, timeout)

    async def cancel(self, job_id: str) -> bool:
        held = self._held.get(job_id)
        if held is None:
            return await self.queue.cancel(job_id)
        held.cancelled = True  # it still holds its seq_id: released in order, then cancelled in the queue
        self._kick.set()
        return True

    def kick(self) -> None:
        """Look at the held jobs again now (something they wait for may have been freed)."""
        self._kick.set()

    async def close(self) -> None:
        """Stops releasing; the queue belongs to whoever made it and is not closed here."""
        if self._releaser is not None:
            self._releaser.cancel()
            await asyncio.gather(self._releaser, return_exceptions=True)

    # --- admission ---
    async def _verdict(self, job: Job, limits: Limits, tokens: int) -> tuple[float | None, str]:
        """(None, "") when the job may go now, else (seconds until it may be worth another look, why not)."""
        tenant, now = job.tenant_id, time.monotonic()
        if creates_full_run(job):  # the model's full-parameter lease (server/services/full_param.py)
            cap = self.limits.settings.full_param_runs_per_model
            others = sum(1 for h in self._held.values() if creates_full_run(h.job) and h.job.job_id != job.job_id
                         and h.job.base_model == job.base_model)
            live = await self.limits.live_full_runs(job.base_model, exclude=job.model_id) - others
            if live + 1 > cap:
                return RECHECK_SECONDS, lease_wait_reason(job.base_model, live, cap)
        if limits.max_models is not None and _creates(job):
            others = sum(1 for h in self._held.values()
                         if h.job.tenant_id == tenant and _creates(h.job) and h.job.job_id != job.job_id)
            # runs already live, less held creates (their rows exist, they do not run yet), plus this one
            if await self.limits.live_models(tenant, exclude=job.model_id) - others + 1 > limits.max_models:
                return RECHECK_SECONDS, f"models limit ({limits.max_models} live training runs) reached"
        slots = limits.max_concurrent_requests
        if slots is not None and await self._inflight(tenant, slots) >= slots:
            return RECHECK_SECONDS, f"{_SLOTS} ({slots}) reached"
        if limits.tokens_per_minute is not None and tokens:
            wait = self._bucket(tenant, limits.tokens_per_minute, now).wait(tokens, now)
            if wait > 0:
                return wait, f"tokens per minute limit ({limits.tokens_per_minute}) reached"
        return None, ""

    async def _pass(self, job: Job, dedup_key: str | None, feed: str | None, tokens: int, limits: Limits) -> str:
        if limits.tokens_per_minute is not None and tokens:
            now = time.monotonic()
            self._bucket(job.tenant_id, limits.tokens_per_minute, now).take(tokens, now)
        job_id = await self.queue.submit(job, dedup_key, feed)
        if limits.max_concurrent_requests is not None:
            self._tenants.setdefault(job.tenant_id, _Tenant()).inflight.add(job_id)
        if job.lane == "train":
            self._passed_seq[job.model_id] = max(self._passed_seq.get(job.model_id, -1), job.seq_id)
        return job_id

    def _bucket(self, tenant_id: str, per_minute: int, now: float) -> TokenBucket:
        t = self._tenants.setdefault(tenant_id, _Tenant())
        if t.bucket is None:
            t.bucket = TokenBucket.full(per_minute, now)
        elif t.bucket.per_minute != per_minute:
            t.bucket.resize(per_minute, now)
        return t.bucket

    async def _inflight(self, tenant_id: str, limit: int) -> int:
        t = self._tenants.setdefault(tenant_id, _Tenant())
        if len(t.inflight) >= limit:  # only then is it worth asking which of them finished
            for job_id in list(t.inflight):
                info = await self.queue.info(job_id)
                if info is None or info.state is JobState.DONE:
                    t.inflight.discard(job_id)
        return len(t.inflight)

    # --- holding and releasing ---
    def _hold(self, held: _Held) -> str:
        job = held.job
        self._held[job.job_id] = held
        if held.dedup_key is not None:
            self._by_key[held.dedup_key] = job.job_id
        self._lines.setdefault(job.model_id, deque()).append(job.job_id)
        if self._releaser is None or self._releaser.done():
            self._releaser = asyncio.create_task(self._release_loop())
        self._kick.set()
        return job.job_id

    async def _release_loop(self) -> None:
        while self._held:
            self._kick.clear()
            wake = await self._release_ready()
            if not self._held:
                break
            waits: list[asyncio.Task[object]] = [asyncio.create_task(self._kick.wait())]
            if wake is not None:
                waits.append(asyncio.create_task(asyncio.sleep(wake)))
            for tenant in self._waiting_for_slots:  # a finished request frees a slot: wake on it, not on a timer
                for job_id in list(self._tenants.get(tenant, _Tenant()).inflight)[:64]:
                    waits.append(asyncio.create_task(self.queue.wait_result(job_id, RECHECK_SECONDS * 15)))
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _release_ready(self) -> float | None:
        """Pass every held job whose limits now allow it (heads of the models' lines, oldest first)."""
        wake: float | None = None
        self._waiting_for_slots = set()
        for model in sorted(self._lines, key=lambda m: self._held[self._lines[m][0]].arrival):
            line = self._lines[model]
            while line:
                held = self._held[line[0]]
                limits = await self.limits.get(held.job.tenant_id)
                if held.cancelled:
                    limits, held.tokens = Limits(), 0  # costs nothing: it only consumes its seq_id
                wait, reason = await self._verdict(held.job, limits, held.tokens)
                if wait is not None:
                    held.reason = reason
                    wake = wait if wake is None else min(wake, wait)
                    if reason.startswith(_SLOTS):
                        self._waiting_for_slots.add(held.job.tenant_id)
                    break
                line.popleft()
                await self._pass(held.job, held.dedup_key, held.feed, held.tokens, limits)
                if held.cancelled:
                    await self.queue.cancel(held.job.job_id)
                self._forget(held)
            if not line:
                del self._lines[model]
        return wake

    def _forget(self, held: _Held) -> None:
        job_id = held.job.job_id
        self._held.pop(job_id, None)
        if held.dedup_key is not None and self._by_key.get(held.dedup_key) == job_id:
            del self._by_key[held.dedup_key]
        held.released.set()
