"""How an engine failure becomes a JobResult: user-caused errors get category `user`, anything else `server`."""

from __future__ import annotations

import logging

from api_schemas.jobs import ErrorCategory, Job, JobError, JobResult
from api_schemas.losses import LossSpecError
from workers.engine.adapter_pool import AdapterError
from workers.engine.optim import InvalidAdamParamsError, NonFiniteGradError

log = logging.getLogger(__name__)


class UserJobError(ValueError):
    """The job cannot run because of what the user sent; reported with category `user`."""


USER_ERRORS: tuple[type[Exception], ...] = (
    UserJobError, AdapterError, LossSpecError, NonFiniteGradError, InvalidAdamParamsError,
)


def failure(job: Job, exc: Exception) -> JobResult:
    """The failed result of `job`; a server fault is logged with its traceback and described only by its type."""
    if isinstance(exc, USER_ERRORS):
        log.info("job %s (%s) failed: %s", job.job_id, job.payload.kind, exc)
        return JobResult(job_id=job.job_id, error=JobError(category=ErrorCategory.USER, message=str(exc)))
    log.error("job %s (%s) crashed", job.job_id, job.payload.kind, exc_info=exc)
    msg = f"internal error while running {job.payload.kind}: {type(exc).__name__}"
    return JobResult(job_id=job.job_id, error=JobError(category=ErrorCategory.SERVER, message=msg))
