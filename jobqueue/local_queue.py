"""In-process queue for embedded mode: same interface as the Redis queue, asyncio primitives inside.

Results are kept `result_ttl` seconds after completion, so a client may fetch a result more than once.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field

from api_schemas.jobs import Job, JobResult, JobState
from jobqueue.base import DuplicateJobMismatch, JobInfo, JobQueue


@dataclass
class _Record:
    job: Job
    state: JobState = JobState.QUEUED
    result: JobResult | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    finished_at: float = 0.0


class LocalQueue(JobQueue):
    def __init__(self, result_ttl: float = 900.0) -> None:
        self._records: dict[str, _Record] = {}
        self._dedup: dict[str, tuple[str, str]] = {}  # dedup key -> (job_id, fingerprint)
        self._pending: dict[str, asyncio.Queue[Job]] = defaultdict(asyncio.Queue)
        self._result_ttl = result_ttl

    async def submit(self, job: Job, dedup_key: str | None = None) -> str:
        self._expire()
        if dedup_key is not None:
            seen = self._dedup.get(dedup_key)
            if seen is not None:
                if seen[1] != job.fingerprint():
                    raise DuplicateJobMismatch(f"{dedup_key} was already submitted with a different payload")
                return seen[0]
            self._dedup[dedup_key] = (job.job_id, job.fingerprint())
        self._records[job.job_id] = _Record(job)
        self._pending[job.queue_name].put_nowait(job)
        return job.job_id

    async def dedup_id(self, dedup_key: str) -> str | None:
        seen = self._dedup.get(dedup_key)
        return seen[0] if seen else None

    async def info(self, job_id: str) -> JobInfo | None:
        rec = self._records.get(job_id)
        if rec is None:
            return None
        return JobInfo(tenant_id=rec.job.tenant_id, result_type=rec.job.result_type, state=rec.state)

    async def wait_result(self, job_id: str, timeout: float) -> JobResult | None:
        rec = self._records.get(job_id)
        if rec is None:
            return None
        try:
            await asyncio.wait_for(rec.done.wait(), timeout)
        except asyncio.TimeoutError:
            return None
        return rec.result

    async def fetch(self, queue_name: str, timeout: float) -> list[Job]:
        q = self._pending[queue_name]
        try:
            first = await asyncio.wait_for(q.get(), timeout)
        except asyncio.TimeoutError:
            return []
        jobs = [first]
        while not q.empty():
            jobs.append(q.get_nowait())
        for j in jobs:
            if j.job_id in self._records:
                self._records[j.job_id].state = JobState.RUNNING
        return jobs

    async def complete(self, result: JobResult) -> None:
        rec = self._records.get(result.job_id)
        if rec is None:
            return
        rec.result, rec.state, rec.finished_at = result, JobState.DONE, time.monotonic()
        rec.done.set()

    def _expire(self) -> None:
        cutoff = time.monotonic() - self._result_ttl
        stale = [k for k, r in self._records.items() if r.state is JobState.DONE and r.finished_at < cutoff]
        for k in stale:
            del self._records[k]
        if stale:
            gone = set(stale)
            self._dedup = {k: v for k, v in self._dedup.items() if v[0] not in gone}
