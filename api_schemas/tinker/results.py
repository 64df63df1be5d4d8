"""The Tinker edge's answer to a finished job: a typed result (api_schemas/jobs.py) encoded as the SDK reads it.

Forward/backward outputs and samples are protobuf (`ForwardBackwardOutput`, `SampleResponse`), unless the client
asks for JSON only (older SDKs, e.g. 0.16.1: `Accept: application/json`, see `wants_json`), which gets their JSON
(api_schemas/tinker/json_batch.py); everything else is the JSON body of the SDK's response type.
A save's answer names the checkpoint as the Tinker edge knows it (its `tinker://` path, or the sampling session of an
ephemeral save), which the caller looks up.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass

from api_schemas.jobs import (
    ForwardBackwardResult,
    ModelReady,
    OptimStepResult,
    Output,
    Released,
    ResultKind,
    SampleResult,
    SaveResult,
    Skipped,
)
from api_schemas.tinker.json_batch import forward_backward_output_json, sample_response_json
from api_schemas.tinker.proto import encode_forward_backward_result, encode_sample_response

JSON, PROTOBUF = "application/json", "application/x-protobuf"
SAVE_TYPES = {"weights": "save_weights", "sampler_weights": "save_weights_for_sampler",
              "external_weights": "save_weights_external"}
# What an optim_step answers in `OptimStepResponse.metrics`: the SDK documents the field as "optimization step
# metrics" and names no key; clients (tinker-cookbook's loops) merge it into their own metric rows, where a counter
# such as the step number would overwrite their `step` column. So only the step's optimization metrics, never the
# engine's bookkeeping (its step count travels as `OptimStepResult.step`, for the native protocol).
OPTIM_STEP_METRICS = ("grad_norm", "grad_clip_coef", "learning_rate")


@dataclass(frozen=True)
class SavedAs:
    """Where a save's result points the client: a checkpoint path, or an ephemeral sampling session."""

    kind: str  # the checkpoint kind: weights | sampler_weights | external_weights
    path: str | None = None
    sampling_session_id: str | None = None


@functools.lru_cache(maxsize=64)  # clients send a handful of distinct Accept values, one per request
def wants_json(accept: str | None) -> bool:
    """Whether a retrieve_future's Accept header asks for JSON only. 0.38.0 sends `application/x-protobuf` for the
    results it reads as protobuf; 0.16.1 sends `application/json` for every result; a client that sends none (or
    `*/*`) keeps getting protobuf, as before."""
    if not accept:
        return False
    types = {part.split(";", 1)[0].strip().lower() for part in accept.split(",")}
    return "application/json" in types and not types & {PROTOBUF, "*/*", "application/*"}


def encode_result(kind: ResultKind, output: Output, saved: SavedAs | None = None,
                  json_only: bool = False) -> tuple[str, bytes]:
    """(media type, body) of a successful job's result; `json_only`: the client reads no protobuf."""
    if isinstance(output, ForwardBackwardResult):
        if json_only:
            outputs = output.datum_outputs()
            return JSON, json.dumps(forward_backward_output_json(outputs, output.metrics)).encode()
        return PROTOBUF, encode_forward_backward_result(output)
    if isinstance(output, SampleResult):
        if json_only:
            return JSON, json.dumps(sample_response_json(output)).encode()
        return PROTOBUF, encode_sample_response(output)
    body: dict[str, object]
    if isinstance(output, OptimStepResult):
        body = {"metrics": {k: output.metrics[k] for k in OPTIM_STEP_METRICS if k in output.metrics}}
    elif isinstance(output, ModelReady):
        body = {"model_id": output.model_id, "type": "load_weights" if kind is ResultKind.LOAD else "create_model"}
    elif isinstance(output, SaveResult):
        if saved is None:
            raise ValueError("a save's answer needs the checkpoint it wrote")
        where = ({"sampling_session_id": saved.sampling_session_id} if saved.sampling_session_id is not None
                 else {"path": saved.path})
        body = {**where, "type": SAVE_TYPES[saved.kind], "size_bytes": output.size_bytes}
    elif isinstance(output, Skipped):
        body = {"skipped": output.reason}
    elif isinstance(output, Released):
        body = {"released": output.model_id}
    else:  # pragma: no cover - Output is a closed union
        raise TypeError(f"no Tinker encoding for {type(output).__name__}")
    return JSON, json.dumps(body).encode()
