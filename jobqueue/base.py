"""The two faces of the queue, and what crosses them: both wirings (the in-process queue of embedded mode and
Redis Streams in cluster mode) implement both.

GatewayQueue, what the gateway uses: submit / dedup_id / info / wait_result / wait_feed / cancel.
WorkerQueue, what the workers use: fetch / complete, and the durable state a restarted worker rebuilds its adapters
from (recovery_state / record_snapshot / forget_model); the in-process queue has nothing to recover and keeps the
defaults. Both: close, and health (for readiness checks).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from api_schemas.jobs import ErrorCategory, Job, JobError, JobResult, JobState, ResultKind, Skip
from jobqueue.heartbeats import DeploymentStatus

CANCELLED = "cancelled by the client"


class DuplicateJobMismatch(Exception):
    """A retry reused a natural key (model+seq_id, or an idempotency key) with a different payload."""


class LeaseLost(Exception):
    """This worker no longer holds its base model's lease: another worker took over, so it must stop."""


@dataclass(frozen=True)
class JobInfo:
    tenant_id: str
    result_kind: ResultKind
    state: JobState


@dataclass(frozen=True)
class Completion:
    """One event of a feed (the jobs of one sampling session), as retrieve_futures reports it."""

    request_id: str
    failed: bool
    size: int | None = None  # bytes of the result body, for a finished job


@dataclass(frozen=True)
class FeedPage:
    completions: list[Completion]
    cursor: int  # pass back as `after`; events at or before it are acknowledged and dropped


@dataclass(frozen=True)
class RecoveryState:
    """What a worker needs to rebuild one model's adapter after the worker that held it died."""

    model_id: str
    last_seq: int  # highest acknowledged seq_id: the model's line resumes at last_seq + 1
    snapshot_seq: int | None = None
    snapshot_key: str | None = None  # checkpoint storage key of the snapshot (weights + optimizer state)
    ops: list[Job] = field(default_factory=list)  # acknowledged state-changing jobs after the snapshot, seq order


@dataclass(frozen=True)
class Health:
    """Whether the queue answers (Redis: a PING), and the worker deployments that report through it (cluster)."""

    ok: bool
    detail: str = ""  # "in-process", "redis", or why not
    deployments: list[DeploymentStatus] = field(default_factory=list)


def cancelled_result(job_id: str) -> JobResult:
    return JobResult(job_id=job_id, error=JobError(category=ErrorCategory.USER, message=CANCELLED))


def as_skip(job: Job) -> Job:
    """A cancelled job still holds its seq_id: it reaches the worker as a Skip so later jobs are not held back."""
    return job.model_copy(update={"payload": Skip(reason=CANCELLED)})




class GatewayQueue(Protocol):
    """The gateway's side: queue jobs, look them up, wait for their results and their feeds' events."""

    async def submit(self, job: Job, dedup_key: str | None = None, feed: str | None = None) -> str:
        """Queue `job` once. A second submit with the same dedup_key returns the first job's id (same payload)
        or raises DuplicateJobMismatch (different payload). With a `feed`, the job's completion is also
        reported as an event of that feed (see wait_feed)."""

    async def dedup_id(self, dedup_key: str) -> str | None:
        """The job id a dedup key was first used for, if it is still remembered."""

    async def info(self, job_id: str) -> JobInfo | None:
        """Owner, result kind and state of a job; None if unknown or expired. (The Redis queue says QUEUED until
        DONE: a worker's read is what starts a job there, and is not recorded apart.)"""

    async def wait_result(self, job_id: str, timeout: float) -> JobResult | None:
        """The result once it exists, waiting up to `timeout` seconds for a push (never a sleep-poll)."""

    async def wait_feed(self, feed: str, after: int, timeout: float, retrieved: Sequence[str] = ()) -> FeedPage:
        """Events of `feed` after cursor `after`, waiting up to `timeout` seconds for one if there are none.
        Events up to `after` are dropped; `retrieved` are job ids of the feed whose results may be dropped."""

    async def cancel(self, job_id: str) -> bool:
        """Cancel a job that has not started: it fails with CANCELLED and never runs. False if it already ran
        or is running (or is unknown)."""

    async def health(self) -> Health:
        """Whether the queue answers; never raises (a failure is `ok=False` with the reason)."""

    async def depth(self, queue_names: Sequence[str]) -> dict[str, int]:
        """Per queue name: the jobs queued that no worker has taken yet (the `twinkle_queue_depth` metric)."""

    async def worker_metrics(self) -> dict[str, bytes]:
        """{worker id: Prometheus text} that separate worker processes published (jobqueue/metrics_feed.py);
        empty when the workers share this process."""

    async def close(self) -> None:
        """Release the queue's connections and background tasks."""


class WorkerQueue(Protocol):
    """The workers' side: take jobs, store their results, and keep the durable state a successor rebuilds from."""

    async def fetch(self, queue_name: str, timeout: float) -> list[Job]:
        """The jobs queued under `queue_name` (= Job.queue_name; at least one unless `timeout` passed)."""

    async def complete(self, result: JobResult, job: Job | None = None, replay: bool = False) -> None:
        """Store a job's result, acknowledge the job and wake its waiters, all at once.

        With `job`, the job was executed in its model's seq order (its seq_id is recorded as the model's last);
        `replay` marks it as a state change to replay when the model is rebuilt. A result that already exists
        (a redelivered job) is kept. Raises LeaseLost if this worker lost its base model's lease."""

    async def recovery_state(self, model_id: str) -> RecoveryState | None:
        """Durable state of a model some worker already ran jobs for; None for a model new to the queue."""
        return None

    async def record_snapshot(self, model_id: str, seq_id: int, storage_key: str) -> str | None:
        """Record a durable snapshot of the model taken after `seq_id`; drops the replay log up to it.
        Returns the storage key of the snapshot it replaces (to delete), if any."""
        return None

    async def forget_model(self, model_id: str) -> list[str]:
        """Drop a released model's durable state (last seq_id, replay log, snapshot record); returns the storage
        keys of the snapshots it recorded, for the caller to delete. Raises LeaseLost without the lease."""
        return []

    async def health(self) -> Health:
        """Whether the queue answers; never raises."""

    async def close(self) -> None:
        """Release the queue's connections, background tasks and (Redis) leases."""
