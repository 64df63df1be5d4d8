"""In-process queue for embedded mode: both faces of the queue (GatewayQueue and WorkerQueue, jobqueue/base.py)
as the Redis queue has them, asyncio primitives inside.

Results are kept `result_ttl` seconds after completion, so a client may fetch a result more than once.
Nothing here survives the process, so there is nothing to recover (the recovery hooks keep their defaults).
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from api_schemas.jobs import Job, JobResult, JobState
from jobqueue.base import (
    Completion,
    DuplicateJobMismatch,
    FeedPage,
    GatewayQueue,
    Health,
    JobInfo,
    WorkerQueue,
    as_skip,
    cancelled_result,
)


@dataclass
class _Record:
    job: Job
    feed: str | None = None
    state: JobState = JobState.QUEUED
    result: JobResult | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    finished_at: float = 0.0
    dedup_key: str | None = None


@dataclass
class _Feed:
    events: list[tuple[int, Completion]] = field(default_factory=list)
    next_cursor: int = 1
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class LocalQueue(GatewayQueue, WorkerQueue):
    def __init__(self, result_ttl: float = 900.0) -> None:
        self._records: dict[str, _Record] = {}
        # dedup key -> the job first queued under it; its fingerprint is taken only when a retry comes (Redis
        # stores one with every job; here the job itself is at hand, and hashing a batch costs a step's CPU)
        self._dedup: dict[str, Job] = {}
        self._pending: dict[str, asyncio.Queue[Job]] = defaultdict(asyncio.Queue)
        self._feeds: dict[str, _Feed] = defaultdict(_Feed)
        self._result_ttl = result_ttl
        self._finished: deque[tuple[float, str]] = deque()  # (finished at, job id), oldest first: what to expire

    async def submit(self, job: Job, dedup_key: str | None = None, feed: str | None = None) -> str:
        self._expire()
        if dedup_key is not None:
            seen = self._dedup.get(dedup_key)
            if seen is not None:
                if seen.fingerprint() != job.fingerprint():
                    raise DuplicateJobMismatch(f"{dedup_key} was already submitted with a different payload")
                return seen.job_id
            self._dedup[dedup_key] = job
        self._records[job.job_id] = _Record(job, feed, dedup_key=dedup_key)
        self._pending[job.queue_name].put_nowait(job)
        return job.job_id

    async def dedup_id(self, dedup_key: str) -> str | None:
        seen = self._dedup.get(dedup_key)
        return seen.job_id if seen is not None else None

    async def info(self, job_id: str) -> JobInfo | None:
        rec = self._records.get(job_id)
        if rec is None:
            return None
        return JobInfo(tenant_id=rec.job.tenant_id, result_kind=rec.job.result_kind, state=rec.state)

    async def wait_result(self, job_id: str, timeout: float) -> JobResult | None:
        rec = self._records.get(job_id)
        if rec is None:
            return None
        if not rec.done.is_set():
            try:
                async with asyncio.timeout(timeout):  # unlike wait_for, no task per wait
                    await rec.done.wait()
            except TimeoutError:
                return None
        return rec.result

    async def wait_feed(self, feed: str, after: int, timeout: float, retrieved: Sequence[str] = ()) -> FeedPage:
        f = self._feeds[feed]
        f.events = [(c, e) for c, e in f.events if c > after]
        for job_id in retrieved:
            rec = self._records.get(job_id)
            if rec is not None and rec.feed == feed and rec.state is JobState.DONE:
                del self._records[job_id]
        deadline = time.monotonic() + timeout
        while not f.events:
            f.changed.clear()
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(f.changed.wait(), left)
            except asyncio.TimeoutError:
                break
        cursor = max((c for c, _ in f.events), default=after)
        return FeedPage([e for _, e in f.events], cursor)

    async def cancel(self, job_id: str) -> bool:
        rec = self._records.get(job_id)
        if rec is None or rec.state is not JobState.QUEUED:
            return False
        self._finish(rec, cancelled_result(job_id))
        return True

    async def fetch(self, queue_name: str, timeout: float) -> list[Job]:
        q = self._pending[queue_name]
        if q.empty():
            if timeout <= 0:  # a non-blocking look: what already arrived, nothing more
                return []
            try:
                async with asyncio.timeout(timeout):
                    first = await q.get()
            except TimeoutError:
                return []
        else:
            first = q.get_nowait()
        jobs = [first]
        while not q.empty():
            jobs.append(q.get_nowait())
        out = []
        for j in jobs:
            rec = self._records.get(j.job_id)
            if rec is not None and rec.state is JobState.DONE:  # cancelled while queued
                out.append(as_skip(j))
                continue
            if rec is not None:
                rec.state = JobState.RUNNING
            out.append(j)
        return out

    async def complete(self, result: JobResult, job: Job | None = None, replay: bool = False) -> None:
        rec = self._records.get(result.job_id)
        if rec is None or rec.result is not None:  # unknown, or already done (cancelled): keep the first result
            return
        self._finish(rec, result)

    def _finish(self, rec: _Record, result: JobResult) -> None:
        rec.result, rec.state, rec.finished_at = result, JobState.DONE, time.monotonic()
        rec.done.set()
        self._finished.append((rec.finished_at, result.job_id))
        if rec.feed is not None:
            f = self._feeds[rec.feed]
            size = len(result.body) if result.ok else None
            f.events.append((f.next_cursor, Completion(result.job_id, not result.ok, size)))
            f.next_cursor += 1
            f.changed.set()

    async def health(self) -> Health:
        return Health(ok=True, detail="in-process")

    async def depth(self, queue_names: Sequence[str]) -> dict[str, int]:
        return {name: self._pending[name].qsize() if name in self._pending else 0 for name in queue_names}

    async def worker_metrics(self) -> dict[str, bytes]:
        return {}  # the workers share this process and its registry

    async def close(self) -> None:
        pass

    def _expire(self) -> None:
        """Forget results older than the TTL (and their dedup keys): oldest first, so each submit does O(1) work."""
        cutoff = time.monotonic() - self._result_ttl
        while self._finished and self._finished[0][0] < cutoff:
            _, job_id = self._finished.popleft()
            rec = self._records.pop(job_id, None)
            key = rec.dedup_key if rec is not None else None
            if key is not None and key in self._dedup and self._dedup[key].job_id == job_id:
                del self._dedup[key]
