"""Provenance spans as the SDK writes them (tinker.proto.request_conv), decoded and checked by the gateway."""

from __future__ import annotations

import pytest
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from api_schemas.tinker.proto import ProtoDecodeError, decode_forward_backward
from api_schemas.tinker.provenance import ProvenanceError, Span, check_tiling, decode_provenance


def _request(datum: types.Datum) -> pb.ForwardBackwardRequest:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="importance_sampling"),
        model_id="m", seq_id=1)
    return forward_backward_request_to_proto(req)


def _datum() -> types.Datum:
    tokens = [5, 6, 7, 8, 9]
    d = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [0.0] * 4, "advantages": [1.0] * 4})
    return d.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="s:1:0", length=3),
                     types.SampledProvenanceSpan(sequence_id="s:1:0", length=1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="s:1:0", offset=1, length=2),
                        types.SampledProvenanceSpan(sequence_id="s:1:0", length=2)])


def test_spans_are_decoded_as_sent() -> None:
    decoded = decode_forward_backward(_request(_datum()))
    p = decoded.data[0].provenance
    assert p is not None and p.sequence_ids() == {"s:1:0"}
    assert p.model_input == (Span("prompt", "s:1:0", 0, 3), Span("sampled", "s:1:0", 0, 1))
    assert p.loss_fn_inputs == (Span("prompt", "s:1:0", 1, 2), Span("sampled", "s:1:0", 0, 2))
    check_tiling(p, 4, 4)
    with pytest.raises(ProvenanceError, match="loss_fn_input_spans cover 4 positions; the field has 5"):
        check_tiling(p, 4, 5)


def test_a_datum_without_spans_has_none() -> None:
    plain = types.Datum(model_input=types.ModelInput.from_ints([5, 6]),
                        loss_fn_inputs={"target_tokens": [6, 7], "weights": [1.0, 1.0]})
    assert decode_forward_backward(_request(plain)).data[0].provenance is None


def test_malformed_spans_are_refused() -> None:
    msg = _request(_datum())
    del msg.data[0].loss_fn_input_spans[:]
    with pytest.raises(ProtoDecodeError, match="datum 0: provenance comes as a pair"):
        decode_forward_backward(msg)
    d = pb.Datum()
    d.model_input_spans.add().prompt_tokens.length = 1
    d.loss_fn_input_spans.add().sampled_tokens.sequence_id = "x"
    with pytest.raises(ProvenanceError, match="empty sequence_id"):
        decode_provenance(d)
