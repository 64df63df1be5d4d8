"""SamplingParams on the vLLM sampler: stops, lengths, top-k tables, prompt-logprob windows, user errors, eviction."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from api_schemas.jobs import TOPK_EMPTY_LOGPROB, WeightsRef
from tests.vllm.conftest import MAX_LOADED, EngineHarness
from tests.vllm.helpers import PROMPT, decode, reference_greedy, reference_logprobs, save_adapter, spec, topk
from workers.sampling.base import SamplerUserError

pytestmark = pytest.mark.vllm


def _sample(engine: EngineHarness, **kw: object):  # type: ignore[no-untyped-def]
    return decode(engine.run(engine.sampler.sample(spec(**kw))))  # type: ignore[arg-type]


def test_stop_token_is_returned_with_reason_stop(engine: EngineHarness, vllm_model_dir: Path) -> None:
    greedy = reference_greedy(vllm_model_dir, None, PROMPT, 10)
    stop = greedy[3]
    cut = greedy.index(stop) + 1
    out = _sample(engine, max_tokens=10, stop_token_ids=(stop,))
    assert out.tokens[0] == greedy[:cut]
    assert out.stop_reasons == ["stop"]
    assert _sample(engine, max_tokens=10).stop_reasons == ["length"]


def test_stop_string_keeps_the_tokens_that_spell_it(engine: EngineHarness, vllm_model_dir: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(vllm_model_dir / "tokenizer.json"))
    greedy = reference_greedy(vllm_model_dir, None, PROMPT, 12)
    needle = tok.decode(greedy[4:6], skip_special_tokens=False).strip()[:3]
    assert needle, "the greedy continuation decodes to no text to stop on"
    cut = next(i for i in range(1, 7) if needle in tok.decode(greedy[:i], skip_special_tokens=False))
    out = _sample(engine, max_tokens=12, stop_strings=(needle,))
    assert out.tokens[0] == greedy[:cut]
    assert out.stop_reasons == ["stop"]


def test_full_context_ends_with_length(engine: EngineHarness) -> None:
    prompt = tuple(range(3, 253))  # 250 of the test engine's 256 positions
    out = _sample(engine, prompt=prompt, max_tokens=20)
    assert len(out.tokens[0]) == 6
    assert out.stop_reasons == ["length"]


def test_top_k_one_equals_greedy(engine: EngineHarness) -> None:
    greedy = _sample(engine, max_tokens=8).tokens[0]
    assert _sample(engine, max_tokens=8, temperature=1.0, top_k=1, seed=3).tokens[0] == greedy


def test_topk_sample_logprobs(engine: EngineHarness, vllm_model_dir: Path) -> None:
    out = _sample(engine, max_tokens=6, topk_sample_logprobs=5)
    ids, lps = topk(out.message.sequences[0].topk_sampled_logprobs)
    assert ids.shape == (6, 5)
    assert (np.diff(lps, axis=1) <= 1e-6).all()  # best first
    assert ids[:, 0].tolist() == out.tokens[0]  # greedy picks the best token ...
    np.testing.assert_allclose(lps[:, 0], out.logprobs[0], atol=1e-6)  # ... with its own logprob


def test_prompt_logprob_window_and_topk_prompt(engine: EngineHarness, vllm_model_dir: Path) -> None:
    n, last = len(PROMPT), 3
    out = _sample(engine, max_tokens=1, prompt_logprobs=True, topk_prompt_logprobs=4, prompt_logprobs_last_n=last)
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == n
    assert all(math.isnan(v) for v in out.prompt_logprobs[: n - last])
    expected = reference_logprobs(vllm_model_dir, None, PROMPT)
    np.testing.assert_allclose(out.prompt_logprobs[n - last :], expected[n - last :], atol=1e-3)
    ids, lps = topk(out.message.topk_prompt_logprobs)
    assert ids.shape == (n, 4)
    assert (ids[: n - last] == 0).all() and (lps[: n - last] == TOPK_EMPTY_LOGPROB).all()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(vllm_model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=torch.tensor([PROMPT])).logits[0], dim=-1)
    best = logp[:-1].topk(4, dim=-1)
    np.testing.assert_allclose(lps[n - last :], best.values[n - last - 1 :].numpy(), atol=1e-3)


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"prompt": (1, 2, 999)}, "prompt token ids"),
        ({"prompt": tuple(range(3, 300))}, "context"),
        ({"prompt": ()}, "empty"),
        ({"weights": WeightsRef(storage_key="tenant/run/sampler_weights/none", version="v:none")}, "gone"),
    ],
)
def test_user_errors(engine: EngineHarness, kw: dict[str, object], message: str) -> None:
    with pytest.raises(SamplerUserError, match=message):
        engine.run(engine.sampler.sample(spec(**kw)))  # type: ignore[arg-type]


def test_evicted_versions_reload_unless_overwritten(engine: EngineHarness, vllm_model_dir: Path) -> None:
    made = []
    for i in range(MAX_LOADED + 2):
        key = f"tenant/run/sampler_weights/evict-{i}"
        made.append((WeightsRef(storage_key=key, version=f"v:evict-{i}"), save_adapter(engine.store, vllm_model_dir, key, 50 + i)))
        _sample(engine, weights=made[-1][0], max_tokens=1)
    assert len(engine.sampler._loras) <= MAX_LOADED
    assert made[0][0].version not in engine.sampler._loras
    weights, folder = made[0]
    out = _sample(engine, weights=weights, max_tokens=1, prompt_logprobs=True)
    np.testing.assert_allclose(out.prompt_logprobs[1:], reference_logprobs(vllm_model_dir, folder, PROMPT)[1:], atol=1e-3)
    # once evicted, a version whose files were replaced by a later save cannot come back with other bytes
    weights, _ = made[1]
    assert weights.version not in engine.sampler._loras
    save_adapter(engine.store, vllm_model_dir, weights.storage_key, 99)
    with pytest.raises(SamplerUserError, match="overwritten"):
        engine.run(engine.sampler.sample(spec(weights, max_tokens=1)))


def test_adapter_that_does_not_fit_is_a_user_error_and_the_engine_goes_on(engine: EngineHarness, vllm_model_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    key = "tenant/run/sampler_weights/misfit"
    folder = save_adapter(engine.store, vllm_model_dir, key, 70)
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    name = next(k for k in tensors if k.endswith("q_proj.lora_A.weight"))
    tensors[name] = torch.zeros(tensors[name].shape[0], tensors[name].shape[1] + 3)  # wrong input width
    with engine.store.writing(key) as out:
        save_file(tensors, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text((folder / "adapter_config.json").read_text())
    with pytest.raises(SamplerUserError, match="cannot load"):
        engine.run(engine.sampler.sample(spec(WeightsRef(storage_key=key, version="v:misfit"), max_tokens=2)))
    assert _sample(engine, max_tokens=2).stop_reasons == ["length"]
