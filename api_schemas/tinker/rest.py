"""Tinker API bodies of the RestClient side (SDK 0.38.0): training runs, checkpoints, external weights, sessions.

Field names and required-ness follow tinker/types/*.py of the pinned SDK; see reference/tinker-protocol.md sections
7 and 9. Requests ignore unknown fields; responses carry every field the SDK requires.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal, Union

from pydantic import Field

from api_schemas.tinker.types import NAME_PATTERN, SQL_INT_LIMIT, Request, Response

CheckpointType = Literal["training", "sampler", "external"]
SEGMENT_TYPES: dict[str, CheckpointType] = {"weights": "training", "sampler_weights": "sampler",
                                            "external_weights": "external"}


class Cursor(Response):
    offset: int
    limit: int
    total_count: int


class Checkpoint(Response):
    checkpoint_id: str  # "{segment}/{name}"
    checkpoint_type: CheckpointType
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None


class CheckpointsListResponse(Response):
    checkpoints: list[Checkpoint]
    cursor: Cursor | None = None


class TrainingRun(Response):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool = True
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: Checkpoint | None = None
    last_sampler_checkpoint: Checkpoint | None = None
    user_metadata: dict[str, str] | None = None


class TrainingRunsResponse(Response):
    training_runs: list[TrainingRun]
    cursor: Cursor


class SetTtlRequest(Request):
    ttl_seconds: int | None = None


class ExternalWeightsUrlsResponse(Response):
    urls: dict[str, str]
    expires: datetime


class WeightsInfoRequest(Request):
    tinker_path: str


class WeightsInfoResponse(Response):
    base_model: str
    is_lora: bool = True
    lora_rank: int | None = None
    optimizer_config: dict[str, Any] = Field(default_factory=lambda: {"type": "adamw"})
    train_unembed: bool | None = None
    train_mlp: bool | None = None
    train_attn: bool | None = None


class CopyWeightsRequest(Request):
    source_path: str
    destination_project_id: str | None = Field(None, max_length=128)
    session_id: str | None = None
    model_seq_id: int | None = Field(None, ge=0, lt=SQL_INT_LIMIT)
    ttl_seconds: int | None = None


class CopyWeightsResponse(Response):
    tinker_path: str


class SaveWeightsExternalRequest(Request):
    model_id: str
    seq_id: int = Field(ge=0)
    path: str = Field(pattern=NAME_PATTERN)
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = Field(None, max_length=10)


# --- sessions ---
class ListSessionsResponse(Response):
    sessions: list[str]


class GetSessionResponse(Response):
    training_run_ids: list[str]
    sampler_ids: list[str]
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None


class AssignProjectRequest(Request):
    project_id: str = Field(min_length=1, max_length=128)


class TraceExportResponse(Response):
    status: Literal["pending", "ready", "failed"]
    url: str | None = None
    error: str | None = None


class SearchOwner(Request):
    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[str] | None = Field(None, min_length=1, max_length=10)


class StatusQuery(Request):
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = Field(None, min_length=1)


class SearchCursor(Request):
    last_created_at: datetime
    last_session_id: str


class SessionSearchRequest(Request):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = Field(default_factory=dict)
    display_name: str | None = Field(None, min_length=1)
    owner: SearchOwner = Field(default_factory=SearchOwner)
    statuses: list[StatusQuery] | None = Field(None, min_length=1)
    limit: int = Field(50, ge=1, le=200)
    cursor: SearchCursor | None = None


class ActiveStatus(Response):
    type: Literal["active"] = "active"


class FinishReasonBody(Response):
    type: Literal["success", "errored", "interrupted"]


class ClientFinishedStatus(Response):
    type: Literal["client_finished"] = "client_finished"
    reason: FinishReasonBody
    detail: str | None = None


SessionStatus = Annotated[Union[ActiveStatus, ClientFinishedStatus], Field(discriminator="type")]


class SessionSummary(Response):
    session_id: str
    created_at: datetime
    owner: str
    project_id: str
    status: SessionStatus | None = None
    checkpoints_count: int
    display_name: str | None = None
    user_metadata: dict[str, str] | None = None
    checkpoint_storage_bytes: int | None = None


class SessionSearchResponse(Response):
    sessions: list[SessionSummary]
    next_cursor: dict[str, Any] | None = None  # {"last_created_at": aware datetime, "last_session_id": str}


class StorageUsage(Response):
    checkpoint_count: int
    size_bytes: int
    size_gigabytes: float
    project_id: str | None = None
    org_user_urn: str | None = None


class StorageUsageResponse(Response):
    data: list[StorageUsage]
