"""One engine for both client families: a checkpoint trained natively is sampled and resumed with the stock tinker
SDK, one trained with the SDK is loaded and sampled natively (twinkle:// and tinker:// name the same files), and a
native and a Tinker tenant training at once get the gradients of their solo runs."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import tinker
from tinker import types

from tests.support.native_http import Native, rows, setup_adapter
from tests.support.server import ServerProcess


def datums(features: list[dict]) -> list[types.Datum]:
    """The Tinker form of native rows (what twinkle's input_feature_to_datum builds)."""
    out = []
    for f in features:
        labels = np.asarray(f["labels"])
        out.append(types.Datum(model_input=types.ModelInput.from_ints(f["input_ids"]),
                               loss_fn_inputs={"target_tokens": np.where(labels == -100, 0, labels).tolist(),
                                               "weights": (labels != -100).astype(np.float32).tolist()}))
    return out


def test_native_checkpoint_in_the_tinker_sdk(server: ServerProcess, a: Native) -> None:
    setup_adapter(a, gas=1)
    data = rows(seed=11, n=2)
    for _ in range(3):
        a.ok("forward_backward", inputs=data, adapter_name="default")
        a.ok("clip_grad_and_step", adapter_name="default")
    native_logps = a.ok("forward_only", inputs=data, adapter_name="default")["result"]["logps"]
    state = a.ok("save", name="for-tinker", save_optimizer=True, adapter_name="default")["twinkle_path"]
    sampler = a.ok("save", name="for-tinker-s", is_sampler=True, adapter_name="default")["twinkle_path"]
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = sc.create_training_client_from_state(state.replace("twinkle://", "tinker://", 1))
        out = tc.forward(datums(data), "cross_entropy").result()
        for got, want in zip(out.loss_fn_outputs, native_logps):
            np.testing.assert_allclose(got["logprobs"].to_numpy(), want, rtol=1e-5, atol=1e-6)
        scl = sc.create_sampling_client(model_path=sampler.replace("twinkle://", "tinker://", 1))
        prompt = types.ModelInput.from_ints(data[0]["input_ids"][:6])
        res = scl.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0))
        tinker_tokens = res.result().sequences[0].tokens
    r = a.http.post(f"/sampler/{a.model}/twinkle/sample", json={
        "inputs": [{"input_ids": data[0]["input_ids"][:6]}], "adapter_uri": sampler,
        "sampling_params": {"max_tokens": 4, "temperature": 0.0}})
    assert r.json()["samples"][0]["sequences"][0]["tokens"] == tinker_tokens  # one weight version, both clients


def test_tinker_checkpoint_in_the_native_client(server: ServerProcess, a: Native) -> None:
    data = rows(seed=12, n=2)
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = sc.create_lora_training_client(base_model=server.base_model, rank=8, seed=3)
        for _ in range(3):
            tc.forward_backward(datums(data), "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        tinker_logps = [o["logprobs"].to_numpy() for o in tc.forward(datums(data), "cross_entropy").result().loss_fn_outputs]
        path = tc.save_state("from-tinker").result().path
    lora = '{"r": 8, "target_modules": ["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj","lm_head"]}'
    a.ok("create")
    a.ok("add_adapter_to_model", adapter_name="t", config=lora)
    a.ok("resume_from_checkpoint", name=path.replace("tinker://", "twinkle://", 1), adapter_name="t")
    got = a.ok("forward_only", inputs=data, adapter_name="t")["result"]["logps"]
    for g, w in zip(got, tinker_logps):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def _native_step(c: Native, data: list[dict]) -> None:
    c.ok("forward_backward", inputs=data, adapter_name="m")
    c.ok("clip_grad_and_step", adapter_name="m", max_grad_norm=0.0)


def test_native_and_tinker_tenants_training_at_once_get_their_solo_gradients(server: ServerProcess) -> None:
    """Both start from saved states; a step taken concurrently (their batches may share a merged pass) leaves each
    exactly where its solo step does."""
    native_data, tinker_data = rows(seed=21, n=3), rows(seed=22, n=2)
    b = Native(server, server.api_key_b)
    lora = '{"r": 8, "lora_alpha": 32, "target_modules": "all-linear"}'
    b.ok("create")
    b.ok("add_adapter_to_model", adapter_name="m", config=lora)
    b.ok("set_loss", adapter_name="m", loss_cls="CrossEntropyLoss", reduction="sum")
    b.ok("set_optimizer", adapter_name="m", optimizer_cls="AdamW", lr=1e-2, weight_decay=0.0)
    native_start = b.ok("save", name="start", save_optimizer=True, adapter_name="m")["twinkle_path"]
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = sc.create_lora_training_client(base_model=server.base_model, rank=8, seed=5)
        tinker_start = tc.save_state("start").result().path

        def tinker_step() -> None:
            tc.forward_backward(datums(tinker_data), "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()

        def after() -> tuple[list, list]:
            n = b.ok("forward_only", inputs=native_data, adapter_name="m")["result"]["logps"]
            t = [o["logprobs"].to_numpy() for o in tc.forward(datums(tinker_data), "cross_entropy").result().loss_fn_outputs]
            return n, t

        _native_step(b, native_data)
        tinker_step()
        solo = after()
        for _ in range(3):  # a few tries: concurrency is what the scheduler makes of the two arrivals
            b.ok("load", name=native_start, load_optimizer=True, adapter_name="m")
            tc.load_state_with_optimizer(tinker_start).result()
            worker = threading.Thread(target=_native_step, args=(b, native_data))
            worker.start()
            tinker_step()
            worker.join()
            together = after()
            for got, want in zip(together[0] + together[1], solo[0] + solo[1]):
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
