"""The vLLM sampler against the training side: logprobs agree with transformers + PEFT, adapters stay apart.

Every test shares one engine (see conftest.py) and writes its adapters under its own storage keys and versions.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from api_schemas.jobs import WeightsRef
from tests.vllm.conftest import MAX_LORAS, EngineHarness
from tests.vllm.helpers import PROMPT, decode, reference_greedy, reference_logprobs, save_adapter, spec

pytestmark = pytest.mark.vllm

LONG_PROMPT = tuple(int(t) for t in np.random.default_rng(3).integers(3, 380, size=40))


def _weights(engine: EngineHarness, model_dir: Path, name: str, seed: int, **kw: bool) -> tuple[WeightsRef, Path]:
    key = f"tenant/run/sampler_weights/{name}"
    folder = save_adapter(engine.store, model_dir, key, seed, **kw)
    return WeightsRef(storage_key=key, version=f"v:{name}"), folder


def test_compute_logprobs_match_training_side(engine: EngineHarness, vllm_model_dir: Path) -> None:
    """compute_logprobs (prompt logprobs) equals transformers + PEFT within 1e-3, for adapters with and without a
    LoRA'd lm_head and the base model, all in one batch."""
    cases = [(None, None)]
    cases.append(_weights(engine, vllm_model_dir, "lp-a", 1))
    cases.append(_weights(engine, vllm_model_dir, "lp-b", 2, unembed=False))
    prompts = [LONG_PROMPT, PROMPT, LONG_PROMPT[:17]]

    async def score() -> list[bytes]:
        jobs = [
            engine.sampler.sample(spec(w, prompt=p, max_tokens=1, prompt_logprobs=True))
            for w, _ in cases
            for p in prompts
        ]
        return await asyncio.gather(*jobs)

    bodies = iter(engine.run(score()))
    for weights, folder in cases:
        for prompt in prompts:
            got = decode(next(bodies)).prompt_logprobs
            expected = reference_logprobs(vllm_model_dir, folder, prompt)
            assert got is not None and np.isnan(got[0])
            np.testing.assert_allclose(got[1:], expected[1:], atol=1e-3, err_msg=str(weights))
    # the adapters do change the scores (otherwise the comparison above proves little)
    base = reference_logprobs(vllm_model_dir, None, PROMPT)
    assert np.abs(reference_logprobs(vllm_model_dir, cases[1][1], PROMPT)[1:] - base[1:]).max() > 0.1


def test_greedy_is_deterministic_and_matches_training_side(engine: EngineHarness, vllm_model_dir: Path) -> None:
    weights, folder = _weights(engine, vllm_model_dir, "greedy", 3)
    first = decode(engine.run(engine.sampler.sample(spec(weights, max_tokens=10, num_samples=2))))
    again = decode(engine.run(engine.sampler.sample(spec(weights, max_tokens=10))))
    assert first.tokens[0] == first.tokens[1] == again.tokens[0]
    assert first.tokens[0] == reference_greedy(vllm_model_dir, folder, PROMPT, 10)
    assert first.stop_reasons == ["length", "length"]
    # each sampled token carries its logprob under the adapter's own distribution
    expected = reference_logprobs(vllm_model_dir, folder, PROMPT + tuple(first.tokens[0]))[len(PROMPT) :]
    np.testing.assert_allclose(first.logprobs[0], expected, atol=1e-3)


def test_seed_reproduces_and_samples_differ(engine: EngineHarness) -> None:
    def run(seed: int | None) -> list[list[int]]:
        job = spec(None, max_tokens=12, temperature=1.0, num_samples=3, seed=seed)
        return decode(engine.run(engine.sampler.sample(job))).tokens

    a, b, c = run(7), run(7), run(8)
    assert a == b
    assert a != c
    assert len({tuple(t) for t in a}) == 3  # the samples of one request are not copies of each other


def test_adapters_in_one_batch_give_their_own_outputs(engine: EngineHarness, vllm_model_dir: Path) -> None:
    made = [_weights(engine, vllm_model_dir, f"batch-{i}", 10 + i) for i in range(2)]

    async def together() -> list[bytes]:
        return await asyncio.gather(*[engine.sampler.sample(spec(w, max_tokens=8)) for w, _ in made])

    outputs = [decode(body).tokens[0] for body in engine.run(together())]
    for (weights, folder), tokens in zip(made, outputs):
        assert tokens == reference_greedy(vllm_model_dir, folder, PROMPT, 8), weights
    assert outputs[0] != outputs[1]


def test_base_requests_never_pick_up_an_adapter(engine: EngineHarness, vllm_model_dir: Path) -> None:
    """Base-model requests batched with enough adapter requests to fill every LoRA slot stay the base model's."""
    made = [_weights(engine, vllm_model_dir, f"slots-{i}", 20 + i) for i in range(MAX_LORAS + 1)]
    expected_tokens = reference_greedy(vllm_model_dir, None, PROMPT, 8)

    async def mixed() -> list[bytes]:
        jobs = [engine.sampler.sample(spec(w, max_tokens=8)) for w, _ in made for _ in range(2)]
        jobs += [engine.sampler.sample(spec(None, max_tokens=8, prompt_logprobs=True)) for _ in range(3)]
        return await asyncio.gather(*jobs)

    for _ in range(2):  # the second round starts with every slot already holding some adapter
        bodies = engine.run(mixed())
        for body in bodies[-3:]:
            base = decode(body)
            assert base.tokens[0] == expected_tokens
            np.testing.assert_allclose(
                base.prompt_logprobs[1:], reference_logprobs(vllm_model_dir, None, PROMPT)[1:], atol=1e-3
            )
            expected = reference_logprobs(vllm_model_dir, None, PROMPT + tuple(expected_tokens))[len(PROMPT) :]
            np.testing.assert_allclose(base.logprobs[0], expected, atol=1e-3)


def test_new_version_serves_new_weights_old_version_keeps_old(engine: EngineHarness, vllm_model_dir: Path) -> None:
    """A re-save to the same storage key is a new version: it serves the new bytes, the loaded old one the old."""
    key = "tenant/run/sampler_weights/rewritten"
    old_folder = save_adapter(engine.store, vllm_model_dir, key, 40)
    old_expected = reference_logprobs(vllm_model_dir, old_folder, LONG_PROMPT)
    old = WeightsRef(storage_key=key, version="v:rewritten:1")

    def score(weights: WeightsRef) -> np.ndarray:
        body = engine.run(engine.sampler.sample(spec(weights, prompt=LONG_PROMPT, max_tokens=1, prompt_logprobs=True)))
        result = decode(body).prompt_logprobs
        assert result is not None
        return result

    np.testing.assert_allclose(score(old)[1:], old_expected[1:], atol=1e-3)
    new_folder = save_adapter(engine.store, vllm_model_dir, key, 41)  # same key, new files
    new_expected = reference_logprobs(vllm_model_dir, new_folder, LONG_PROMPT)
    assert np.abs(new_expected[1:] - old_expected[1:]).max() > 0.1
    new = WeightsRef(storage_key=key, version="v:rewritten:2")
    np.testing.assert_allclose(score(new)[1:], new_expected[1:], atol=1e-3)
    np.testing.assert_allclose(score(old)[1:], old_expected[1:], atol=1e-3)
