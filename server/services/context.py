"""What every service needs, built once in the app lifespan."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from api_schemas.hub import HubPusher
from api_schemas.jobs import ResultKind
from api_schemas.models import ServedModel
from jobqueue.base import GatewayQueue
from jobqueue.storage import CheckpointStorage
from server.config import Settings
from server.db.database import Database
from server.db.models import ModelRow
from server.errors import NotFound
from server.services.loss_history import LossHistory
from server.services.native.memory import NativeMemory
from server.services.quotas import Admission
from server.services.secrets import Keyring
from server.services.usage import UsageMeter

RECENT_FUTURE_SECONDS = 60.0  # well inside the queue's result TTL (>= 300 s, server/config.py)


class RecentFutures:
    """The futures this gateway just queued, with their owner and result kind: their first retrieve_future skips
    one queue round trip. A queue keeps every job at least its result TTL (>= 300 s) after it was queued, so within
    RECENT_FUTURE_SECONDS the job exists and its owner and kind are known without asking."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[str, ResultKind, float]] = {}  # request id -> (tenant, kind, until)

    def add(self, request_id: str, tenant_id: str, kind: ResultKind) -> None:
        now = time.monotonic()
        while self._entries:  # entries expire in insertion order: drop the expired ones from the front
            first = next(iter(self._entries))
            if self._entries[first][2] > now:
                break
            del self._entries[first]
        self._entries[request_id] = (tenant_id, kind, now + RECENT_FUTURE_SECONDS)

    def get(self, request_id: str, delivered: bool = False) -> tuple[str, ResultKind] | None:
        """(tenant, result kind) of a future queued here just now, else None (ask the queue). `delivered` forgets it."""
        hit = self._entries.pop(request_id, None) if delivered else self._entries.get(request_id)
        if hit is None or hit[2] <= time.monotonic():
            return None
        return hit[0], hit[1]


@dataclass
class Context:
    settings: Settings
    db: Database
    # Jobs are built, queued and looked up through server/services/jobs.py (it admits them through `admission`,
    # which alone knows the jobs it holds); the queue itself is used directly only for feeds and health.
    queue: GatewayQueue
    admission: Admission
    models: dict[str, ServedModel]  # served base models by name
    unavailable: dict[str, str] = field(default_factory=dict)  # models that failed to load and were left out: why
    storage: CheckpointStorage | None = None  # checkpoint files, shared with the workers (jobqueue/storage.py)
    keyring: Keyring | None = None  # signs download URLs, encrypts hub tokens (server/services/secrets.py)
    pusher: HubPusher | None = None  # runs one hub upload off the event loop; wired by deploy/ (None: no hub push)

    # model id -> its row (owner and LoRA shape never change): training ops skip one SQL round trip each
    model_rows: dict[str, ModelRow] = field(default_factory=dict)
    recent: RecentFutures = field(default_factory=RecentFutures)
    usage: UsageMeter = field(default_factory=UsageMeter)  # tokens per tenant until written to SQL (usage.py)
    losses: LossHistory = field(default_factory=LossHistory)  # per-run loss points for the dashboard (loss_history.py)
    native: NativeMemory = field(default_factory=NativeMemory)  # per-adapter locks of the native protocol

    def served(self, base_model: str) -> ServedModel:
        model = self.models.get(base_model)
        if model is None:
            raise NotFound(f"base model {base_model!r} is not served here; available: {sorted(self.models)}")
        return model
