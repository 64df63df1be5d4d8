"""The JSON forward / forward_backward bodies of older tinker SDKs (0.16.1, which twinkle-kit 0.5.1 pins), and the
JSON results those SDKs parse.

0.16.1 posts `ForwardBackwardRequest` (`/forward_backward`) and `ForwardRequest` (`/forward`) as JSON: datums whose
`loss_fn_inputs` are `TensorData` dicts (`data` flat, `dtype` int64 | float32, `shape`) and whose `model_input` is a
list of chunks. The body is decoded here into the same `DecodedForwardBackward` the protobuf path produces
(api_schemas/tinker/proto.py), so both go through the same validation and the same engine-native job.
Those SDKs read every future's result as JSON: `ForwardBackwardOutput` with `TensorData` outputs, `SampleResponse`
with token / logprob lists.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api_schemas.jobs import TOPK_EMPTY_LOGPROB, SampleResult
from api_schemas.tinker.proto import DecodedDatum, DecodedForwardBackward, ProtoDecodeError

_DTYPES = {"int64": np.dtype(np.int64), "float32": np.dtype(np.float32)}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


class TensorData(_Request):
    data: list[int] | list[float]
    dtype: Literal["int64", "float32"]
    shape: list[int] | None = None


class Chunk(_Request):
    type: str = "encoded_text"  # the SDK leaves a default `type` out of the body (exclude_unset)
    tokens: list[int] | None = None


class ModelInput(_Request):
    chunks: list[Chunk] = Field(default_factory=list)


class JsonDatum(_Request):
    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = Field(default_factory=dict)


class BatchInput(_Request):
    data: list[JsonDatum]
    loss_fn: str
    loss_fn_config: dict[str, float | str] | None = None


class JsonForwardBackwardRequest(_Request):
    model_id: str
    seq_id: int = Field(ge=0)
    forward_backward_input: BatchInput | None = None  # POST /forward_backward
    forward_input: BatchInput | None = None  # POST /forward (0.16.1 has a route of its own for it)


def parse_json_forward_backward(raw: bytes, forward_only: bool) -> JsonForwardBackwardRequest:
    """The body, checked for its shape only (the model id and seq_id are needed before anything else)."""
    try:
        msg = JsonForwardBackwardRequest.model_validate_json(raw)
    except ValidationError as e:
        raise ProtoDecodeError(f"body is not a {'Forward' if forward_only else 'ForwardBackward'}Request: "
                               f"{e.errors(include_url=False)[:3]}") from e
    field = "forward_input" if forward_only else "forward_backward_input"
    if getattr(msg, field) is None:
        raise ProtoDecodeError(f"body has no {field}")
    return msg


def decode_json_forward_backward(msg: JsonForwardBackwardRequest, forward_only: bool) -> DecodedForwardBackward:
    batch = msg.forward_input if forward_only else msg.forward_backward_input
    assert batch is not None  # parse_json_forward_backward checked it
    data = []
    for i, d in enumerate(batch.data):
        parts = []
        for chunk in d.model_input.chunks:
            if chunk.type != "encoded_text" or chunk.tokens is None:
                raise ProtoDecodeError(f"datum {i}: {chunk.type} chunks are not supported by this text model")
            parts.append(_ints(f"datum {i}: model_input", chunk.tokens))
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        inputs = {k: decode_tensor(k, v) for k, v in d.loss_fn_inputs.items()}
        data.append(DecodedDatum(tokens=tokens, inputs=inputs))
    config = {k: (v if isinstance(v, str) else float(v)) for k, v in (batch.loss_fn_config or {}).items()}
    return DecodedForwardBackward(model_id=msg.model_id, seq_id=msg.seq_id, loss_fn=batch.loss_fn,
                                  loss_fn_config=config, forward_only=forward_only, data=data)


def decode_tensor(name: str, t: TensorData) -> np.ndarray:
    what = f"loss_fn_inputs[{name!r}]"
    if t.dtype == "int64":
        arr = _ints(what, t.data)
    else:
        arr = np.asarray(t.data, dtype=np.float64).astype(np.float32)  # Inf past float32's range: refused later
    if t.shape is not None:
        if any(s < 0 for s in t.shape):
            raise ProtoDecodeError(f"{what}: negative dimension in shape {t.shape}")
        if math.prod(t.shape) != arr.size:
            raise ProtoDecodeError(f"{what}: {arr.size} values do not fit shape {t.shape}")
        arr = arr.reshape(t.shape)
    return arr


def _ints(what: str, values: list[int] | list[float]) -> np.ndarray:
    if any(not isinstance(v, int) for v in values):
        raise ProtoDecodeError(f"{what}: int64 values must be integers")
    try:
        return np.asarray(values, dtype=np.int64)
    except OverflowError as e:
        raise ProtoDecodeError(f"{what}: a value does not fit int64") from e


# --- results, as the older SDKs parse them ---
def _tensor_json(a: np.ndarray) -> dict[str, Any]:
    is_int = np.issubdtype(a.dtype, np.integer)
    flat = a.astype(np.int64 if is_int else np.float32).reshape(-1)
    return {"data": flat.tolist(), "dtype": "int64" if is_int else "float32", "shape": list(a.shape)}


def forward_backward_output_json(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> dict[str, Any]:
    """`ForwardBackwardOutput` as JSON: one dict of TensorData per datum, in request order."""
    return {"loss_fn_output_type": "ArrayRecord",
            "loss_fn_outputs": [{name: _tensor_json(a) for name, a in o.items()} for o in outputs],
            "metrics": {k: float(v) for k, v in metrics.items()}}


def _finite_or_none(values: np.ndarray) -> list[float | None]:
    return [float(v) if math.isfinite(v) else None for v in values.astype(np.float64).tolist()]


def topk_json(ids: np.ndarray, lps: np.ndarray) -> list[list[tuple[int, float]] | None]:
    """Per prompt position its (id, logprob) pairs without the trailing empty slots, None for an all-empty one
    (what 0.38.0 makes of the protobuf's matrices)."""
    rows: list[list[tuple[int, float]] | None] = []
    for row_ids, row_lps in zip(ids.tolist(), lps.tolist(), strict=True):
        pairs = [(int(t), float(lp)) for t, lp in zip(row_ids, row_lps, strict=True)]
        while pairs and pairs[-1][0] == 0 and pairs[-1][1] == TOPK_EMPTY_LOGPROB:
            pairs.pop()
        rows.append(pairs or None)
    return rows


def sample_response_json(out: SampleResult) -> dict[str, Any]:
    """`SampleResponse` as JSON (0.16.1's fields: no per-sequence top-k)."""
    body: dict[str, Any] = {
        "type": "sample",
        "sequences": [{"stop_reason": s.stop_reason, "tokens": [int(t) for t in s.tokens],
                       "logprobs": [float(lp) for lp in s.logprobs]} for s in out.sequences],
    }
    if out.prompt_logprobs is not None:
        body["prompt_logprobs"] = _finite_or_none(out.prompt_logprobs.numpy())
    if out.topk_prompt_ids is not None and out.topk_prompt_logprobs is not None:
        body["topk_prompt_logprobs"] = topk_json(out.topk_prompt_ids.numpy(), out.topk_prompt_logprobs.numpy())
    return body
