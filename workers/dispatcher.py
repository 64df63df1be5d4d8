"""The worker loop: fetch jobs of one queue, order and batch them with the scheduler, run them, publish results.

Compute runs on one dedicated thread (torch calls block); the loop itself stays responsive. Between two steps
the loop fetches whatever arrived meanwhile, so jobs of many tenants that arrive during a step are merged into the
next one (continuous batching). A merged step's results are acknowledged one by one as the engine reports them,
so each tenant's future completes as soon as its slice is done.

A job is acknowledged together with its result (`queue.complete`), after it ran; a worker that dies before
that leaves the job to be redelivered to its successor. The first time this worker meets a model that already
ran elsewhere, `Recovery` rebuilds its adapter (snapshot + replay of acknowledged jobs) and the model's line
resumes after its last acknowledged seq_id, so every acknowledged job takes effect exactly once.

A ReleaseModel job (queued by the gateway once the model's session has ended) drops the adapter, then the model's
durable state in the queue and its snapshot files; run twice (a redelivery), it finds nothing left to drop.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, runtime_checkable

from api_schemas.jobs import ErrorCategory, Job, JobError, JobResult, ReleaseModel
from jobqueue import tracing
from jobqueue.base import LeaseLost, WorkerQueue
from jobqueue.logs import REQUEST_ID
from workers import metrics
from workers.recovery import Recovery
from workers.scheduler import JobSize, Scheduler, Step

log = logging.getLogger(__name__)

_BUSY_FETCH_TIMEOUT = 0.0  # with work ready, only pick up what already arrived (never wait for more)


@runtime_checkable
class StepEngine(Protocol):
    """What runs merged steps (workers/engine/trainer.Trainer)."""

    def execute(self, job: Job) -> JobResult: ...

    def execute_step(self, jobs: list[Job], on_result: Callable[[JobResult], None]) -> None: ...

    def measure(self, job: Job) -> JobSize: ...


def _server_error(job: Job, message: str = "worker error") -> JobResult:
    return JobResult(job_id=job.job_id, error=JobError(category=ErrorCategory.SERVER, message=message))


class Dispatcher:
    def __init__(
        self,
        queue: WorkerQueue,
        queue_name: str,
        execute: Callable[[Job], JobResult] | StepEngine,
        gap_timeout: float = 30.0,
        fetch_timeout: float = 1.0,
        recovery: Recovery | None = None,
        token_budget: int | None = None,
    ) -> None:
        """`execute` is a StepEngine, or the bound `execute` of one (both get merged steps), or a plain function
        (every job then runs alone)."""
        self.queue = queue
        self.queue_name = queue_name
        owner = getattr(execute, "__self__", None)
        self.engine = execute if isinstance(execute, StepEngine) else owner if isinstance(owner, StepEngine) else None
        self.execute: Callable[[Job], JobResult] = self.engine.execute if self.engine is not None else execute  # type: ignore[assignment]
        measure = self.engine.measure if self.engine is not None else None
        budget = token_budget or getattr(self.engine, "token_budget", None) or 16384  # None: the engine's default
        self.scheduler = Scheduler(gap_timeout, token_budget=budget, measure=measure)
        self.fetch_timeout = fetch_timeout
        self.recovery = recovery
        self._known: set[str] = set()  # models whose durable state this worker has looked up
        self._taken: dict[str, float] = {}  # job id -> when this worker fetched it (its latency metric)
        self.base_model = queue_name.split("|", 1)[0]
        self.spans = tracing.JobSpans(self.base_model)  # jobs' wait and run spans (only with tracing on)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twinkle-compute")
        self._stopping = False

    async def run(self) -> None:
        while not self._stopping:
            timeout = self.fetch_timeout
            deadline = self.scheduler.next_deadline()
            if deadline is not None:
                timeout = max(0.0, min(timeout, deadline - time.monotonic()))
            if self.scheduler.has_ready(time.monotonic()):
                timeout = _BUSY_FETCH_TIMEOUT
            try:
                jobs = await self.queue.fetch(self.queue_name, timeout)
            except LeaseLost:
                raise
            except Exception:  # the queue's backend is down (a Redis restart): wait and retry, keep the state
                log.warning("fetching from %s failed; retrying", self.queue_name, exc_info=True)
                await asyncio.sleep(0.5)
                continue
            now = time.monotonic()
            for job in jobs:
                self._taken[job.job_id] = now
                if job.traceparent is not None:
                    self.spans.fetched(job)
                if job.model_id not in self._known and not isinstance(job.payload, ReleaseModel):
                    await self._recover(job.model_id)
                rejection = self.scheduler.add(job, now)
                if rejection is not None:
                    await self._complete(JobResult(
                        job_id=job.job_id, error=JobError(category=ErrorCategory.USER, message=rejection.reason)))
            step = self.scheduler.next_step(time.monotonic())
            if step is not None:
                await self._run_step(step)

    async def _run_step(self, step: Step) -> None:
        if self.engine is None or (not step.merged and len(step.jobs) == 1):
            for job in step.jobs:
                await self._run(job)
            return
        if step.merged:
            metrics.merged_step(self.base_model, list(step.jobs))
        span = None
        if self.spans.open:
            span = self.spans.step(step.jobs, step.merged)
            self.spans.started(step.jobs, span)
        # One hand-over to the compute thread for the whole step: a merged pass, or barrier jobs of several models
        try:
            results = await self._run_together(self.engine, step.jobs)
        finally:
            tracing.end_step(span)
        if not step.merged:
            for job in step.jobs:
                await self._snapshot_if_due(job, results[job.job_id])

    async def _run_together(self, engine: StepEngine, jobs: tuple[Job, ...]) -> dict[str, JobResult]:
        """Run the jobs in one execute_step; each is acknowledged as soon as the engine reports its result."""
        loop = asyncio.get_running_loop()
        by_id = {j.job_id: j for j in jobs}
        results: dict[str, JobResult] = {}
        acks: list[asyncio.Future[None]] = []

        def on_result(result: JobResult) -> None:  # on the compute thread: acknowledge from the loop, at once
            job = by_id.pop(result.job_id, None)
            if job is not None:
                results[job.job_id] = result
                loop.call_soon_threadsafe(lambda: acks.append(asyncio.ensure_future(self._acknowledge(result, job))))

        try:
            await loop.run_in_executor(self._executor, engine.execute_step, list(jobs), on_result)
        except Exception:  # execute_step reports its own failures; this guards the loop itself
            log.exception("executing a step of %d jobs failed", len(jobs))
        await asyncio.sleep(0)  # the callbacks queued before the step returned run first (FIFO)
        for job in list(by_id.values()):  # every job gets exactly one result
            results[job.job_id] = _server_error(job)
            acks.append(asyncio.ensure_future(self._acknowledge(results[job.job_id], job)))
        by_id.clear()
        await asyncio.gather(*acks)
        return results

    async def _acknowledge(self, result: JobResult, job: Job) -> None:
        rec = self.recovery
        await self._complete(result, job, replay=rec is not None and rec.mutates(job, result))

    async def _run(self, job: Job) -> None:
        loop = asyncio.get_running_loop()
        if self.spans.open:
            self.spans.started((job,))
        token = REQUEST_ID.set(job.request_id)  # the engine's log lines about this job carry its request id
        try:
            context = contextvars.copy_context()  # run_in_executor would not carry it to the compute thread
            result = await loop.run_in_executor(self._executor, context.run, self.execute, job)
        except Exception:  # execute() reports its own failures; this guards the loop itself
            log.exception("executing %s failed", job.job_id)
            result = _server_error(job)
        finally:
            REQUEST_ID.reset(token)
        if isinstance(job.payload, ReleaseModel):
            await self._release(job, result)
            return
        rec = self.recovery
        await self._complete(result, job, replay=rec is not None and rec.mutates(job, result))
        await self._snapshot_if_due(job, result)

    async def _snapshot_if_due(self, job: Job, result: JobResult) -> None:
        """After an acknowledged barrier job: take the model's durable snapshot when recovery asks for one."""
        rec = self.recovery
        if rec is not None and rec.wants_snapshot(job, result):
            loop = asyncio.get_running_loop()
            key = await loop.run_in_executor(self._executor, rec.snapshot, job.model_id, job.seq_id)
            stale = await self.queue.record_snapshot(job.model_id, job.seq_id, key)
            if stale is not None:
                await loop.run_in_executor(self._executor, rec.discard, stale)

    async def _complete(self, result: JobResult, job: Job | None = None, replay: bool = False) -> None:
        """Acknowledge with the result; retried while the backend is away, since the effect already happened. The
        job's metrics and log line follow the acknowledgement, off the path of the waiting client."""
        taken = self._taken.pop(result.job_id, None)
        seconds = time.monotonic() - taken if taken is not None else None
        delay = 0.1
        while True:
            try:
                await self.queue.complete(result, job=job, replay=replay)
                if self.spans.open:
                    self.spans.finished(result)
                if job is not None and seconds is not None:
                    metrics.job_finished(job, result, seconds)
                    log.debug("job %s (%s of %s) %s in %.3f s", job.job_id, job.payload.kind, job.model_id,
                              "done" if result.ok else "failed", seconds, extra={"request_id": job.request_id})
                return
            except LeaseLost:
                raise
            except Exception:
                log.warning("acknowledging %s failed; retrying", result.job_id, exc_info=True)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def _release(self, job: Job, result: JobResult) -> None:
        """After the engine dropped the adapter: forget the model's durable state, then acknowledge (no seq_id of
        the model is consumed). A crash in between redelivers the release, which then has less to do."""
        self._known.discard(job.model_id)
        if result.ok:
            snapshots = await self.queue.forget_model(job.model_id)
            if self.recovery is not None:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(self._executor, self.recovery.forget, job.model_id, snapshots)
            log.info("released %s (%s)", job.model_id, job.payload.reason)  # type: ignore[union-attr]
        await self._complete(result)

    async def _recover(self, model_id: str) -> None:
        delay = 0.1
        while True:  # without the model's durable state its line cannot start: wait for the backend
            try:
                state = await self.queue.recovery_state(model_id)
                break
            except Exception:
                log.warning("reading the durable state of %s failed; retrying", model_id, exc_info=True)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        self._known.add(model_id)
        if state is None:
            return
        if self.recovery is not None:
            loop = asyncio.get_running_loop()
            try:
                await loop.run_in_executor(self._executor, self.recovery.rebuild, state)
            except Exception:  # only this model's jobs fail ("not loaded"); the others go on
                log.exception("rebuilding %s failed", model_id)
        self.scheduler.resume(model_id, state.last_seq + 1)

    def stop(self) -> None:
        self._stopping = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.spans.close()
