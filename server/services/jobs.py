"""The one place the gateway makes jobs: every Job is built, admitted, queued and remembered here.

A service decides what a job asks for (its payload) and for whom (tenant, base model, training model or sampling
session, seq_id); this module adds the rest: a fresh job id, the lane, the dedup key that makes a retry of a seq_id
get the first request's future back (a different payload under a used seq_id is a 400), the feed a sample joins
(retrieve_futures reads it), the admission policy (server/services/quotas.py: hold over a limit, or 429 for a
sample), and the recent-future cache retrieve_future reads first. Jobs are looked up through here too (owner,
state, result, cancel, the request at a seq_id): a job held by admission is not in the queue yet.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

from api_schemas.jobs import Job, JobResult, Lane, Payload, ResultKind, Sample, Skip
from api_schemas.tinker.types import UntypedFuture
from jobqueue import tracing
from jobqueue.base import DuplicateJobMismatch, JobInfo
from jobqueue.logs import REQUEST_ID
from server.db.models import ModelRow
from server.errors import BadRequest, DomainError
from server.services.context import Context

CLONE_BLOCK = 1_000_000_000  # the SDK numbers a cloned client's seq_ids in its own block of this size

Build = Callable[[], Awaitable[Payload]]


def seq_key(model_id: str, seq_id: int) -> str:
    """The dedup key of a model's (or a sampling session's) seq_id: one job per seq_id."""
    return f"{model_id}#{seq_id}"


def feed_name(tenant_id: str, sampling_session_id: str, cloned_sampler_id: int) -> str:
    """The queue feed a sample job joins so retrieve_futures reports it. The tenant is part of the name: another
    tenant polling the same session id reads an empty feed."""
    return f"{tenant_id}:{sampling_session_id}:{cloned_sampler_id}"


def new_job(*, tenant_id: str, base_model: str, model_id: str, seq_id: int, payload: Payload,
            lane: Lane = "train") -> Job:
    # the request's id, and with tracing on its span (traceparent) and the time now, follow the job to the worker
    return Job(job_id=str(uuid.uuid4()), tenant_id=tenant_id, base_model=base_model, lane=lane, model_id=model_id,
               seq_id=seq_id, payload=payload, request_id=REQUEST_ID.get(), **tracing.job_fields())


async def submit(ctx: Context, job: Job, dedup_key: str | None = None, feed: str | None = None,
                 future: bool = True) -> str:
    """Admit and queue `job`; its request id (the first job's, for a retry under the same dedup key). Raises
    RateLimited (a sample over a quota) and BadRequest (the dedup key was used for a different payload).
    `future`: a client will retrieve_future it (remembered as a recent future)."""
    try:
        request_id = await ctx.admission.admit(job, dedup_key, feed)
    except DuplicateJobMismatch as e:
        raise BadRequest(f"seq_id {job.seq_id} of {job.model_id} was already used for a different request") from e
    if request_id == job.job_id:  # queued now (not a retry of an older job)
        ctx.usage.queued(job)
        ctx.losses.queued(job)
        if future:
            ctx.recent.add(request_id, job.tenant_id, job.result_kind)
    return request_id


async def queue_train(ctx: Context, *, tenant_id: str, base_model: str, model_id: str, seq_id: int,
                      payload: Payload) -> str:
    """Queue one operation of a training model in its seq_id order, idempotent on (model_id, seq_id)."""
    job = new_job(tenant_id=tenant_id, base_model=base_model, model_id=model_id, seq_id=seq_id, payload=payload)
    return await submit(ctx, job, dedup_key=seq_key(model_id, seq_id))


async def queue_op(ctx: Context, tenant_id: str, model: ModelRow, seq_id: int, build: Build) -> UntypedFuture:
    """Run `build()` (validation + payload) and queue its job; on a user error queue a Skip for the seq_id (so the
    model's later operations are not held back waiting for it), then re-raise."""
    try:
        payload = await build()
    except DomainError as e:
        if e.status < 500:
            await queue_skip(ctx, tenant_id, model, seq_id, e.message)
        raise
    request_id = await queue_train(ctx, tenant_id=tenant_id, base_model=model.base_model, model_id=model.id,
                                   seq_id=seq_id, payload=payload)
    return UntypedFuture(request_id=request_id, model_id=model.id)


async def queue_skip(ctx: Context, tenant_id: str, model: ModelRow, seq_id: int, reason: str) -> None:
    try:
        await queue_train(ctx, tenant_id=tenant_id, base_model=model.base_model, model_id=model.id, seq_id=seq_id,
                          payload=Skip(reason=reason[:500]))
    except BadRequest:
        pass  # the seq_id already holds a real job (a bad retry of a good request): nothing to unblock


async def queue_sample(ctx: Context, *, tenant_id: str, base_model: str, sampler_id: str, seq_id: int,
                       payload: Sample) -> str:
    """Queue one sample of a sampling session in the sample lane, idempotent on (session, seq_id); it joins the
    feed of the (cloned) client that sent it. Not remembered as a recent future: retrieve_futures may drop its
    result once the client says it has it, and the queue then answers its retrieve_future with 404."""
    job = new_job(tenant_id=tenant_id, base_model=base_model, model_id=sampler_id, seq_id=seq_id, payload=payload,
                  lane="sample")
    feed = feed_name(tenant_id, sampler_id, seq_id // CLONE_BLOCK)
    return await submit(ctx, job, dedup_key=seq_key(sampler_id, seq_id), feed=feed, future=False)


async def queue_oneshot_sample(ctx: Context, *, tenant_id: str, base_model: str, payload: Sample) -> str:
    """Queue a sample no client seq_id names (an OpenAI chat completion, whose caller waits for it): nothing to
    deduplicate, no feed, no future."""
    job = new_job(tenant_id=tenant_id, base_model=base_model, model_id=f"openai:{tenant_id}", seq_id=0,
                  payload=payload, lane="sample")
    return await submit(ctx, job, future=False)


# --- looking jobs up (held ones included) ---
async def owner(ctx: Context, request_id: str) -> tuple[str, ResultKind] | None:
    """(tenant, result kind) of a job; None if unknown or expired."""
    hit = ctx.recent.get(request_id)  # queued here just now: known without asking the queue
    if hit is not None:
        return hit
    info = await ctx.admission.info(request_id)
    return (info.tenant_id, info.result_kind) if info is not None else None


async def info(ctx: Context, request_id: str) -> JobInfo | None:
    return await ctx.admission.info(request_id)


async def wait_result(ctx: Context, request_id: str, timeout: float) -> JobResult | None:
    result = await ctx.admission.wait_result(request_id, timeout)
    if result is not None and result.ok:
        ctx.usage.delivered(request_id, result)  # a sample's generated tokens count once delivered
        ctx.losses.delivered(request_id, result)  # a training step's loss, for the dashboard's curve
    return result


async def cancel(ctx: Context, request_id: str) -> bool:
    return await ctx.admission.cancel(request_id)


def paused_reason(ctx: Context, request_id: str) -> str | None:
    """Why admission holds a job (a quota), or None when it does not."""
    return ctx.admission.paused_reason(request_id)


async def request_at(ctx: Context, model_id: str, seq_id: int) -> str | None:
    """The request id queued (or held) under a model's seq_id, if it is still remembered."""
    return await ctx.admission.dedup_id(seq_key(model_id, seq_id))
