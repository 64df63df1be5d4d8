"""Tinker API JSON request/response bodies, as SDK 0.38.0 sends and expects them (and 0.16.1: it sends some fields
as null that 0.38.0 leaves out).

Requests are tolerant (unknown fields ignored: a newer client may add some); responses carry what the SDK requires.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # checkpoint names: no "/", no "..", no spaces
SQL_INT_LIMIT = 2**31  # the seq ids a model or sampling session is created with are SQL INTEGERs (32 bits in Postgres)
# user_metadata of a session, model or checkpoint: entries, a key's characters, a value's (a string's own, else JSON)
MAX_METADATA_ITEMS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 64, 128, 1024


def _bounded(v: dict[str, Any] | None) -> dict[str, Any] | None:
    if v is None:
        return v
    if len(v) > MAX_METADATA_ITEMS:
        raise ValueError(f"user_metadata holds {len(v)} entries; the limit is {MAX_METADATA_ITEMS}")
    for k, value in v.items():
        if len(k) > MAX_METADATA_KEY:
            raise ValueError(f"user_metadata key of {len(k)} characters; the limit is {MAX_METADATA_KEY}")
        if len(value if isinstance(value, str) else json.dumps(value)) > MAX_METADATA_VALUE:
            raise ValueError(f"user_metadata[{k[:32]!r}] is longer than {MAX_METADATA_VALUE} characters")
    return v


Metadata = Annotated[dict[str, Any] | None, AfterValidator(_bounded)]
TextMetadata = Annotated[dict[str, str] | None, AfterValidator(_bounded)]


class Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class Response(BaseModel):
    model_config = ConfigDict(protected_namespaces=())


# --- bootstrap and sessions ---
class CreateSessionRequest(Request):
    tags: list[Annotated[str, Field(max_length=128)]] = Field(default_factory=list, max_length=64)
    user_metadata: Metadata = Field(default_factory=dict)  # older SDKs send null
    sdk_version: str | None = None
    project_id: str | None = Field(None, max_length=128)
    display_name: str | None = Field(None, max_length=256)


class CreateSessionResponse(Response):
    session_id: str
    type: Literal["create_session"] = "create_session"


class SessionHeartbeatRequest(Request):
    session_id: str


class FinishReason(Request):
    type: Literal["success", "errored", "interrupted"] = "success"


class FinishSessionRequest(Request):
    reason: FinishReason = Field(default_factory=FinishReason)
    detail: str | None = Field(None, max_length=2048)


# --- models ---
class LoraConfig(Request):
    rank: int = Field(32, ge=1)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(Request):
    type: str = "adamw"


class CreateModelRequest(Request):
    session_id: str
    model_seq_id: int = Field(ge=0, lt=SQL_INT_LIMIT)
    base_model: str
    user_metadata: Metadata = None
    lora_config: LoraConfig | None = Field(default_factory=LoraConfig)  # null: full-parameter (refused with a 400)
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)


class GetInfoRequest(Request):
    model_id: str


class ModelData(Response):
    arch: str | None = None
    model_name: str | None = None
    tokenizer_id: str | None = None


class GetInfoResponse(Response):
    model_id: str
    model_data: ModelData
    optimizer_config: dict[str, Any] = Field(default_factory=lambda: {"type": "adamw"})
    is_lora: bool = True
    lora_rank: int | None = None
    model_name: str | None = None
    type: Literal["get_info"] = "get_info"


class SupportedModel(Response):
    model_name: str
    max_context_length: int | None = None
    trainable: bool = True
    sampleable: bool = True


class ServerCapabilities(Response):
    supported_models: list[SupportedModel]


# --- training operations ---
class AdamParams(Request):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    @field_validator("*")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v


class OptimStepRequest(Request):
    model_id: str
    seq_id: int = Field(ge=0)
    adam_params: AdamParams | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsRequest(Request):
    model_id: str
    seq_id: int = Field(ge=0)
    path: str = Field(max_length=256)  # the checkpoint name; checked against NAME_PATTERN by the service
    ttl_seconds: int | None = None
    overwrite: bool = False
    user_metadata: TextMetadata = None


class SaveWeightsForSamplerRequest(Request):
    model_id: str
    seq_id: int = Field(ge=0)
    path: str | None = Field(None, max_length=256)
    sampling_session_seq_id: int | None = Field(None, ge=0, lt=SQL_INT_LIMIT)
    kind: str = "snapshot"
    ttl_seconds: int | None = None
    user_metadata: TextMetadata = None


class LoadWeightsRequest(Request):
    path: str
    optimizer: bool = False
    # create-via-load form
    session_id: str | None = None
    model_seq_id: int | None = Field(None, ge=0, lt=SQL_INT_LIMIT)
    base_model: str | None = None
    user_metadata: Metadata = None
    # legacy model-addressed form
    model_id: str | None = None
    seq_id: int | None = Field(None, ge=0)


# --- futures ---
class UntypedFuture(Response):
    request_id: str
    model_id: str | None = None


class RetrieveFutureRequest(Request):
    request_id: str
    allow_metadata_only: bool = False


class TryAgain(Response):
    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"] = "active"
    queue_state_reason: str | None = None


class FutureError(Response):
    error: str
    category: Literal["user", "server", "unknown"]
