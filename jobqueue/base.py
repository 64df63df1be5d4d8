"""The queue interface both wirings implement: the in-process queue (embedded) and Redis Streams (cluster)."""

from __future__ import annotations

import abc
from dataclasses import dataclass

from api_schemas.jobs import Job, JobResult, JobState


class DuplicateJobMismatch(Exception):
    """A retry reused a natural key (model+seq_id, or an idempotency key) with a different payload."""


@dataclass(frozen=True)
class JobInfo:
    tenant_id: str
    result_type: str
    state: JobState


class JobQueue(abc.ABC):
    """Gateway side: submit / info / wait_result. Worker side: fetch / complete."""

    @abc.abstractmethod
    async def submit(self, job: Job, dedup_key: str | None = None) -> str:
        """Queue `job` once. A second submit with the same dedup_key returns the first job's id (same payload)
        or raises DuplicateJobMismatch (different payload)."""

    @abc.abstractmethod
    async def dedup_id(self, dedup_key: str) -> str | None:
        """The job id a dedup key was first used for, if it is still remembered."""

    @abc.abstractmethod
    async def info(self, job_id: str) -> JobInfo | None:
        """Owner, result type and state of a job; None if unknown or expired."""

    @abc.abstractmethod
    async def wait_result(self, job_id: str, timeout: float) -> JobResult | None:
        """The result once it exists, waiting up to `timeout` seconds for a push (never a sleep-poll)."""

    @abc.abstractmethod
    async def fetch(self, queue_name: str, timeout: float) -> list[Job]:
        """Worker side: the jobs queued under `queue_name` (= Job.queue_name; at least one unless `timeout` passed)."""

    @abc.abstractmethod
    async def complete(self, result: JobResult) -> None:
        """Worker side: store a job's result and wake its waiters."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        pass
