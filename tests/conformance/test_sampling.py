"""The stock SDK's SamplingClient against the embedded server: sessions, asample, compute_logprobs, immutability."""

from __future__ import annotations

import os

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.support.server import ServerProcess

PROMPT = [5, 17, 42, 99, 7, 23, 61]
# Sampler vs training forward on fp32: the torch sampler runs the trainer's own layers; vLLM its own kernels.
ATOL = 1e-3 if os.environ.get("TWINKLE_SAMPLER") == "vllm" else 1e-4


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def train(tc: tinker.TrainingClient, steps: int, lr: float = 2e-2) -> None:
    data = [datum([3, 8, 13, 21, 34, 55, 89, 144]), datum(PROMPT)]
    for _ in range(steps):
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=lr)).result()


def forward_logprobs(tc: tinker.TrainingClient, tokens: list[int]) -> np.ndarray:
    out = tc.forward([datum(tokens)], "cross_entropy").result()
    return np.asarray(out.loss_fn_outputs[0]["logprobs"].tolist(), dtype=np.float64)


def prompt_logprobs(sampler: tinker.SamplingClient, tokens: list[int]) -> np.ndarray:
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    assert lps[0] is None and len(lps) == len(tokens)
    return np.asarray(lps[1:], dtype=np.float64)


def test_base_model_sampling(server: ServerProcess) -> None:
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        sampler = sc.create_sampling_client(base_model=server.base_model).result()
        prompt = types.ModelInput.from_ints(PROMPT)
        greedy = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
        a = sampler.sample(prompt, 2, greedy).result()
        b = sampler.sample(prompt, 1, greedy).result()
        assert len(a.sequences) == 2 and len({s.sequence_id for s in a.sequences}) == 2
        assert a.sequences[0].tokens == a.sequences[1].tokens == b.sequences[0].tokens
        for seq in a.sequences:
            assert seq.stop_reason == "length" and len(seq.tokens) == 8
            assert seq.logprobs is not None and len(seq.logprobs) == 8 and all(lp <= 0 for lp in seq.logprobs)

        seeded = types.SamplingParams(max_tokens=12, temperature=1.0, seed=1234, stop=[])
        s1 = sampler.sample(prompt, 3, seeded).result()
        s2 = sampler.sample(prompt, 3, seeded).result()
        assert [s.tokens for s in s1.sequences] == [s.tokens for s in s2.sequences]
        assert len({tuple(s.tokens) for s in s1.sequences}) > 1  # the samples of one request differ

        stop_token = a.sequences[0].tokens[3]
        stopped = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[stop_token]))
        seq = stopped.result().sequences[0]
        assert seq.stop_reason == "stop" and seq.tokens[-1] == stop_token
        assert seq.tokens == a.sequences[0].tokens[: len(seq.tokens)]

        scored = sampler.sample(prompt, 1, greedy, include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
        assert scored.prompt_logprobs is not None and scored.prompt_logprobs[0] is None
        assert all(lp is not None and lp <= 0 for lp in scored.prompt_logprobs[1:])
        topk = scored.topk_prompt_logprobs
        assert topk is not None and topk[0] is None and all(len(row) == 3 for row in topk[1:])
        for row, lp in zip(topk[1:], scored.prompt_logprobs[1:]):
            assert row[0][1] >= lp - 1e-6  # the best token is at least as likely as the actual one


def test_compute_logprobs_match_training_forward(server: ServerProcess) -> None:
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = sc.create_lora_training_client(base_model=server.base_model, rank=8, seed=3).result()
        train(tc, 3)
        sampler = tc.save_weights_and_get_sampling_client().result()
        got = prompt_logprobs(sampler, PROMPT)
        want = forward_logprobs(tc, PROMPT)
        np.testing.assert_allclose(got, want, atol=ATOL)
        base = prompt_logprobs(sc.create_sampling_client(base_model=server.base_model).result(), PROMPT)
        assert np.abs(base - want).max() > 1e-2  # the adapter matters, and base sampling does not pick it up


def test_sampler_keeps_its_weights_after_newer_saves(server: ServerProcess) -> None:
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = sc.create_lora_training_client(base_model=server.base_model, rank=8, seed=4).result()
        train(tc, 2)
        path1 = tc.save_weights_for_sampler("v1").result().path
        old = tc.create_sampling_client(path1).result()
        first = prompt_logprobs(old, PROMPT)
        ephemeral = tc.save_weights_and_get_sampling_client().result()
        train(tc, 3)
        path2 = tc.save_weights_for_sampler("v2").result().path
        newer = prompt_logprobs(tc.create_sampling_client(path2).result(), PROMPT)
        assert np.abs(newer - first).max() > 1e-3
        np.testing.assert_allclose(prompt_logprobs(old, PROMPT), first, atol=1e-6)
        np.testing.assert_allclose(prompt_logprobs(ephemeral, PROMPT), first, atol=1e-6)
        fresh = sc.create_sampling_client(model_path=path1).result()
        np.testing.assert_allclose(prompt_logprobs(fresh, PROMPT), first, atol=1e-6)
        np.testing.assert_allclose(newer, forward_logprobs(tc, PROMPT), atol=1e-4)


def test_samplers_are_private_to_their_tenant(server: ServerProcess) -> None:
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = sc.create_lora_training_client(base_model=server.base_model, rank=4, seed=5).result()
        path = tc.save_weights_for_sampler("private").result().path
        sampler_id = tc.create_sampling_client(path).result()._sampling_session_id
    headers = {"X-API-Key": server.api_key_b}
    r = httpx.get(f"{server.base_url}/api/v1/samplers/{sampler_id}", headers=headers)
    assert r.status_code == 404, r.text
    r = httpx.get(f"{server.base_url}/api/v1/samplers/{sampler_id}", headers={"X-API-Key": server.api_key_a})
    assert r.status_code == 200 and r.json()["model_path"] == path
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_b) as sc_b, \
            pytest.raises(tinker.NotFoundError):
        sc_b.create_sampling_client(model_path=path).result()
    body = {"sampling_session_id": sampler_id, "seq_id": 0, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": 2, "temperature": 0}}
    assert httpx.post(f"{server.base_url}/api/v1/asample", json=body, headers=headers).status_code == 404


def test_bad_sample_requests_get_400(server: ServerProcess) -> None:
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        sampler = sc.create_sampling_client(base_model=server.base_model).result()
        sid = sampler._sampling_session_id
    base = {"sampling_session_id": sid, "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]}}
    headers = {"X-API-Key": server.api_key_a}
    bad = [
        {"sampling_params": {"max_tokens": 2, "temperature": -1}},
        {"sampling_params": {"max_tokens": 2, "top_p": 0}},
        {"sampling_params": {"max_tokens": 0}},
        {"sampling_params": {"max_tokens": 2}, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [10**6]}]}},
        {"sampling_params": {"max_tokens": 2}, "prompt": {"chunks": []}},
        {"sampling_params": {"max_tokens": 2, "stop": [10**6]}},
    ]
    for i, extra in enumerate(bad):
        r = httpx.post(f"{server.base_url}/api/v1/asample", json={**base, "seq_id": 100 + i, **extra}, headers=headers)
        assert r.status_code in (400, 422), (extra, r.status_code, r.text)
        assert r.json().get("detail")


def test_sample_is_deduplicated_on_seq_id(server: ServerProcess) -> None:
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        sid = sc.create_sampling_client(base_model=server.base_model).result()._sampling_session_id
    body = {"sampling_session_id": sid, "seq_id": 7, "num_samples": 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": 3, "temperature": 1.0}}
    headers = {"X-API-Key": server.api_key_a}
    first = httpx.post(f"{server.base_url}/api/v1/asample", json=body, headers=headers).json()
    again = httpx.post(f"{server.base_url}/api/v1/asample", json=body, headers=headers).json()
    assert first["request_id"] == again["request_id"]
    assert first["sample_sequence_ids"] == again["sample_sequence_ids"] and len(first["sample_sequence_ids"]) == 2


def test_a_sampler_refuses_weights_saved_again_under_its_name(server: ServerProcess) -> None:
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = sc.create_lora_training_client(base_model=server.base_model, rank=4, seed=6).result()
        train(tc, 1)
        path = tc.save_weights_for_sampler("same-name").result().path
        old = tc.create_sampling_client(path).result()
        before = prompt_logprobs(old, PROMPT)
        train(tc, 2)
        assert tc.save_weights_for_sampler("same-name").result().path == path
        with pytest.raises(tinker.BadRequestError, match="saved again"):
            old.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()
        after = prompt_logprobs(tc.create_sampling_client(path).result(), PROMPT)
        assert np.abs(after - before).max() > 1e-3
        np.testing.assert_allclose(after, forward_logprobs(tc, PROMPT), atol=1e-4)
