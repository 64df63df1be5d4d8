"""Provenance spans of a Tinker datum (`Datum.with_provenance`, tinker 0.38): where each position came from.

The SDK attaches them for StableReinforce training (tinker-cookbook attaches them to every RL datum whose actions
were sampled with a sequence id): `model_input_spans` tile the input tokens, `loss_fn_input_spans` tile
`target_tokens`, each run naming a `SampledSequence.sequence_id` (this server's are `<sampling session>:<seq_id>:<i>`,
server/services/sampling.submit_sample) and a run of its prompt (`prompt`) or of its sampled tokens (`sampled`).
They are decoded and checked once, with the batch, and kept on the decoded request: no loss of this server reads
them yet (stable_reinforce, the one that would, is refused: api_schemas/losses.py), so they stop at the gateway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tinker.proto import tinker_public_pb2 as pb


@dataclass(frozen=True)
class Span:
    kind: Literal["prompt", "sampled"]
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class Provenance:
    model_input: tuple[Span, ...]  # tiles the datum's input tokens
    loss_fn_inputs: tuple[Span, ...]  # tiles its target_tokens

    def sequence_ids(self) -> set[str]:
        return {s.sequence_id for s in (*self.model_input, *self.loss_fn_inputs)}


class ProvenanceError(ValueError):
    """The spans do not describe the datum (the message says how)."""


def decode_provenance(d: pb.Datum) -> Provenance | None:
    """The datum's spans, or None when it has none; both lists or neither, as the SDK's Datum requires."""
    if not len(d.model_input_spans) and not len(d.loss_fn_input_spans):
        return None
    if not len(d.model_input_spans) or not len(d.loss_fn_input_spans):
        raise ProvenanceError("provenance comes as a pair: model_input_spans and loss_fn_input_spans, or neither")
    return Provenance(tuple(_span(s) for s in d.model_input_spans), tuple(_span(s) for s in d.loss_fn_input_spans))


def _span(s: pb.ProvenanceSpan) -> Span:
    which = s.WhichOneof("span")
    if which is None:
        raise ProvenanceError("a provenance span names neither prompt_tokens nor sampled_tokens")
    arm = s.prompt_tokens if which == "prompt_tokens" else s.sampled_tokens
    if not arm.sequence_id:
        raise ProvenanceError("a provenance span has an empty sequence_id")
    if arm.offset < 0 or arm.length < 0:
        raise ProvenanceError(f"a provenance span has offset {arm.offset} and length {arm.length}; both must be >= 0")
    return Span("prompt" if which == "prompt_tokens" else "sampled", arm.sequence_id, int(arm.offset), int(arm.length))


def check_tiling(p: Provenance, input_length: int, target_length: int) -> None:
    """The runs of each list must cover their field exactly (lengths summing to its length)."""
    for what, spans, n in (("model_input_spans", p.model_input, input_length),
                           ("loss_fn_input_spans", p.loss_fn_inputs, target_length)):
        total = sum(s.length for s in spans)
        if total != n:
            raise ProvenanceError(f"{what} cover {total} positions; the field has {n}")
