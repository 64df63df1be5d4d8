"""Tinker API sampling bodies (SDK 0.38.0): create_sampling_session, GET /samplers/{id}, asample.

Requests are tolerant (unknown fields ignored); `asample` answers with a future that also carries one
`sample_sequence_ids` entry per sample (the SDK asserts it).
"""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from api_schemas.tinker.types import SQL_INT_LIMIT


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class _Response(BaseModel):
    model_config = ConfigDict(protected_namespaces=())


class CreateSamplingSessionRequest(_Request):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0, lt=SQL_INT_LIMIT)
    base_model: str | None = None
    model_path: str | None = None


class CreateSamplingSessionResponse(_Response):
    sampling_session_id: str
    type: Literal["create_sampling_session"] = "create_sampling_session"


class GetSamplerResponse(_Response):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class PromptChunk(_Request):
    type: str = "encoded_text"
    tokens: list[int] = Field(default_factory=list)


class ModelInput(_Request):
    chunks: list[PromptChunk] = Field(default_factory=list)


class SamplingParams(_Request):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v


class SampleRequest(_Request):
    num_samples: int = 1
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


class SampleFuture(_Response):
    request_id: str
    sample_sequence_ids: list[str]
