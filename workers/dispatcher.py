"""The worker loop: fetch jobs of one queue, order them with the scheduler, run them, publish results.

Compute runs on one dedicated thread (torch calls block); the loop itself stays responsive.

A job is acknowledged together with its result (`queue.complete`), after it ran; a worker that dies before
that leaves the job to be redelivered to its successor. The first time this worker meets a model that already
ran elsewhere, `Recovery` rebuilds its adapter (snapshot + replay of acknowledged jobs) and the model's line
resumes after its last acknowledged seq_id, so every acknowledged job takes effect exactly once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from api_schemas.jobs import ErrorCategory, Job, JobError, JobResult
from jobqueue.base import JobQueue, LeaseLost
from workers.recovery import Recovery
from workers.scheduler import Scheduler

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(
        self,
        queue: JobQueue,
        queue_name: str,
        execute: Callable[[Job], JobResult],
        gap_timeout: float = 30.0,
        fetch_timeout: float = 1.0,
        recovery: Recovery | None = None,
    ) -> None:
        self.queue = queue
        self.queue_name = queue_name
        self.execute = execute
        self.scheduler = Scheduler(gap_timeout)
        self.fetch_timeout = fetch_timeout
        self.recovery = recovery
        self._known: set[str] = set()  # models whose durable state this worker has looked up
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twinkle-compute")
        self._stopping = False

    async def run(self) -> None:
        while not self._stopping:
            timeout = self.fetch_timeout
            deadline = self.scheduler.next_deadline()
            if deadline is not None:
                timeout = max(0.0, min(timeout, deadline - time.monotonic()))
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
                if job.model_id not in self._known:
                    await self._recover(job.model_id)
                rejection = self.scheduler.add(job, now)
                if rejection is not None:
                    await self._complete(JobResult(
                        job_id=job.job_id, error=JobError(category=ErrorCategory.USER, message=rejection.reason)))
            for job in self.scheduler.pop_ready(time.monotonic()):
                await self._run(job)

    async def _run(self, job: Job) -> None:
        loop = asyncio.get_running_loop()
        try:
            result = await loop.run_in_executor(self._executor, self.execute, job)
        except Exception:  # execute() reports its own failures; this guards the loop itself
            log.exception("executing %s failed", job.job_id)
            result = JobResult(job_id=job.job_id, error=JobError(category=ErrorCategory.SERVER, message="worker error"))
        rec = self.recovery
        await self._complete(result, job, replay=rec is not None and rec.mutates(job, result))
        if rec is not None and rec.wants_snapshot(job, result):
            key = await loop.run_in_executor(self._executor, rec.snapshot, job.model_id, job.seq_id)
            stale = await self.queue.record_snapshot(job.model_id, job.seq_id, key)
            if stale is not None:
                await loop.run_in_executor(self._executor, rec.discard, stale)

    async def _complete(self, result: JobResult, job: Job | None = None, replay: bool = False) -> None:
        """Acknowledge with the result; retried while the backend is away, since the effect already happened."""
        delay = 0.1
        while True:
            try:
                await self.queue.complete(result, job=job, replay=replay)
                return
            except LeaseLost:
                raise
            except Exception:
                log.warning("acknowledging %s failed; retrying", result.job_id, exc_info=True)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

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
