"""The sample-lane worker loop: fetch `Sample` jobs of one base model and hand each to the sampler backend.

Unlike training there is no per-model order to keep, so every fetched job runs at once as its own task; the
backend batches whatever is in flight (continuous batching). A failing request fails only its own future.
"""

from __future__ import annotations

import asyncio
import logging
import time

from api_schemas.jobs import ErrorCategory, Job, JobError, JobResult, Sample
from jobqueue import tracing
from jobqueue.base import WorkerQueue
from jobqueue.logs import REQUEST_ID
from workers import metrics
from workers.sampling.base import SamplerBackend, SamplerUserError

log = logging.getLogger(__name__)


class SamplerWorker:
    def __init__(self, queue: WorkerQueue, queue_name: str, backend: SamplerBackend, fetch_timeout: float = 1.0) -> None:
        self.queue = queue
        self.queue_name = queue_name
        self.backend = backend
        self.fetch_timeout = fetch_timeout
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self.spans = tracing.JobSpans(queue_name.split("|", 1)[0])  # jobs' wait and run spans (tracing on only)

    async def run(self) -> None:
        await self.backend.start()
        try:
            while not self._stopping:
                for job in await self.queue.fetch(self.queue_name, self.fetch_timeout):
                    if job.traceparent is not None:
                        self.spans.fetched(job)
                    task = asyncio.create_task(self._serve(job))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            self.spans.close()
            await self.backend.close()

    async def _serve(self, job: Job) -> None:
        if self.spans.open:
            self.spans.started((job,))
        result = await self.execute(job)
        await self.queue.complete(result)
        if self.spans.open:
            self.spans.finished(result)

    async def execute(self, job: Job) -> JobResult:
        """The job's result (never raises but for cancellation); its latency and tokens go to workers/metrics.py."""
        started = time.monotonic()
        token = REQUEST_ID.set(job.request_id)  # log lines about this job carry the request that queued it
        try:
            result = await self._execute(job)
        finally:
            REQUEST_ID.reset(token)
        seconds = time.monotonic() - started
        metrics.job_finished(job, result, seconds)
        log.debug("job %s (sample of %s) %s in %.3f s", job.job_id, job.model_id, "done" if result.ok else "failed",
                  seconds, extra={"request_id": job.request_id})
        return result

    async def _execute(self, job: Job) -> JobResult:
        p = job.payload
        try:
            if not isinstance(p, Sample):
                raise SamplerUserError(f"the sampler cannot run {p.kind} jobs")
            return JobResult(job_id=job.job_id, output=await self.backend.sample(p))
        except SamplerUserError as e:
            log.info("sample job %s failed: %s", job.job_id, e)
            return JobResult(job_id=job.job_id, error=JobError(category=ErrorCategory.USER, message=str(e)))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # one request's fault must not stop the sampler
            log.exception("sample job %s crashed", job.job_id)
            msg = f"internal error while sampling: {type(e).__name__}"
            return JobResult(job_id=job.job_id, error=JobError(category=ErrorCategory.SERVER, message=msg))

    def stop(self) -> None:
        self._stopping = True
