"""The native (twinkle_client) protocol over plain HTTP, as that client sends it: sessions bound to the tenant, an SFT
loop with gradient accumulation through the model routes, saves that resume and sample, isolation, allow-lists.
(tests/native drives the same routes with the real, unmodified twinkle_client in its own venv.)"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from server.services.native import sampler_adapters
from tests.support.native_http import LORA, Native, rows, setup_adapter
from tests.support.server import ServerProcess


def test_sft_with_accumulation_save_resume_and_sample(a: Native) -> None:
    setup_adapter(a)
    data = rows()
    losses, norms = [], []
    for i in range(32):
        out = a.ok("forward_backward", inputs=data[:2] if i % 2 == 0 else data[2:], adapter_name="default")["result"]
        assert len(out["logps"]) == 2 and len(out["logps"][0]) == 12 and out["num_tokens"] == 14
        losses.append(out["loss"])
        norms.append(a.ok("clip_grad_and_step", adapter_name="default")["result"])
    assert norms[0::2] == ["None"] * 16  # inside the window of 2 backwards: no step
    assert all(float(n) > 0 for n in norms[1::2])
    assert np.mean(losses[-4:]) < 0.88 * np.mean(losses[:4]), losses
    metric = a.ok("calculate_metric", is_training=True, adapter_name="default")["result"]
    assert float(metric["loss"]) > 0 and metric["iters"] == 16 and "learning rate" in metric
    assert a.ok("calculate_metric", is_training=True, adapter_name="default")["result"].get("loss") is None  # reset
    configs = a.ok("get_train_configs", adapter_name="default")["result"]
    assert "r=8" in configs and "AdamW" in configs

    saved = a.ok("save", name="epoch 1", save_optimizer=True, consumed_train_samples=48, adapter_name="default")
    assert saved["checkpoint_dir"] is None and saved["twinkle_path"].endswith("/weights/epoch_1")
    path = saved["twinkle_path"]
    runs = a.http.get("/twinkle/training_runs").json()
    run = next(r for r in runs["training_runs"] if path.startswith(f"twinkle://{r['training_run_id']}/"))
    assert runs["cursor"]["total_count"] >= 1 and "tenant" in run["model_owner"]
    cks = a.http.get(f"/twinkle/training_runs/{run['training_run_id']}/checkpoints").json()["checkpoints"]
    assert [c["twinkle_path"] for c in cks] == [path] and cks[0]["checkpoint_type"] == "training"
    where = a.http.get(f"/twinkle/checkpoint_path/{run['training_run_id']}/weights/epoch_1").json()
    assert where == {"path": path, "twinkle_path": path}

    # a second adapter resumes: the same loss on the same batch, and the progress the save recorded
    setup_adapter(a, "resumed")
    progress = a.ok("resume_from_checkpoint", name=path, adapter_name="resumed")["result"]
    assert progress == {"cur_step": 32, "consumed_train_samples": 48, "gradient_accumulation_steps": 2}
    ref = a.ok("forward_only", inputs=data[:2], adapter_name="default")["result"]["loss"]
    again = a.ok("forward_only", inputs=data[:2], adapter_name="resumed")["result"]["loss"]
    assert again == pytest.approx(ref, rel=1e-5)

    sampler = a.ok("save", name="s", is_sampler=True, adapter_name="default")["twinkle_path"]
    r = a.http.post(f"/sampler/{a.model}/twinkle/sample", json={
        "inputs": [data[0]], "sampling_params": {"max_tokens": 5, "temperature": 0.0, "logprobs": 1},
        "adapter_name": "", "num_samples": 1, "adapter_uri": sampler})
    assert r.status_code == 200, r.text
    seq = r.json()["samples"][0]["sequences"][0]
    assert 1 <= len(seq["tokens"]) <= 5 and len(seq["logprobs"]) == len(seq["tokens"])
    assert seq["logprobs"][0][0][0] == seq["tokens"][0]
    feature = seq["new_input_feature"]
    assert feature["input_ids"] == data[0]["input_ids"] + seq["tokens"]
    assert feature["labels"][11:11 + len(seq["tokens"])] == seq["tokens"] and feature["messages"][-1]["role"] == "assistant"


def test_sessions_and_adapters_belong_to_their_tenant(server: ServerProcess, a: Native) -> None:
    setup_adapter(a, gas=1)
    a.ok("forward_backward", inputs=rows(n=1), adapter_name="default")
    path = a.ok("save", name="mine", adapter_name="default")["twinkle_path"]
    b = Native(server, server.api_key_b)
    b.http.headers["X-Twinkle-Session-Id"] = a.session  # B knows A's session id
    assert b.op("forward_backward", inputs=rows(n=1), adapter_name="default").status_code == 404
    assert b.http.post("/twinkle/session_heartbeat", json={"session_id": a.session}).status_code == 404
    b.http.headers["X-Twinkle-Session-Id"] = b.session
    setup_adapter(b, gas=1)
    for op, body in (("load", {"name": path}), ("resume_from_checkpoint", {"name": path})):
        r = b.op(op, adapter_name="default", **body)
        assert r.status_code == 404, (op, r.text)
    r = b.http.post(f"/sampler/{b.model}/twinkle/sample", json={"inputs": rows(n=1), "adapter_uri": path})
    assert r.status_code == 404
    run_id = path.split("/")[2]
    assert b.http.get(f"/twinkle/training_runs/{run_id}").status_code == 404
    assert b.http.delete(f"/twinkle/training_runs/{run_id}/checkpoints/weights/mine").status_code == 404
    bad = httpx.post(f"{server.base_url}/api/v1/twinkle/create_session", json={},
                     headers={"Authorization": "Bearer tml-wrong"})
    assert bad.status_code == 401 and "detail" in bad.json()


@pytest.mark.parametrize("op,body,accepted", [
    ("set_loss", {"loss_cls": "os.system"}, "CrossEntropyLoss"),
    ("set_optimizer", {"optimizer_cls": "NotAThing"}, "AdamW"),
    ("set_optimizer", {"optimizer_cls": "AdamW", "params": "x"}, "accepted arguments"),
    ("set_lr_scheduler", {"scheduler_cls": "ms://evil/plugin"}, "hub plugins"),
    ("apply_patch", {"patch_cls": "ms://twinkle-kit/qwen3_moe_transformers4_patch"}, "not offered"),
    ("add_metric", {"metric_cls": "builtins.eval"}, "LossMetric"),
    ("set_template", {"template_cls": "Template", "trust_remote_code": True}, "accepted arguments"),
    ("load", {"name": "/etc/passwd"}, "twinkle://"),
    ("forward_backward", {"inputs": [{"input_ids": [1, 2], "labels": [2]}]}, "labels"),
])
def test_allow_lists_and_paths_are_refused_by_name(a: Native, op: str, body: dict, accepted: str) -> None:
    setup_adapter(a, gas=1)
    r = a.op(op, adapter_name="default", **body)
    assert r.status_code == 400, r.text
    assert accepted in r.json()["detail"]


def test_lora_config_limits(a: Native) -> None:
    a.ok("create")
    for config, word in ((json.dumps({"r": 100000}), "r must be"), (json.dumps({"use_dora": True}), "use_dora"),
                         (json.dumps({"target_modules": ["embed_tokens"]}), "target_modules"),
                         (json.dumps({"lora_dropout": 0.95}), "lora_dropout"),
                         (json.dumps({"init_lora_weights": "pissa"}), "init_lora_weights"),
                         (json.dumps({"lora_bias": True}), "lora_bias"), (None, "full-parameter")):
        r = a.op("add_adapter_to_model", adapter_name="x", config=config)
        assert r.status_code == 400 and word in r.json()["detail"], r.text
    assert a.op("add_adapter_to_model", adapter_name="../x", config=LORA).status_code == 400


def test_dpo_against_the_base_model_reference(a: Native) -> None:
    setup_adapter(a, gas=1)
    a.ok("set_loss", loss_cls="DPOLoss", adapter_name="default", beta=0.5)
    a.ok("add_metric", metric_cls="DPOMetric", adapter_name="default", beta=0.5, is_training=True)
    pairs = rows(seed=4)  # (chosen, rejected), (chosen, rejected)
    ref = a.ok("forward_only", inputs=pairs, adapter_name="default", disable_lora=True)["result"]
    fresh = a.ok("forward_only", inputs=pairs, adapter_name="default")["result"]
    np.testing.assert_allclose(ref["logps"], fresh["logps"], rtol=1e-5, atol=1e-6)  # a new adapter is the base
    losses = []
    for _ in range(6):
        out = a.ok("forward_backward", inputs=pairs, adapter_name="default", ref_outputs=ref)["result"]
        losses.append(out["loss"])
        a.ok("clip_grad_and_step", adapter_name="default")
    assert losses[0] == pytest.approx(np.log(2), rel=1e-4)  # policy == reference: margin 0
    assert losses[-1] < losses[0]
    metric = a.ok("calculate_metric", is_training=True, adapter_name="default")["result"]
    assert metric["rewards/accuracies"].endswith("%") and float(metric["rewards/margins"]) > 0
    trained = a.ok("forward_only", inputs=pairs, adapter_name="default", disable_lora=True)["result"]
    np.testing.assert_allclose(trained["logps"], ref["logps"], rtol=1e-5, atol=1e-6)  # the base is untouched
    r = a.op("forward_backward", inputs=pairs[:3], adapter_name="default", ref_outputs=ref)
    assert r.status_code == 400 and "pairs" in r.json()["detail"]


def test_grpo_step_with_sampler_logprobs(a: Native) -> None:
    setup_adapter(a, gas=1)
    a.ok("set_loss", loss_cls="GRPOLoss", adapter_name="default", epsilon=0.2)
    a.ok("add_metric", metric_cls="GRPOMetric", adapter_name="default")
    prompt = {"input_ids": list(range(5, 13)), "labels": [-100] * 8}
    r = a.http.post(f"/sampler/{a.model}/twinkle/sample", json={
        "inputs": [prompt], "sampling_params": {"max_tokens": 6, "temperature": 1.0, "logprobs": 1, "seed": 3,
                                                "num_samples": 4}})
    assert r.status_code == 200, r.text
    seqs = r.json()["samples"][0]["sequences"]
    assert len(seqs) == 4
    features = [s["new_input_feature"] for s in seqs]
    old = [[lp[0][1] for lp in s["logprobs"]] for s in seqs]
    for f, o in zip(features, old):
        assert sum(t != -100 for t in f["labels"]) == len(o)  # one old logp per generated (label) token
    rewards = np.array([len(s["tokens"]) % 3 for s in seqs], dtype=float)
    adv = ((rewards - rewards.mean()) / (rewards.std() + 1e-6)).tolist()
    out = a.ok("forward_backward", inputs=features, adapter_name="default", advantages=adv, old_logps=old)["result"]
    assert np.isfinite(out["loss"]) and abs(out["loss"]) < 1e-3  # on-policy: ratio 1, advantages sum to ~0
    assert float(a.ok("clip_grad_and_step", adapter_name="default")["result"]) >= 0
    metric = a.ok("calculate_metric", is_training=True, adapter_name="default")["result"]
    assert abs(metric["train/logp_diff_mean"]) < 1e-3 and metric["train/approx_kl"] >= 0  # the sampler's logps
    r = a.op("forward_backward", inputs=features, adapter_name="default")
    assert r.status_code == 400 and "advantages" in r.json()["detail"]


def test_clip_grad_norm_then_step_equals_clip_grad_and_step(a: Native) -> None:
    setup_adapter(a, gas=1)
    batch = rows(seed=7, n=2)
    start = a.ok("save", name="start", save_optimizer=True, adapter_name="default")["twinkle_path"]
    a.ok("forward_backward", inputs=batch, adapter_name="default")
    joint = a.ok("clip_grad_and_step", max_grad_norm=0.05, adapter_name="default")["result"]
    after_joint = a.ok("forward_only", inputs=batch, adapter_name="default")["result"]["logps"]

    a.ok("load", name=start, load_optimizer=True, adapter_name="default")
    a.ok("forward_backward", inputs=batch, adapter_name="default")
    norm = a.ok("clip_grad_norm", max_grad_norm=0.05, adapter_name="default")["result"]
    assert isinstance(norm, str) and float(norm) == pytest.approx(float(joint), rel=1e-6)
    a.ok("step", adapter_name="default")
    a.ok("zero_grad", adapter_name="default")  # after a step: nothing left to drop
    a.ok("lr_step", adapter_name="default")
    split = a.ok("forward_only", inputs=batch, adapter_name="default")["result"]["logps"]
    np.testing.assert_allclose(split, after_joint, rtol=1e-6, atol=1e-7)

    # zero_grad drops a full window: the next step has nothing to apply
    a.ok("forward_backward", inputs=batch, adapter_name="default")
    a.ok("zero_grad", adapter_name="default")
    assert a.ok("clip_grad_and_step", adapter_name="default")["result"] == "None"
    np.testing.assert_allclose(a.ok("forward_only", inputs=batch, adapter_name="default")["result"]["logps"], split,
                               rtol=1e-6, atol=1e-7)


def test_lora_dropout_trains_and_evaluates_deterministically(a: Native) -> None:
    a.ok("create")
    a.ok("add_adapter_to_model", adapter_name="d", config=json.dumps({"r": 4, "lora_dropout": 0.2}))
    a.ok("set_optimizer", optimizer_cls="AdamW", adapter_name="d", lr=1e-2)
    batch = rows(seed=9, n=2)
    for _ in range(2):
        assert np.isfinite(a.ok("forward_backward", inputs=batch, adapter_name="d")["result"]["loss"])
        a.ok("clip_grad_and_step", adapter_name="d")
    first = a.ok("forward_only", inputs=batch, adapter_name="d")["result"]["logps"]
    assert a.ok("forward_only", inputs=batch, adapter_name="d")["result"]["logps"] == first  # no dropout in eval


def test_trajectory_inputs_are_encoded_with_the_served_template(a: Native) -> None:
    """A Trajectory trains like the InputFeature twinkle's Template makes of it (labels on the assistant turn)."""
    setup_adapter(a, gas=1)
    messages = [{"role": "user", "content": "who are you?"}, {"role": "assistant", "content": "I am Blinky."}]
    by_messages = a.ok("forward_only", inputs=[{"messages": messages}], adapter_name="default")["result"]
    assert by_messages["num_tokens"] > 0 and len(by_messages["logps"]) == 1
    r = a.op("forward_backward", inputs=[{"messages": [{"role": "assistant", "content": "x"}]}], adapter_name="default")
    assert r.status_code == 400 and "assistant" in r.json()["detail"]
    r = a.op("forward_backward", inputs=[{"text": "no messages"}], adapter_name="default")
    assert r.status_code == 400 and "Trajectory" in r.json()["detail"]
    assert a.http.post(f"/model/{a.model}/twinkle/forward_backward", json={"inputs": rows(n=1), "adapter_name": "default"},
                       headers={"X-Twinkle-Session-Id": ""}).status_code == 400


def test_sampler_scores_prompts_and_stops(a: Native) -> None:
    prompt = {"input_ids": list(range(5, 15)), "labels": [-100] * 10}
    r = a.http.post(f"/sampler/{a.model}/twinkle/sample", json={
        "inputs": [prompt], "sampling_params": {"max_tokens": 0, "prompt_logprobs": 1, "temperature": 0.0}})
    assert r.status_code == 200, r.text
    sample = r.json()["samples"][0]
    seq = sample["sequences"][0]
    assert seq["tokens"] == [] and seq["new_input_feature"]["input_ids"] == prompt["input_ids"]
    lps = sample["prompt_logprobs"]
    assert len(lps) == 10 and lps[0] is None and all(lp is not None and lp <= 0 for lp in lps[1:])
    greedy = a.http.post(f"/sampler/{a.model}/twinkle/sample", json={
        "inputs": [prompt], "sampling_params": {"max_tokens": 6, "temperature": 0.0}}).json()
    first = greedy["samples"][0]["sequences"][0]["tokens"][0]
    stopped = a.http.post(f"/sampler/{a.model}/twinkle/sample", json={
        "inputs": [prompt], "sampling_params": {"max_tokens": 6, "temperature": 0.0, "stop": [first]}}).json()
    seq = stopped["samples"][0]["sequences"][0]
    assert seq["tokens"] == [first] and seq["stop_reason"] == "stop"
    for params, word in (({"repetition_penalty": 1.2}, "repetition_penalty"), ({"best_of": 2}, "unknown"),
                         ({"num_samples": 0}, "num_samples")):
        bad = a.http.post(f"/sampler/{a.model}/twinkle/sample", json={"inputs": [prompt], "sampling_params": params})
        assert bad.status_code == 400 and word in bad.json()["detail"], bad.text


@pytest.mark.parametrize("loss_cls,kwargs", [("PPOLoss", {"loss_agg_mode": "token-mean"}), ("GSPOLoss", {}),
                                             ("CISPOLoss", {}), ("BNPOLoss", {}),
                                             ("DRGRPOLoss", {"max_completion_length": 32}),
                                             ("SAPOLoss", {"tau_pos": 1.0, "tau_neg": 1.05})])
def test_policy_loss_family_trains(a: Native, loss_cls: str, kwargs: dict) -> None:
    setup_adapter(a, gas=1)
    a.ok("set_loss", loss_cls=loss_cls, adapter_name="default", epsilon=0.2, **kwargs)
    feats = rows(seed=13, n=2)
    ref = a.ok("forward_only", inputs=feats, adapter_name="default")["result"]["logps"]
    old = [[lp for lp, t in zip(r, f["labels"]) if t != -100] for r, f in zip(ref, feats)]
    out = a.ok("forward_backward", inputs=feats, adapter_name="default", advantages=[1.0, -1.0], old_logps=old)
    assert np.isfinite(out["result"]["loss"])
    assert float(a.ok("clip_grad_and_step", adapter_name="default")["result"]) > 0
    refused = a.op("set_loss", loss_cls="NotALoss", adapter_name="default")
    assert refused.status_code == 400 and "GSPOLoss" in refused.json()["detail"]


@pytest.mark.parametrize("loss_cls,kwargs,reference", [("DPOLoss", {"loss_type": "ipo"}, True),
                                                      ("SimPOLoss", {}, False), ("CPOLoss", {}, False),
                                                      ("ORPOLoss", {}, False)])
def test_preference_family_trains(a: Native, loss_cls: str, kwargs: dict, reference: bool) -> None:
    setup_adapter(a, gas=1)
    a.ok("set_loss", loss_cls=loss_cls, adapter_name="default", **kwargs)
    pairs = rows(seed=17)
    extra = {"ref_outputs": a.ok("forward_only", inputs=pairs, adapter_name="default", disable_lora=True)["result"]
             } if reference else {}
    losses = []
    for _ in range(4):
        losses.append(a.ok("forward_backward", inputs=pairs, adapter_name="default", **extra)["result"]["loss"])
        a.ok("clip_grad_and_step", adapter_name="default")
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses


def _sample(c: Native, body: dict, model: str | None = None) -> httpx.Response:
    return c.http.post(f"/sampler/{model or c.model}/twinkle/sample", json=body)


def _add_to_sampler(c: Native, name: object, config: object, **kw: object) -> httpx.Response:
    return c.http.post(f"/sampler/{c.model}/twinkle/add_adapter_to_sampler",
                       json={"adapter_name": name, "config": config, **kw})


# a LoraConfig's __dict__ as plain JSON (what the client sends once the set and the LoraRuntimeConfig object are
# made JSON): the keys of another peft version are ignored, the ones that change the adapter are read
PEFT_DICT = {"task_type": "CAUSAL_LM", "peft_type": "LORA", "auto_mapping": None, "peft_version": "0.19.0",
             "base_model_name_or_path": None, "revision": None, "inference_mode": False, "r": 4,
             "target_modules": ["q_proj", "v_proj"], "exclude_modules": None, "lora_alpha": 16, "lora_dropout": 0.05,
             "fan_in_fan_out": False, "bias": "none", "use_rslora": False, "modules_to_save": None,
             "init_lora_weights": True, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
             "alpha_pattern": {}, "megatron_config": None, "megatron_core": "megatron.core", "loftq_config": {},
             "eva_config": None, "corda_config": None, "use_dora": False, "use_qalora": False,
             "qalora_group_size": 16, "layer_replication": None, "runtime_config": {"ephemeral_gpu_offload": False},
             "lora_bias": False, "target_parameters": None, "trainable_token_indices": None,
             "alora_invocation_tokens": None, "some_future_key": [1, 2]}


def test_sampler_adapters_sample_the_base_model(a: Native) -> None:
    """add_adapter_to_sampler makes a LoRA slot of the session with no weights (the protocol's weight sync is not
    offered): sampling with its name is sampling the base model, greedy and seeded alike."""
    assert a.http.post(f"/sampler/{a.model}/twinkle/create", json={}).status_code == 200
    r = _add_to_sampler(a, "a", {"r": 8, "target_modules": "all-linear"})
    assert r.status_code == 200 and r.json() == {"status": "ok", "adapter_name": "a"}, r.text
    r = _add_to_sampler(a, "peft", PEFT_DICT)
    assert r.status_code == 200 and r.json()["adapter_name"] == "peft", r.text
    assert _add_to_sampler(a, "peft", json.dumps({**PEFT_DICT, "r": 2})).status_code == 200  # again: replaced
    prompt = {"input_ids": list(range(5, 17)), "labels": [-100] * 12}
    for params in ({"max_tokens": 6, "temperature": 0.0, "logprobs": 1, "prompt_logprobs": 1},
                   {"max_tokens": 6, "temperature": 1.0, "seed": 7, "logprobs": 2, "num_samples": 2}):
        base = _sample(a, {"inputs": [prompt], "sampling_params": params, "adapter_name": ""})
        assert base.status_code == 200, base.text
        want = base.json()["samples"][0]
        for name in ("a", "peft"):
            r = _sample(a, {"inputs": [prompt], "sampling_params": params, "adapter_name": name, "num_samples": 1})
            assert r.status_code == 200, r.text
            got = r.json()["samples"][0]
            assert [s["tokens"] for s in got["sequences"]] == [s["tokens"] for s in want["sequences"]]
            for g, w in zip(got["sequences"], want["sequences"]):
                assert np.allclose([[lp for _, lp in t] for t in g["logprobs"]],
                                   [[lp for _, lp in t] for t in w["logprobs"]], atol=1e-5)
                assert [[i for i, _ in t] for t in g["logprobs"]] == [[i for i, _ in t] for t in w["logprobs"]]
            if want["prompt_logprobs"] is not None:
                assert np.allclose(got["prompt_logprobs"][1:], want["prompt_logprobs"][1:], atol=1e-5)


def test_sampler_adapter_names_and_configs_are_checked(a: Native) -> None:
    for config, word in (({"r": 100000}, "r must be"), ({"use_dora": True}, "use_dora"),
                         ({"target_modules": ["embed_tokens"]}, "target_modules"),
                         ({"lora_dropout": 0.95}, "lora_dropout"),
                         ({"init_lora_weights": "pissa"}, "init_lora_weights"),
                         ({"peft_type": "IA3"}, "peft_type"), ("{not json", "not valid JSON"), ([8], "LoraConfig"),
                         (None, "config is required")):
        r = _add_to_sampler(a, "x", config)
        assert r.status_code == 400 and word in r.json()["detail"], (config, r.text)
    for name in ("../x", "", "x" * 65, 5, None):
        r = _add_to_sampler(a, name, {"r": 2})
        assert r.status_code == 400 and "adapter_name" in r.json()["detail"], (name, r.text)
    r = _add_to_sampler(a, "x", {"r": 2}, save_dir="/tmp/evil")
    assert r.status_code == 400 and "save_dir" in r.json()["detail"]
    r = a.http.post(f"/sampler/{a.model}/twinkle/add_adapter_to_sampler", json={"adapter_name": "x", "config": {}},
                    headers={"X-Twinkle-Session-Id": ""})
    assert r.status_code == 400 and "X-Twinkle-Session-Id" in r.json()["detail"]
    assert _add_to_sampler(a, "x", {}).status_code == 200  # every key has a default
    r = a.http.post("/sampler/no-such-model/twinkle/add_adapter_to_sampler", json={"adapter_name": "x", "config": {}})
    assert r.status_code == 404

    prompt = {"input_ids": [5, 6, 7]}
    r = _sample(a, {"inputs": [prompt], "adapter_name": "never-added"})
    assert r.status_code == 404 and "add_adapter_to_sampler" in r.json()["detail"], r.text
    assert r.json()["category"] == "user"
    r = _sample(a, {"inputs": [prompt], "adapter_name": "../x"})
    assert r.status_code == 400 and "adapter_name" in r.json()["detail"]
    r = _sample(a, {"inputs": [prompt], "adapter_name": ["x"]})
    assert r.status_code == 400 and "adapter_name" in r.json()["detail"]
    r = a.http.post(f"/sampler/{a.model}/twinkle/sample", json={"inputs": [prompt], "adapter_name": "x"},
                    headers={"X-Twinkle-Session-Id": ""})
    assert r.status_code == 400 and "X-Twinkle-Session-Id" in r.json()["detail"]
    for empty in ("", None):  # no adapter: the base model, as before (no session needed)
        r = a.http.post(f"/sampler/{a.model}/twinkle/sample", json={"inputs": [prompt], "adapter_name": empty},
                        headers={"X-Twinkle-Session-Id": ""})
        assert r.status_code == 200, r.text

    for i in range(sampler_adapters.MAX_PER_SESSION - 1):  # "x" is the first
        assert _add_to_sampler(a, f"n{i}", {"r": 2}).status_code == 200
    assert _add_to_sampler(a, "n0", {"r": 4}).status_code == 200  # replacing takes no room
    r = _add_to_sampler(a, "one-too-many", {"r": 2})
    assert r.status_code == 400 and f"at most {sampler_adapters.MAX_PER_SESSION}" in r.json()["detail"]


def test_sampler_adapters_belong_to_their_session(server: ServerProcess, a: Native) -> None:
    assert _add_to_sampler(a, "mine", {"r": 2}).status_code == 200
    prompt = {"input_ids": [5, 6, 7]}
    b = Native(server, server.api_key_b)
    assert _sample(b, {"inputs": [prompt], "adapter_name": "mine"}).status_code == 404  # B's own session
    b.http.headers["X-Twinkle-Session-Id"] = a.session  # B knows A's session id
    for r in (_sample(b, {"inputs": [prompt], "adapter_name": "mine"}), _add_to_sampler(b, "mine", {"r": 2}),
              _add_to_sampler(b, "other", {"r": 2})):
        assert r.status_code == 404 and r.json()["category"] == "user", r.text
    a2 = Native(server, server.api_key_a)  # A's second session does not see the first one's names either
    assert _sample(a2, {"inputs": [prompt], "adapter_name": "mine"}).status_code == 404
    assert _sample(a, {"inputs": [prompt], "adapter_name": "mine"}).status_code == 200
    # adapter_uri wins: an adapter_name beside it is not looked up, the saved weights are sampled
    setup_adapter(a2, gas=1)
    a2.ok("forward_backward", inputs=rows(n=2), adapter_name="default")
    a2.ok("clip_grad_and_step", adapter_name="default")
    path = a2.ok("save", name="s", is_sampler=True, adapter_name="default")["twinkle_path"]
    greedy = {"max_tokens": 4, "temperature": 0.0, "logprobs": 1}
    by_uri = _sample(a2, {"inputs": [prompt], "sampling_params": greedy, "adapter_uri": path}).json()
    both = _sample(a2, {"inputs": [prompt], "sampling_params": greedy, "adapter_uri": path, "adapter_name": "zz"})
    assert both.status_code == 200 and both.json() == by_uri, both.text
    # an ended session's names are gone with it
    finish = httpx.post(f"{server.base_url}/api/v1/sessions/{a.session}/finish", json={},
                        headers={"X-API-Key": server.api_key_a})
    assert finish.status_code == 200, finish.text
    r = _sample(a, {"inputs": [prompt], "adapter_name": "mine"})
    assert r.status_code == 404 and "ended" in r.json()["detail"], r.text
