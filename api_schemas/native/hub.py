"""Native API bodies for hub push: per-tenant hub tokens, push requests and their status, per-run auto-push."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from api_schemas.hub import Provider

REPO_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$"
PushState = Literal["queued", "running", "succeeded", "failed"]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class HubTokenRequest(_Request):
    token: SecretStr = Field(min_length=1, max_length=1024)


class HubTokenStatus(BaseModel):
    """Whether a token is stored; the token itself is never returned."""

    provider: Provider
    configured: bool
    updated_at: datetime | None = None


class PushRequest(_Request):
    tinker_path: str
    provider: Provider = "huggingface"
    repo_id: str = Field(pattern=REPO_ID_PATTERN)
    private: bool = True


class PushStatus(BaseModel):
    push_id: str
    status: PushState
    tinker_path: str
    provider: Provider
    repo_id: str
    private: bool
    trigger: Literal["request", "auto"]
    error: str | None = None
    url: str | None = None
    bytes_done: int | None = None  # the checkpoint's bytes uploaded so far (refreshed every few seconds while running)
    bytes_total: int | None = None  # the checkpoint's size; both null until the upload starts
    created_at: datetime
    finished_at: datetime | None = None


class AutoPushRequest(_Request):
    provider: Provider = "huggingface"
    repo_id: str = Field(pattern=REPO_ID_PATTERN)
    private: bool = True


class AutoPushStatus(BaseModel):
    """Push the run's newest checkpoint (sampler weights first) once its session finishes; `push_id` once it did."""

    training_run_id: str
    provider: Provider
    repo_id: str
    private: bool
    push_id: str | None = None
