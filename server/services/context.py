"""What every service needs, built once in the app lifespan."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from api_schemas.hub import HubPusher
from api_schemas.jobs import Job, Payload
from api_schemas.models import ServedModel
from jobqueue.base import DuplicateJobMismatch, JobQueue
from jobqueue.storage import CheckpointStorage
from server.config import Settings
from server.db.database import Database
from server.db.models import ModelRow
from server.errors import BadRequest, NotFound
from server.services.secrets import Keyring

RECENT_FUTURE_SECONDS = 60.0  # well inside the queue's result TTL (>= 300 s, server/config.py)


@dataclass
class Context:
    settings: Settings
    db: Database
    queue: JobQueue
    models: dict[str, ServedModel]  # served base models by name
    storage: CheckpointStorage | None = None  # checkpoint files, shared with the workers (jobqueue/storage.py)
    keyring: Keyring | None = None  # signs download URLs, encrypts hub tokens (server/services/secrets.py)
    pusher: HubPusher | None = None  # runs one hub upload off the event loop; wired by deploy/ (None: no hub push)

    # model id -> its row (owner and LoRA shape never change): training ops skip one SQL round trip each
    model_rows: dict[str, ModelRow] = field(default_factory=dict)
    # request id -> (tenant, result type, until) of the futures this gateway just queued: their first
    # retrieve_future skips one queue round trip (see recent_future)
    _recent: dict[str, tuple[str, str, float]] = field(default_factory=dict)

    def served(self, base_model: str) -> ServedModel:
        model = self.models.get(base_model)
        if model is None:
            raise NotFound(f"base model {base_model!r} is not served here; available: {sorted(self.models)}")
        return model

    async def submit(
        self, *, tenant_id: str, base_model: str, model_id: str, seq_id: int, payload: Payload, result_type: str
    ) -> str:
        """Queue one job, idempotent on (model_id, seq_id): a retry gets the first request's id."""
        job = Job(
            job_id=str(uuid.uuid4()),
            tenant_id=tenant_id,
            base_model=base_model,
            model_id=model_id,
            seq_id=seq_id,
            payload=payload,
            result_type=result_type,
        )
        try:
            request_id = await self.queue.submit(job, dedup_key=f"{model_id}#{seq_id}")
        except DuplicateJobMismatch as e:
            raise BadRequest(f"seq_id {seq_id} of {model_id} was already used for a different request ({e})") from e
        if request_id == job.job_id:  # queued now (not a retry of an older job)
            now = time.monotonic()
            while self._recent:  # entries expire in insertion order: drop the expired ones from the front
                first = next(iter(self._recent))
                if self._recent[first][2] > now:
                    break
                del self._recent[first]
            self._recent[request_id] = (tenant_id, result_type, now + RECENT_FUTURE_SECONDS)
        return request_id

    def recent_future(self, request_id: str, delivered: bool = False) -> tuple[str, str] | None:
        """(tenant, result type) of a future queued here less than RECENT_FUTURE_SECONDS ago, else None (ask the
        queue). A queue keeps every job at least its result TTL (>= 300 s) after it was queued, so within that
        window the job exists and its owner and type are known without asking. `delivered` forgets it."""
        hit = self._recent.pop(request_id, None) if delivered else self._recent.get(request_id)
        if hit is None or hit[2] <= time.monotonic():
            return None
        return hit[0], hit[1]
