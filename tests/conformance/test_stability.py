"""StableReinforce through the stock SDK: refused at the first request that reveals it (a sample asking for
stability records), with the loss's own reason; provenance spans on datums are decoded and checked, so an RL batch
that carries them (as tinker-cookbook's do) trains with the losses this server offers."""

from __future__ import annotations

import dataclasses

import pytest
import tinker
from tinker import types

from api_schemas.losses import LOSS_SPECS
from tests.support.server import ServerProcess

PROMPT = [5, 17, 42, 99]
REASON = LOSS_SPECS["stable_reinforce"].unsupported_reason
assert REASON is not None


def _datum(seq: types.SampledSequence, sequence_id: str) -> types.Datum:
    """The RL datum of one sample with its provenance, as tinker-cookbook's rl_loop.with_sampled_provenance."""
    tokens = PROMPT + seq.tokens
    n_prompt, n_sampled = len(PROMPT), len(seq.tokens)
    assert seq.logprobs is not None
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": [0.0] * (n_prompt - 1) + list(seq.logprobs),
                        "advantages": [0.0] * (n_prompt - 1) + [1.0] * n_sampled},
    )
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sequence_id, length=n_prompt),
                     types.SampledProvenanceSpan(sequence_id=sequence_id, length=n_sampled - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=n_prompt - 1),
                        types.SampledProvenanceSpan(sequence_id=sequence_id, length=n_sampled)],
    )


def test_stability_records_are_refused_at_the_first_sample(server: ServerProcess) -> None:
    params = types.SamplingParams(max_tokens=4, temperature=1.0, stop=[])
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = sc.create_lora_training_client(base_model=server.base_model, rank=4, seed=3).result()
        path = tc.save_weights_for_sampler("stab").result().path
        recording = tc.create_sampling_client(path, record_stability_info=True).result()
        with pytest.raises(tinker.BadRequestError, match="stable_reinforce is not supported") as e:
            recording.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
        assert REASON in str(e.value)
        # the same weights sample as usual without the records, and the loss itself is refused with the same words
        plain = tc.create_sampling_client(path).result()
        fut = plain.sample(types.ModelInput.from_ints(PROMPT), 2, params)
        seqs = fut.result().sequences
        assert len(seqs) == 2 and all(s.sequence_id for s in seqs)
        with pytest.raises(tinker.BadRequestError) as e:
            tc.forward_backward([_datum(seqs[0], seqs[0].sequence_id)], "stable_reinforce").result()
        assert REASON in str(e.value)


def test_provenance_spans_are_checked_and_train_with_offered_losses(server: ServerProcess) -> None:
    params = types.SamplingParams(max_tokens=4, temperature=1.0, stop=[])
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_b) as sc:
        tc = sc.create_lora_training_client(base_model=server.base_model, rank=4, seed=4).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        seqs = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result().sequences
        data = [_datum(s, s.sequence_id) for s in seqs]
        out = tc.forward_backward(data, "importance_sampling").result()
        assert len(out.loss_fn_outputs) == 2
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        # spans that do not tile target_tokens (with_provenance checks that client-side; a Datum built directly
        # does not) are a 400 naming the datum and the field
        good = data[0]
        assert good.loss_fn_input_spans is not None
        bad = dataclasses.replace(good, loss_fn_input_spans=good.loss_fn_input_spans[:1])
        with pytest.raises(tinker.BadRequestError, match=r"datum 0: loss_fn_input_spans cover \d+ positions"):
            tc.forward_backward([bad], "importance_sampling").result()
