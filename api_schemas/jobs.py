"""The gateway <-> worker contract: a Job goes down the queue, a JobResult comes back.

This is the engine-native contract: typed batches, optimizer steps, saves and samples going down, typed results
coming back. No client's wire format appears here; each edge of the gateway (Tinker, native, OpenAI) converts
its requests into these jobs and their results back, once. Jobs are frozen: once the gateway has validated and
queued one, nothing may change it. Arrays travel as bytes (api_schemas/arrays.py), base64 in JSON.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from enum import Enum
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import Field, TypeAdapter

from api_schemas.arrays import Array, Column, present
from api_schemas.custom_loss import CustomLossProgram
from api_schemas.training import SGD, Adam, AdamW, Frozen, LoraSpec, LRSchedule, Optimizer


class ErrorCategory(str, Enum):
    USER = "user"
    SERVER = "server"
    UNKNOWN = "unknown"


class CreateModel(Frozen):
    kind: Literal["create_model"] = "create_model"
    lora: LoraSpec | None  # None: a full-parameter run (a private trainable copy of the base model)
    optimizer: Literal["adamw"] = "adamw"


class ForwardBackward(Frozen):
    """A training batch: forward (and, unless forward_only, backward) of a model's datums under one loss.

    `rows`, `max_len` and `tokens` are computed once, by `build`, where the batch is made: quotas and the
    scheduler size a job from them without looking at its arrays."""

    kind: Literal["forward_backward"] = "forward_backward"
    forward_only: bool
    loss_fn: str  # a name of api_schemas/losses.py's table, or "custom" with `custom_loss`
    loss_config: dict[str, float | str] = Field(default_factory=dict)
    # loss_fn "custom": the checked graph its loss id names, resolved where the job was built (workers and replay
    # need no lookup, and a later change to the stored loss cannot change a queued job)
    custom_loss: CustomLossProgram | None = None
    model_input: Column  # int64 (n,) token ids per datum
    loss_inputs: dict[str, Column]  # the loss's inputs by name ("target_tokens" (n,) or (n, k), "weights", ...)
    rows: int
    max_len: int
    tokens: int
    # forward_only through the base model alone (the native protocol's `disable_lora` reference pass)
    base_only: bool = False

    @classmethod
    def build(cls, datums: Sequence[tuple[np.ndarray, Mapping[str, np.ndarray]]], **fields: Any) -> ForwardBackward:
        """The batch of `(tokens, loss inputs)` arrays, one per datum."""
        lengths = [len(tokens) for tokens, _ in datums]
        names = list(dict.fromkeys(k for _, inputs in datums for k in inputs))
        return cls(**fields, model_input=Column.of([tokens for tokens, _ in datums]),
                   loss_inputs={k: Column.of([inputs.get(k) for _, inputs in datums]) for k in names},
                   rows=len(lengths), max_len=max(lengths, default=0), tokens=sum(lengths))

    def datums(self) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """Each datum's (tokens, loss inputs), as read-only views."""
        columns = {k: c.arrays() for k, c in self.loss_inputs.items()}
        return [(t, present(columns, i)) for i, t in enumerate(self.model_input.arrays()) if t is not None]


class OptimStep(Frozen):
    kind: Literal["optim_step"] = "optim_step"
    optimizer: Optimizer
    schedule: LRSchedule | None = None  # None: the optimizer's learning_rate as it is
    # The accumulated gradients are multiplied by this before clipping and the update (the native protocol's
    # gradient accumulation divides a window's summed gradients by its token count).
    grad_scale: float = 1.0


class Gradients(Frozen):
    """The model's accumulated gradients without a step: their global norm (times `grad_scale`, as OptimStep would
    see them), or `clear` to drop them (the native protocol's clip_grad_norm and zero_grad)."""

    kind: Literal["gradients"] = "gradients"
    action: Literal["norm", "clear"]
    grad_scale: float = 1.0


class SaveWeights(Frozen):
    kind: Literal["save_weights"] = "save_weights"
    storage_key: str  # relative location inside the checkpoint store, minted by the gateway
    with_optimizer: bool  # weights + optimizer state (a resumable training checkpoint), or weights only
    max_bytes: int | None = None  # the tenant's storage quota left: a bigger checkpoint fails (category user)


class LoadWeights(Frozen):
    kind: Literal["load_weights"] = "load_weights"
    storage_key: str
    with_optimizer: bool
    create: bool  # True: the model slot is created by this load (create-via-load)
    full: bool = False  # a full-parameter run's checkpoint: a create takes a lease (server/services/full_param.py)


class Skip(Frozen):
    """Marks a seq_id as consumed without work (its request was rejected), so later ones are not held back."""

    kind: Literal["skip"] = "skip"
    reason: str


class ReleaseModel(Frozen):
    """Frees a model whose client session ended: its adapter leaves the worker and its recovery state the queue.

    Not part of the model's seq_id order: it runs once every job queued before it has run (its seq_id is
    RELEASE_SEQ). Jobs of the model that arrive afterwards fail at once."""

    kind: Literal["release_model"] = "release_model"
    reason: str


RELEASE_SEQ = -1  # Job.seq_id of a ReleaseModel


class WeightsRef(Frozen):
    """One immutable weight version a sampler serves: a PEFT adapter folder in the checkpoint store.

    `version` names the bytes, not the place: a sampler caches loaded adapters by it, so two saves never share one
    (a client keeps sampling the weights it was created from, even after newer saves).
    """

    storage_key: str
    version: str


class SampleParams(Frozen):
    """SamplingParams as the worker runs them; the gateway resolved every default."""

    max_tokens: int
    temperature: float  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()  # a sampled stop token is returned as the sequence's last token
    stop_at_eos: bool = True  # the model's EOS token(s) also stop; False only for `stop: []` (no stopping at all)


class Sample(Frozen):
    """Sampling or prompt scoring (lane "sample"); the result is a SampleResult."""

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
    CreateModel | ForwardBackward | OptimStep | Gradients | SaveWeights | LoadWeights | Skip | ReleaseModel | Sample,
    Field(discriminator="kind"),
]


Lane = Literal["train", "sample"]


def queue_name(base_model: str, lane: Lane) -> str:
    """Jobs travel in one queue per (base model, lane): sampling never waits behind a model's training order."""
    return f"{base_model}|{lane}"


def _unset(value: object) -> bool:
    return value is None


class Job(Frozen):
    job_id: str
    tenant_id: str
    base_model: str
    lane: Lane = "train"
    model_id: str
    seq_id: int  # per-model order; 0 for the model's first operation (create / create-via-load)
    payload: Payload
    # the HTTP request that queued it (jobqueue/logs.py): the worker's log lines about the job carry it too
    request_id: str | None = None
    # tracing (jobqueue/tracing.py), only when on and the request's span is sampled: the W3C traceparent of the
    # request's span and the wall-clock time (ns since the epoch) the job was made, the start of its wait span.
    # Left out of the JSON when unset: with tracing off a job's JSON is what it was before these fields.
    traceparent: str | None = Field(None, exclude_if=_unset)
    queued_at_ns: int | None = Field(None, exclude_if=_unset)

    @property
    def result_kind(self) -> ResultKind:
        return RESULT_KINDS[self.payload.kind]

    @property
    def queue_name(self) -> str:
        return queue_name(self.base_model, self.lane)

    def fingerprint(self) -> str:
        """Hash of what the job asks for (not of its id): a retry must carry the same one, whichever gateway process
        decodes it. Canonical JSON (keys sorted at every level): a protobuf map (a datum's loss_fn_inputs, the loss
        config) decodes in an order that differs from one process to the next."""
        canonical = json.dumps(self.payload.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


class JobError(Frozen):
    category: ErrorCategory
    message: str


class ResultKind(str, Enum):
    """What a job's result holds; an edge picks its client's encoding by it."""

    CREATE_MODEL = "create_model"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    GRADIENTS = "gradients"
    SAVE = "save"
    LOAD = "load"
    SAMPLE = "sample"
    SKIP = "skip"
    RELEASE = "release"


RESULT_KINDS: dict[str, ResultKind] = {
    "create_model": ResultKind.CREATE_MODEL, "forward_backward": ResultKind.FORWARD_BACKWARD,
    "optim_step": ResultKind.OPTIM_STEP, "gradients": ResultKind.GRADIENTS, "save_weights": ResultKind.SAVE,
    "load_weights": ResultKind.LOAD,
    "sample": ResultKind.SAMPLE, "skip": ResultKind.SKIP, "release_model": ResultKind.RELEASE,
}


class ModelReady(Frozen):
    """create_model and load_weights: the model holds its adapter (new, or loaded from a checkpoint)."""

    kind: Literal["model_ready"] = "model_ready"
    model_id: str
    # the adapter's parameters (PEFT names) and their shapes, as created (the native get_state_dict reads them)
    parameters: dict[str, tuple[int, ...]] | None = None


class ForwardBackwardResult(Frozen):
    kind: Literal["forward_backward"] = "forward_backward"
    outputs: dict[str, Column]  # per datum, in order: "logprobs" (+ "elementwise_loss", ...)
    metrics: dict[str, float]  # "name:reduction" keys; always "loss:sum"

    @classmethod
    def of(cls, outputs: Sequence[Mapping[str, np.ndarray]], metrics: Mapping[str, float]) -> ForwardBackwardResult:
        """From each datum's output arrays (every datum has the same names)."""
        names = list(outputs[0]) if outputs else []
        return cls(outputs={k: Column.of([o[k] for o in outputs]) for k in names}, metrics=dict(metrics))

    def datum_outputs(self) -> list[dict[str, np.ndarray]]:
        """Each datum's outputs, as read-only views."""
        columns = {k: c.arrays() for k, c in self.outputs.items()}
        count = max((len(a) for a in columns.values()), default=0)
        return [present(columns, i) for i in range(count)]


class OptimStepResult(Frozen):
    kind: Literal["optim_step"] = "optim_step"
    metrics: dict[str, float]
    learning_rate: float  # the rate the step used (after the schedule)
    step: int  # the model's optimizer steps so far, this one included


class GradientsResult(Frozen):
    kind: Literal["gradients"] = "gradients"
    grad_norm: float  # of the gradients before the action (0 when none were accumulated)


class SaveResult(Frozen):
    kind: Literal["save"] = "save"
    storage_key: str
    size_bytes: int


class SampledSequence(Frozen):
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    stop_reason: Literal["stop", "length"]
    topk_ids: Array | None = None  # (len(tokens), k) int64, only when topk_sample_logprobs > 0
    topk_logprobs: Array | None = None  # (len(tokens), k) float32


TOPK_EMPTY_LOGPROB = -99999.0  # the logprob of an empty top-k slot (its token id is 0)


class SampleResult(Frozen):
    kind: Literal["sample"] = "sample"
    sequences: tuple[SampledSequence, ...] = ()
    prompt_logprobs: Array | None = None  # (len(prompt),) float32, NaN where not scored
    topk_prompt_ids: Array | None = None  # (len(prompt), k) int64, 0 in empty slots
    topk_prompt_logprobs: Array | None = None  # (len(prompt), k) float32, TOPK_EMPTY_LOGPROB in empty slots
    prompt_cache_hit_tokens: int = 0


class Skipped(Frozen):
    kind: Literal["skipped"] = "skipped"
    reason: str


class Released(Frozen):
    kind: Literal["released"] = "released"
    model_id: str


Output = Annotated[
    ModelReady | ForwardBackwardResult | OptimStepResult | GradientsResult | SaveResult | SampleResult | Skipped
    | Released,
    Field(discriminator="kind"),
]
_OUTPUT: TypeAdapter[Output] = TypeAdapter(Output)


class JobResult(Frozen):
    """A job's outcome: its typed output, or an error. Queues carry the output as `body` (its JSON)."""

    job_id: str
    output: Output | None = None
    error: JobError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def body(self) -> bytes:
        return b"" if self.output is None else self.output.__pydantic_serializer__.to_json(self.output)

    @classmethod
    def from_body(cls, job_id: str, body: bytes) -> JobResult:
        return cls(job_id=job_id, output=_OUTPUT.validate_json(body) if body else None)


class JobState(str, Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
