"""tinker==0.16.1 (the SDK twinkle-kit 0.5.1 pins), unmodified, against the server: JSON forward / forward_backward
bodies, JSON results, save / load / sample / logprobs, tenants kept apart; plus what twinkle-kit's patch sends
(Bearer keys, twinkle:// paths, lora_config null). Run by scripts/test_sdk_compat.sh; skipped under other SDKs."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.support.server import ServerProcess

pytestmark = pytest.mark.skipif(tinker.__version__ != "0.16.1",
                                reason="older-SDK compatibility: scripts/test_sdk_compat.sh runs these with tinker 0.16.1")


def batch(seed: int = 0, n: int = 3) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(5, 200, size=10).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 9}))
    return out


def _post(srv: ServerProcess, path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{srv.base_url}/api/v1/{path}", json=body, headers=headers, timeout=60)


def test_sft_save_load_sample_logprobs(compat_server: ServerProcess) -> None:
    srv = compat_server
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key_a)  # type: ignore[attr-defined]
    tc = sc.create_lora_training_client(base_model=srv.base_model, rank=8, seed=1)
    data = batch()
    before = tc.forward(data, "cross_entropy").result()  # POST /forward, JSON ForwardRequest
    assert len(before.loss_fn_outputs) == 3 and before.loss_fn_outputs[0]["logprobs"].shape == [9]
    losses = []
    for _ in range(8):
        fb = tc.forward_backward(data, "cross_entropy")  # a JSON body
        opt = tc.optim_step(types.AdamParams(learning_rate=2e-2))
        out = fb.result()
        assert len(out.loss_fn_outputs) == 3 and out.loss_fn_outputs[0]["logprobs"].dtype == "float32"
        losses.append(out.metrics["loss:sum"])
        assert isinstance(opt.result().metrics, dict)
    assert losses[-1] < losses[0] * 0.8, losses
    assert abs(before.metrics["loss:sum"] - losses[0]) < 1e-3 * abs(losses[0])  # forward == the first step's loss
    logprobs = np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])
    assert np.isfinite(logprobs).all() and (logprobs <= 0).all()

    state = tc.save_state("compat-state").result().path
    assert state == f"tinker://{tc.model_id}/weights/compat-state"
    sampler_path = tc.save_weights_for_sampler("compat-sampler").result().path
    assert sampler_path == f"tinker://{tc.model_id}/sampler_weights/compat-sampler"

    sampling = sc.create_sampling_client(model_path=sampler_path)
    prompt = types.ModelInput.from_ints([5, 17, 42, 99])
    resp = sampling.sample(prompt=prompt, num_samples=2,
                           sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)).result()
    assert len(resp.sequences) == 2
    for seq in resp.sequences:
        assert 1 <= len(seq.tokens) <= 6 and seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        assert seq.stop_reason in ("stop", "length")
    lps = sampling.compute_logprobs(prompt).result()
    assert len(lps) == 4 and lps[0] is None and all(lp is not None and lp <= 0 for lp in lps[1:])
    with_topk = sampling.sample(prompt=prompt, num_samples=1, include_prompt_logprobs=True, topk_prompt_logprobs=2,
                                sampling_params=types.SamplingParams(max_tokens=1)).result()
    assert with_topk.topk_prompt_logprobs is not None and len(with_topk.topk_prompt_logprobs) == 4
    assert all(row is not None and len(row) == 2 for row in with_topk.topk_prompt_logprobs[1:])

    # the saved state comes back (weights and optimizer), here and as a new training client
    tc.load_state_with_optimizer(state).result()
    again = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    resumed = sc.create_training_client_from_state(state)
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(again, rel=1e-4)
    ephemeral = tc.save_weights_and_get_sampling_client()
    assert len(ephemeral.sample(prompt=prompt, num_samples=1,
                                sampling_params=types.SamplingParams(max_tokens=3)).result().sequences) == 1


def test_a_second_tenant_cannot_touch_the_first_tenants_model(compat_server: ServerProcess) -> None:
    srv = compat_server
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key_a)  # type: ignore[attr-defined]
    tc = sc.create_lora_training_client(base_model=srv.base_model, rank=4)
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=batch(1, 1), loss_fn="cross_entropy"),
        model_id=tc.model_id, seq_id=1)  # the model's first operation after its creation, as the SDK numbers it
    body = request.model_dump(exclude_unset=True, mode="json")  # what 0.16.1 sends
    a = {"X-API-Key": srv.api_key_a, "Accept": "application/json"}  # type: ignore[attr-defined]
    b = {"X-API-Key": srv.api_key_b, "Accept": "application/json"}  # type: ignore[attr-defined]
    assert _post(srv, "forward_backward", body, b).status_code == 404
    assert _post(srv, "forward", {**body, "forward_input": body["forward_backward_input"]}, b).status_code == 404
    assert _post(srv, "get_info", {"model_id": tc.model_id}, b).status_code == 404
    r = _post(srv, "forward_backward", body, a)
    assert r.status_code == 200, r.text
    request_id = r.json()["request_id"]
    assert _post(srv, "retrieve_future", {"request_id": request_id}, b).status_code == 404
    done = _post(srv, "retrieve_future", {"request_id": request_id, "allow_metadata_only": True}, a)
    while done.json().get("type") == "try_again":
        done = _post(srv, "retrieve_future", {"request_id": request_id}, a)
    assert done.headers["content-type"] == "application/json"
    out = types.ForwardBackwardOutput.model_validate(done.json())  # the SDK's own type reads it
    assert out.loss_fn_outputs[0]["logprobs"].shape == [9] and "loss:sum" in out.metrics


def test_what_twinkle_kit_adds_bearer_keys_twinkle_paths_full_training(compat_server: ServerProcess) -> None:
    srv = compat_server
    key = srv.api_key_a  # type: ignore[attr-defined]
    routing = {"x-request-id": "r-1", "X-Ray-Serve-Request-Id": "r-1", "serve_multiplexed_model_id": "r-1",
               "Serve-Multiplexed-Model-Id": "r-1"}
    for auth in ("Authorization", "Twinkle-Authorization"):
        r = _post(srv, "create_session", {"tags": [], "user_metadata": None, "sdk_version": "0.16.1"},
                  {auth: f"Bearer {key}", **routing})
        assert r.status_code == 200, r.text
    session = r.json()["session_id"]
    bearer = {"Authorization": f"Bearer {key}", **routing}
    r = _post(srv, "create_model", {"session_id": session, "model_seq_id": 0, "base_model": srv.base_model,
                                    "lora_config": None}, bearer)
    assert r.status_code == 400 and "full-parameter training is not enabled for base model" in r.json()["detail"], r.text
    assert _post(srv, "create_session", {"tags": []}, {"Authorization": "Bearer tml-wrong"}).status_code == 401

    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=key, default_headers=bearer)
    tc = sc.create_lora_training_client(base_model=srv.base_model, rank=4)
    path = tc.save_weights_for_sampler("twinkle-path").result().path
    state = tc.save_state("twinkle-state").result().path
    twinkle_state = state.replace("tinker://", "twinkle://")
    tc.load_state(twinkle_state).result()  # the same checkpoint under twinkle-kit's scheme
    r = _post(srv, "weights_info", {"tinker_path": twinkle_state}, bearer)
    assert r.status_code == 200 and r.json()["base_model"] == srv.base_model, r.text
    r = _post(srv, "create_sampling_session", {"session_id": session, "sampling_session_seq_id": 7,
                                               "model_path": path.replace("tinker://", "twinkle://")}, bearer)
    assert r.status_code == 200, r.text
