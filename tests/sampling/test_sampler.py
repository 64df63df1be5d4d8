"""The sampler contract (workers/sampling/base.py), run against every backend on the tiny model."""

from __future__ import annotations

import math

import numpy as np
import torch

from tests.sampling.conftest import PROMPTS, Rig, logprobs, spec, tokens
from workers.engine.multi_lora import Route, routed
from workers.sampling.base import SamplerBackend
from workers.sampling.select import Detokenizer


def training_logprobs(rig: Rig, adapter: str | None, prompt: list[int]) -> np.ndarray:
    """What the trainer's forward computes for these tokens (logprob of each next token)."""
    ids = torch.tensor([prompt])
    with torch.no_grad(), routed(rig.base.layers, [Route(adapter, 0, 1)]):
        logp = rig.base.logprob_logits(ids, torch.ones_like(ids))[0]
    return logp[:-1].gather(1, ids[0, 1:, None])[:, 0].numpy()


def test_prompt_logprobs_equal_training_forward(rig: Rig, backend: SamplerBackend, tol: float) -> None:
    weights = rig.adapter("lp", seed=1)
    for w, name in ((weights, "lp"), (None, None)):
        for prompt in PROMPTS:
            res = rig.run(backend, spec(prompt, w, max_tokens=1, prompt_logprobs=True))[0]
            got = np.frombuffer(res.prompt_logprobs, dtype="<f4")
            assert len(got) == len(prompt) and math.isnan(got[0])
            np.testing.assert_allclose(got[1:], training_logprobs(rig, name, prompt), atol=tol)


def test_greedy_is_deterministic_and_sampled_logprobs_are_the_models(rig: Rig, backend: SamplerBackend, tol: float) -> None:
    a, b = rig.run(backend, spec(PROMPTS[0], n=2, max_tokens=10), spec(PROMPTS[0], max_tokens=10))
    assert tokens(a.sequences[0]) == tokens(a.sequences[1]) == tokens(b.sequences[0])
    seq = a.sequences[0]
    assert seq.stop_reason == 1 and len(tokens(seq)) == 10  # length
    full = PROMPTS[0] + tokens(seq)
    np.testing.assert_allclose(logprobs(seq).numpy(), training_logprobs(rig, None, full)[len(PROMPTS[0]) - 1 :],
                               atol=tol)


def test_seed_reproduces_whatever_shares_the_batch(rig: Rig, backend: SamplerBackend) -> None:
    seeded = spec(PROMPTS[1], n=3, max_tokens=12, temperature=1.0, seed=77)
    alone = rig.run(backend, seeded)[0]
    crowded = rig.run(backend, spec(PROMPTS[0], n=4, max_tokens=20, temperature=1.0), seeded,
                      spec(PROMPTS[2], max_tokens=5, temperature=0.7))[1]
    assert [tokens(s) for s in alone.sequences] == [tokens(s) for s in crowded.sequences]
    assert len({tuple(tokens(s)) for s in alone.sequences}) == 3
    other = rig.run(backend, spec(PROMPTS[1], n=3, max_tokens=12, temperature=1.0, seed=78))[0]
    assert [tokens(s) for s in other.sequences] != [tokens(s) for s in alone.sequences]


def test_different_adapters_in_one_batch_match_solo_runs(rig: Rig, backend: SamplerBackend, tol: float) -> None:
    adapters = [rig.adapter(f"mix{i}", seed=10 + i) for i in range(3)] + [None]
    specs = [spec(PROMPTS[i % 3], w, max_tokens=12, prompt_logprobs=True) for i, w in enumerate(adapters)]
    solo = [rig.run(backend, s)[0] for s in specs]
    together = rig.run(backend, *specs, *specs)
    outputs = {tuple(tokens(r.sequences[0])) for r in solo}
    assert len(outputs) == len(adapters)  # each adapter really changes the output
    for i, r in enumerate(together):
        want = solo[i % len(specs)]
        assert tokens(r.sequences[0]) == tokens(want.sequences[0])
        np.testing.assert_allclose(logprobs(r.sequences[0]), logprobs(want.sequences[0]), atol=tol)
        np.testing.assert_allclose(np.frombuffer(r.prompt_logprobs, "<f4")[1:],
                                   np.frombuffer(want.prompt_logprobs, "<f4")[1:], atol=tol)


def test_stops_include_the_stop_token_or_string(rig: Rig, backend: SamplerBackend) -> None:
    free = tokens(rig.run(backend, spec(PROMPTS[2], max_tokens=12))[0].sequences[0])
    by_token = rig.run(backend, spec(PROMPTS[2], max_tokens=12, stop_token_ids=(free[4],)))[0].sequences[0]
    cut = free.index(free[4]) + 1
    assert by_token.stop_reason == 0 and tokens(by_token) == free[:cut]
    detok = Detokenizer(rig.folder)
    text = detok.decode(free)
    target = text[len(detok.decode(free[:5])) - 2 : len(detok.decode(free[:5]))]
    by_string = rig.run(backend, spec(PROMPTS[2], max_tokens=12, stop_strings=(target,)))[0].sequences[0]
    got = tokens(by_string)
    assert by_string.stop_reason == 0 and target in detok.decode(got) and target not in detok.decode(got[:-1])
    assert got == free[: len(got)]


def test_topk_prompt_logprobs_and_last_n(rig: Rig, backend: SamplerBackend) -> None:
    prompt = PROMPTS[1]
    res = rig.run(backend, spec(prompt, max_tokens=1, prompt_logprobs=True, topk_prompt_logprobs=3,
                                prompt_logprobs_last_n=2))[0]
    lps = np.frombuffer(res.prompt_logprobs, "<f4")
    assert np.isnan(lps[: len(prompt) - 2]).all() and not np.isnan(lps[-2:]).any()
    top = res.topk_prompt_logprobs
    assert (top.k, top.length) == (3, len(prompt))
    ids = np.frombuffer(top.token_ids, "<i4").reshape(len(prompt), 3)
    vals = np.frombuffer(top.logprobs, "<f4").reshape(len(prompt), 3)
    assert (vals[: len(prompt) - 2] == -99999.0).all() and (ids[: len(prompt) - 2] == 0).all()
    assert (np.diff(vals[-2:], axis=1) <= 0).all() and (vals[-2:, 0] >= lps[-2:] - 1e-6).all()


def test_the_vllm_sampler_is_sized_for_the_servers_max_rank(rig: Rig) -> None:
    """The factory passes the server's maximum LoRA rank on (vLLM rounds it up to a rank it supports); building the
    sampler does not import vllm, so this runs in the main suite."""
    from workers.sampling.factory import build_sampler
    from workers.sampling.vllm_sampler import VllmSampler

    for configured, sized in ((20, 32), (32, 32), (128, 128)):
        sampler = build_sampler("vllm", "tiny", rig.folder, rig.store, max_lora_rank=configured)
        assert isinstance(sampler, VllmSampler) and sampler.max_lora_rank == sized
