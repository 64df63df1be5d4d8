"""The JSON wire forms of older SDKs (0.16.1): a JSON forward_backward decodes to exactly what the same batch decodes
to from protobuf (one validation, one job); results are JSON only when the client asks for JSON only."""

from __future__ import annotations

import json

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from api_schemas.arrays import Array
from api_schemas.jobs import OptimStepResult, ResultKind, SampledSequence, SampleResult
from api_schemas.tinker.json_batch import (
    decode_json_forward_backward,
    forward_backward_output_json,
    parse_json_forward_backward,
)
from api_schemas.tinker.proto import ProtoDecodeError, decode_forward_backward
from api_schemas.tinker.results import JSON, PROTOBUF, encode_result, wants_json

TOKENS = [[5, 6, 7, 8], [9, 10, 11]]


def _json_body(**batch: object) -> bytes:
    """A forward_backward body as tinker 0.16.1 dumps it (exclude_unset: no chunk `type`)."""
    data = [{"model_input": {"chunks": [{"tokens": t[:2]}, {"tokens": t[2:], "type": "encoded_text"}]},
             "loss_fn_inputs": {"target_tokens": {"data": t[1:] + [1], "dtype": "int64", "shape": [len(t)]},
                                "weights": {"data": [0.5] * len(t), "dtype": "float32"}}} for t in TOKENS]
    return json.dumps({"model_id": "m", "seq_id": 3, "forward_backward_input": {
        "data": data, "loss_fn": "cross_entropy", "loss_fn_config": None, **batch}}).encode()


def test_a_json_batch_decodes_to_what_its_protobuf_decodes_to() -> None:
    datums = [types.Datum(model_input=types.ModelInput.from_ints(t),
                          loss_fn_inputs={"target_tokens": t[1:] + [1], "weights": [0.5] * len(t)}) for t in TOKENS]
    proto = forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=datums, loss_fn="cross_entropy"), model_id="m", seq_id=3))
    want = decode_forward_backward(proto)
    got = decode_json_forward_backward(parse_json_forward_backward(_json_body(), False), False)
    assert (got.model_id, got.seq_id, got.loss_fn, got.loss_fn_config, got.forward_only) == \
        (want.model_id, want.seq_id, want.loss_fn, want.loss_fn_config, want.forward_only)
    for g, w in zip(got.data, want.data, strict=True):
        assert g.tokens.dtype == w.tokens.dtype and np.array_equal(g.tokens, w.tokens)
        assert g.inputs.keys() == w.inputs.keys()
        for k in g.inputs:
            assert g.inputs[k].dtype == w.inputs[k].dtype and np.array_equal(g.inputs[k], w.inputs[k]), k


@pytest.mark.parametrize(("body", "message"), [
    (b"{}", "not a ForwardBackwardRequest"),
    (b'{"model_id": "m", "seq_id": 1}', "no forward_backward_input"),
    (b"\x00", "not a ForwardBackwardRequest"),
])
def test_malformed_json_bodies_are_refused_with_a_reason(body: bytes, message: str) -> None:
    with pytest.raises(ProtoDecodeError, match=message):
        parse_json_forward_backward(body, False)


@pytest.mark.parametrize(("datum", "message"), [
    ({"model_input": {"chunks": [{"type": "image", "data": "x", "format": "png"}]}}, "image chunks are not supported"),
    ({"model_input": {"chunks": [{"tokens": [1]}]},
      "loss_fn_inputs": {"target_tokens": {"data": [1.5], "dtype": "int64"}}}, "must be integers"),
    ({"model_input": {"chunks": [{"tokens": [1]}]},
      "loss_fn_inputs": {"weights": {"data": [1.0, 2.0], "dtype": "float32", "shape": [3]}}}, "do not fit shape"),
    ({"model_input": {"chunks": [{"tokens": [2**70]}]}}, "does not fit int64"),
])
def test_bad_json_datums_are_refused_with_a_reason(datum: dict[str, object], message: str) -> None:
    body = json.dumps({"model_id": "m", "seq_id": 1, "forward_input": {"data": [datum], "loss_fn": "cross_entropy"}})
    msg = parse_json_forward_backward(body.encode(), True)
    with pytest.raises(ProtoDecodeError, match=message):
        decode_json_forward_backward(msg, True)


@pytest.mark.parametrize(("accept", "json_only"), [
    (None, False), ("*/*", False), ("application/x-protobuf", False), ("application/json", True),
    ("application/json; charset=utf-8", True), ("application/json, application/x-protobuf", False),
    ("application/json, */*;q=0.1", False),
])
def test_results_are_json_only_for_clients_that_read_only_json(accept: str | None, json_only: bool) -> None:
    assert wants_json(accept) is json_only


def test_json_results_have_the_old_sdks_shapes() -> None:
    body = json.dumps(forward_backward_output_json([{"logprobs": np.array([-1.0, -2.0], dtype=np.float32)}],
                                                   {"loss:sum": 3.0}))
    assert json.loads(body) == {  # 0.16.1's ForwardBackwardOutput, TensorData outputs
        "loss_fn_output_type": "ArrayRecord", "metrics": {"loss:sum": 3.0},
        "loss_fn_outputs": [{"logprobs": {"data": [-1.0, -2.0], "dtype": "float32", "shape": [2]}}]}

    sample = SampleResult(sequences=(SampledSequence(tokens=(4, 5), logprobs=(-0.5, -0.25), stop_reason="length"),),
                          prompt_logprobs=Array.of(np.array([np.nan, -1.5], dtype=np.float32)),
                          topk_prompt_ids=Array.of(np.array([[0, 0], [7, 0]], dtype=np.int64)),
                          topk_prompt_logprobs=Array.of(np.array([[-99999.0, -99999.0], [-0.5, -99999.0]],
                                                                 dtype=np.float32)))
    assert encode_result(ResultKind.SAMPLE, sample)[0] == PROTOBUF
    media, raw = encode_result(ResultKind.SAMPLE, sample, json_only=True)
    parsed = json.loads(raw)
    assert media == JSON and parsed["sequences"] == [{"stop_reason": "length", "tokens": [4, 5],
                                                      "logprobs": [-0.5, -0.25]}]
    assert parsed["prompt_logprobs"] == [None, -1.5] and parsed["topk_prompt_logprobs"] == [None, [[7, -0.5]]]


def test_optim_step_answers_only_optimization_metrics() -> None:
    """The engine's own bookkeeping never reaches OptimStepResponse.metrics (a "step" key broke the cookbook's rows)."""
    out = OptimStepResult(metrics={"grad_norm": 2.5, "grad_clip_coef": 1.0, "learning_rate": 1e-3, "step": 7.0},
                          learning_rate=1e-3, step=7)
    media, raw = encode_result(ResultKind.OPTIM_STEP, out)
    assert media == JSON
    assert json.loads(raw) == {"metrics": {"grad_norm": 2.5, "grad_clip_coef": 1.0, "learning_rate": 1e-3}}
