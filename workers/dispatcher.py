"""The worker loop: fetch jobs for one base model, order them with the scheduler, run them, publish results.

Compute runs on one dedicated thread (torch calls block); the loop itself stays responsive.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from api_schemas.jobs import ErrorCategory, Job, JobError, JobResult
from jobqueue.base import JobQueue
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
    ) -> None:
        self.queue = queue
        self.queue_name = queue_name
        self.execute = execute
        self.scheduler = Scheduler(gap_timeout)
        self.fetch_timeout = fetch_timeout
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="twinkle-compute")
        self._stopping = False

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping:
            timeout = self.fetch_timeout
            deadline = self.scheduler.next_deadline()
            if deadline is not None:
                timeout = max(0.0, min(timeout, deadline - time.monotonic()))
            jobs = await self.queue.fetch(self.queue_name, timeout)
            now = time.monotonic()
            for job in jobs:
                rejection = self.scheduler.add(job, now)
                if rejection is not None:
                    await self._fail(job, rejection.reason)
            for job in self.scheduler.pop_ready(time.monotonic()):
                try:
                    result = await loop.run_in_executor(self._executor, self.execute, job)
                except Exception:  # execute() reports its own failures; this guards the loop itself
                    log.exception("executing %s failed", job.job_id)
                    result = JobResult(
                        job_id=job.job_id, error=JobError(category=ErrorCategory.SERVER, message="worker error")
                    )
                await self.queue.complete(result)

    async def _fail(self, job: Job, reason: str) -> None:
        await self.queue.complete(
            JobResult(job_id=job.job_id, error=JobError(category=ErrorCategory.USER, message=reason))
        )

    def stop(self) -> None:
        self._stopping = True
        self._executor.shutdown(wait=False, cancel_futures=True)
