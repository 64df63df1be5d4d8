"""Tinker API bodies of session-level future polling (`retrieve_futures`) and `cancel_future`, as SDK 0.38.0
sends and expects them (tinker/types/futures_retrieve_*.py, future_completion.py)."""

from __future__ import annotations

from typing import Literal, Union

from pydantic import Field

from api_schemas.tinker.types import Request, Response


class SamplingSessionTarget(Request):
    type: Literal["sampling_session"] = "sampling_session"
    sampling_session_id: str = Field(max_length=256)
    cloned_sampler_id: int = Field(0, ge=0)  # seq_id // 1_000_000_000 of a cloned SamplingClient; 0 originally


class RetrieveFuturesRequest(Request):
    target: SamplingSessionTarget
    prev_cursor: int = Field(0, ge=0)  # events at or before it were seen and may be dropped
    timeout: float | None = Field(None, ge=0)  # None: long-poll; 0: answer at once (an ack-only poll)
    retrieved_request_ids: list[str] = Field(default_factory=list, max_length=100_000)


class FutureFinished(Response):
    state: Literal["finished"] = "finished"
    request_id: str
    response_payload_uncompressed_size: int | None = None


class FutureFailed(Response):
    state: Literal["failed"] = "failed"
    request_id: str


class RetrieveFuturesResponse(Response):
    completions: list[Union[FutureFinished, FutureFailed]]
    cursor: int


class CancelFutureRequest(Request):
    request_id: str


class CancelFutureResponse(Response):
    request_id: str
    cancelled: bool  # False: it already ran (or is running); its result stands
