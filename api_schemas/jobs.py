"""The gateway <-> worker contract: a Job goes down the queue, a JobResult comes back.

Jobs are frozen: once the gateway has validated and queued one, nothing may change it. Binary payloads
(the forward_backward protobuf) travel as bytes, base64 in JSON.
"""

from __future__ import annotations

import hashlib
from enum import Enum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from api_schemas.tinker.custom_loss import CustomLossProgram


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", ser_json_bytes="base64", val_json_bytes="base64")


class ErrorCategory(str, Enum):
    USER = "user"
    SERVER = "server"
    UNKNOWN = "unknown"


class LoraSpec(_Frozen):
    rank: int
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True


class AdamSpec(_Frozen):
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float


class CreateModel(_Frozen):
    kind: Literal["create_model"] = "create_model"
    lora: LoraSpec
    optimizer: Literal["adamw"] = "adamw"


class ForwardBackward(_Frozen):
    kind: Literal["forward_backward"] = "forward_backward"
    request_pb: bytes  # serialized (uncompressed) tinker_public.ForwardBackwardRequest, already validated
    forward_only: bool
    # loss_fn "custom": the checked graph its loss_id names, resolved by the gateway (workers and replay need no
    # lookup, and a later change to the stored loss cannot change a queued job)
    custom_loss: CustomLossProgram | None = None


class OptimStep(_Frozen):
    kind: Literal["optim_step"] = "optim_step"
    adam: AdamSpec


class SaveWeights(_Frozen):
    kind: Literal["save_weights"] = "save_weights"
    storage_key: str  # relative location inside the checkpoint store, minted by the gateway
    tinker_path: str
    with_optimizer: bool  # True for save_state (weights/), False for sampler_weights/
    sampling_session_id: str | None = None  # ephemeral sampler save: the result names this session, not a path
    max_bytes: int | None = None  # the tenant's storage quota left: a bigger checkpoint fails (category user)


class LoadWeights(_Frozen):
    kind: Literal["load_weights"] = "load_weights"
    storage_key: str
    with_optimizer: bool
    create: bool  # True: the model slot is created by this load (create-via-load)


class Skip(_Frozen):
    """Marks a seq_id as consumed without work (its request was rejected), so later ones are not held back."""

    kind: Literal["skip"] = "skip"
    reason: str


class ReleaseModel(_Frozen):
    """Frees a model whose client session ended: its adapter leaves the worker and its recovery state the queue.

    Not part of the model's seq_id order: it runs once every job queued before it has run (its seq_id is
    RELEASE_SEQ). Jobs of the model that arrive afterwards fail at once."""

    kind: Literal["release_model"] = "release_model"
    reason: str


RELEASE_SEQ = -1  # Job.seq_id of a ReleaseModel


class WeightsRef(_Frozen):
    """One immutable weight version a sampler serves: a PEFT adapter folder in the checkpoint store.

    `version` names the bytes, not the place: a sampler caches loaded adapters by it, so two saves never share one
    (a client keeps sampling the weights it was created from, even after newer saves).
    """

    storage_key: str
    version: str


class SampleParams(_Frozen):
    """SamplingParams as the worker runs them; the gateway resolved every default."""

    max_tokens: int
    temperature: float  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # a sampled stop token is returned as the sequence's last token
    stop_at_eos: bool = True  # the model's EOS token(s) also stop; False only for `stop: []` (no stopping at all)


class Sample(_Frozen):
    """asample / compute_logprobs (lane "sample"): the result body is a serialized tinker_public.SampleResponse."""

    kind: Literal["sample"] = "sample"
    prompt_tokens: tuple[int, ...]
    num_samples: int
    params: SampleParams
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    topk_sample_logprobs: int = 0
    weights: WeightsRef | None = None  # None = the base model alone


Payload = Annotated[
    CreateModel | ForwardBackward | OptimStep | SaveWeights | LoadWeights | Skip | ReleaseModel | Sample,
    Field(discriminator="kind"),
]


Lane = Literal["train", "sample"]


def queue_name(base_model: str, lane: Lane) -> str:
    """Jobs travel in one queue per (base model, lane): sampling never waits behind a model's training order."""
    return f"{base_model}|{lane}"


class Job(_Frozen):
    job_id: str
    tenant_id: str
    base_model: str
    lane: Lane = "train"
    model_id: str
    seq_id: int  # per-model order; 0 for the model's first operation (create / create-via-load)
    payload: Payload
    result_type: str  # tinker result type name, e.g. "ForwardBackwardOutput"; tells retrieve_future the media type

    @property
    def queue_name(self) -> str:
        return queue_name(self.base_model, self.lane)

    def fingerprint(self) -> str:
        """Hash of what the job asks for (not of its id): a retry must carry the same one."""
        return hashlib.sha256(self.payload.model_dump_json().encode()).hexdigest()


class JobError(_Frozen):
    category: ErrorCategory
    message: str


class JobResult(_Frozen):
    job_id: str
    media_type: Literal["application/json", "application/x-protobuf"] = "application/json"
    body: bytes = b""
    error: JobError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class JobState(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
