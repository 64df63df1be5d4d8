"""twinkle-kit 0.5.1's native client (`twinkle_client`), unmodified, against the server's native Twinkle routes
(../shared/reference/twinkle-native-protocol.md): the cookbook's SFT flow with client-side data, save / list / resume /
load, sampling with the saved adapter; tenants kept apart; the allow-lists of the name-based slots. Run by
scripts/test_native.sh."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import requests
from peft import LoraConfig
from twinkle_client.http import get_session_id, set_session_id
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import vLLMSampler

from tests.native.conftest import MODEL_NAME, NativeServer
from tests.native.data import prompt_feature, prompt_trajectory

pytestmark = pytest.mark.timeout(300)

LR = 1e-2
GAS = 2
EPOCHS = 8  # x 2 batches of 4 rows = 16 micro-batches = 8 optimizer steps
GREEDY = {"max_tokens": 4, "temperature": 0, "logprobs": 1}


def lora() -> LoraConfig:
    return LoraConfig(r=8, target_modules="all-linear")


def new_model(adapter: str, gas: int = GAS) -> MultiLoraTransformersModel:
    """A model client with a LoRA adapter configured the way the cookbook does (step 5-10 of §6)."""
    model = MultiLoraTransformersModel(model_id=MODEL_NAME)
    model.add_adapter_to_model(adapter, lora(), gradient_accumulation_steps=gas)
    model.set_template("Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=LR)
    return model


def fb_loss(out: Any) -> float:
    result = out.result
    assert isinstance(result, dict) and "loss" in result, result
    loss = float(result["loss"])
    assert math.isfinite(loss) and loss > 0, result
    return loss


def parse_twinkle_path(path: str) -> tuple[str, str, str]:
    assert path.startswith("twinkle://"), path
    parts = path[len("twinkle://"):].split("/")
    assert len(parts) == 3 and all(parts), path
    return parts[0], parts[1], parts[2]


def check_samples(samples: list[Any], n_inputs: int) -> None:
    assert len(samples) == n_inputs
    for sample in samples:
        assert len(sample.sequences) == 1
        seq = sample.sequences[0]
        assert 1 <= len(seq.tokens) <= GREEDY["max_tokens"]
        assert seq.stop_reason in ("stop", "length")
        assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
        for token, top in zip(seq.tokens, seq.logprobs):
            assert top is not None and len(top) == 1  # logprobs: 1 -> exactly [[sampled_id, lp]]
            token_id, lp = top[0]
            assert token_id == token and lp <= 0 and math.isfinite(lp)


def test_sft_flow(native_server: NativeServer, connect: Callable[[str], Any],
                  sc_batches: list[list[dict[str, Any]]]) -> None:
    srv = native_server
    client = connect(srv.api_key_a)  # type: ignore[attr-defined]
    assert client.health_check()
    caps = client.get_server_capabilities()
    assert MODEL_NAME in [m.model_name for m in caps.supported_models]

    model = MultiLoraTransformersModel(model_id=MODEL_NAME)
    model.add_adapter_to_model("default", lora(), gradient_accumulation_steps=GAS)
    model.set_template("Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=LR)
    micro_steps = EPOCHS * len(sc_batches)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=1, num_training_steps=micro_steps)

    metric_losses, consumed = [], 0
    first_fb: float | None = None
    for step in range(micro_steps):
        batch = sc_batches[step % len(sc_batches)]
        out = model.forward_backward(inputs=batch)  # rows as the DataLoader yields them: raw columns + InputFeature
        loss = fb_loss(out)
        first_fb = loss if first_fb is None else first_fb
        model.clip_grad_and_step()
        consumed += len(batch)
        if step % GAS == GAS - 1:
            metric = model.calculate_metric(is_training=True).result
            assert "loss" in metric, metric
            metric_losses.append(float(metric["loss"]))
    assert all(math.isfinite(x) for x in metric_losses), metric_losses
    # LoRA on all-linear of a random 2-layer model (lm_head untouched, loss starts near ln(vocab)) learns slowly: a
    # correct server goes 5.93 -> ~5.65 here (same as plain torch + peft with these settings)
    assert metric_losses[-1] < metric_losses[0] * 0.97, metric_losses

    configs = model.get_train_configs().result
    assert isinstance(configs, str) and configs

    saved = model.save("sft-epoch-1", save_optimizer=True, consumed_train_samples=consumed)
    run_id, kind, name = parse_twinkle_path(saved.twinkle_path)
    assert (kind, name) == ("weights", "sft-epoch-1")
    assert saved.checkpoint_dir is None  # never a server path

    runs = {r.training_run_id: r for r in client.list_training_runs()}
    assert run_id in runs, list(runs)
    assert runs[run_id].base_model == MODEL_NAME
    assert srv.api_key_a not in runs[run_id].model_owner  # type: ignore[attr-defined]  # an opaque owner, not the key
    assert client.get_training_run(run_id).training_run_id == run_id
    checkpoints = client.list_checkpoints(run_id)
    mine = [c for c in checkpoints if c.twinkle_path == saved.twinkle_path]
    assert len(mine) == 1 and mine[0].checkpoint_type == "training" and mine[0].checkpoint_id == "weights/sft-epoch-1"

    # a new model object (a fresh adapter) picks the training up where it stopped
    resumed = new_model("resumed")
    progress = resumed.resume_from_checkpoint(saved.twinkle_path)
    assert progress["consumed_train_samples"] == consumed
    assert progress["gradient_accumulation_steps"] == GAS
    assert isinstance(progress["cur_step"], int) and progress["cur_step"] >= 1
    after = fb_loss(resumed.forward_backward(inputs=sc_batches[0]))
    # trained weights: a fresh adapter (B = 0) would give first_fb again
    assert first_fb is not None and after < first_fb * 0.98, (after, first_fb)
    resumed.clip_grad_and_step()
    resumed.load(saved.twinkle_path)  # weights only, into an existing adapter

    # sampler weights, then vLLMSampler with the twinkle path: an encoded InputFeature and a Trajectory
    sampler_path = model.save("sft-sampler", is_sampler=True).twinkle_path
    s_run, s_kind, _ = parse_twinkle_path(sampler_path)
    assert (s_run, s_kind) == (run_id, "sampler_weights")
    sampler = vLLMSampler(model_id=MODEL_NAME)
    feature = prompt_feature(srv.model_dir)
    check_samples(sampler.sample(inputs=[feature], sampling_params=GREEDY, adapter_uri=sampler_path), 1)
    sampler.set_template("Template", model_id=MODEL_NAME)
    check_samples(sampler.sample(inputs=[prompt_trajectory(), prompt_trajectory("Who made you?")],
                                 sampling_params=GREEDY, adapter_uri=sampler_path), 2)


def _a_checkpoint(batch: list[dict[str, Any]]) -> tuple[MultiLoraTransformersModel, str, str]:
    """Tenant A's adapter after one optimizer step: (model, training path, sampler path)."""
    model = new_model("iso", gas=1)
    model.forward_backward(inputs=batch)
    model.clip_grad_and_step()
    return (model, model.save("iso-state", save_optimizer=True, consumed_train_samples=len(batch)).twinkle_path,
            model.save("iso-sampler", is_sampler=True).twinkle_path)


def _refused(call: Callable[[], Any]) -> requests.HTTPError:
    """The call is refused with a client error (not a 5xx crash, not a success)."""
    with pytest.raises(requests.HTTPError) as err:
        call()
    assert err.value.response is not None and err.value.response.status_code in (400, 401, 403, 404), str(err.value)
    return err.value


def test_isolation(native_server: NativeServer, connect: Callable[[str], Any],
                   sc_batches: list[list[dict[str, Any]]]) -> None:
    srv = native_server
    batch = sc_batches[0]
    connect(srv.api_key_a)  # type: ignore[attr-defined]
    session_a = get_session_id()
    a_model, a_state, a_sampler = _a_checkpoint(batch)
    a_run = parse_twinkle_path(a_state)[0]

    client_b = connect(srv.api_key_b)  # type: ignore[attr-defined]  # from here on every request carries B's key
    assert get_session_id() != session_a
    assert a_run not in [r.training_run_id for r in client_b.list_training_runs()]
    # management calls: a 4xx surfaces as requests.HTTPError (http_get raises before TwinkleClientError's check)
    _refused(lambda: client_b.get_training_run(a_run))
    _refused(lambda: client_b.list_checkpoints(a_run))

    b_model = new_model("intruder", gas=1)
    _refused(lambda: b_model.load(a_state))
    _refused(lambda: b_model.resume_from_checkpoint(a_state))
    sampler = vLLMSampler(model_id=MODEL_NAME)
    feature = prompt_feature(srv.model_dir)
    _refused(lambda: sampler.sample(inputs=[feature], sampling_params=GREEDY, adapter_uri=a_sampler))
    _refused(lambda: sampler.sample(inputs=[feature], sampling_params=GREEDY, adapter_uri=a_state))
    # B's own work is fine
    b_model.forward_backward(inputs=batch)
    b_model.clip_grad_and_step()

    # A's model object now speaks with B's key: A's adapter is not B's to drive, not even with A's session id
    _refused(lambda: a_model.forward_backward(inputs=batch))
    set_session_id(session_a)  # type: ignore[arg-type]
    _refused(lambda: a_model.forward_backward(inputs=batch))
    _refused(lambda: a_model.save("stolen"))

    # a key the server does not know: the very first call (create_session) is a 401
    with pytest.raises(requests.HTTPError) as err:
        connect("tml-not-a-real-key")
    assert err.value.response is not None and err.value.response.status_code == 401

    # A, back with its own key and a new session, still owns its checkpoint
    connect(srv.api_key_a)  # type: ignore[attr-defined]
    again = new_model("iso-again", gas=1)
    again.load(a_state)


def test_allow_lists(native_server: NativeServer, connect: Callable[[str], Any]) -> None:
    connect(native_server.api_key_a)  # type: ignore[attr-defined]
    model = MultiLoraTransformersModel(model_id=MODEL_NAME)
    model.add_adapter_to_model("lists", lora(), gradient_accumulation_steps=1)

    def bad_request(call: Callable[[], Any], *accepted: str) -> None:
        with pytest.raises(requests.HTTPError) as err:
            call()
        assert err.value.response is not None and err.value.response.status_code == 400, str(err.value)
        for name in accepted:
            assert name in str(err.value), str(err.value)  # the message names what is accepted

    bad_request(lambda: model.set_loss("os.system"), "CrossEntropyLoss")
    bad_request(lambda: model.set_optimizer("NotAThing"), "AdamW")
    bad_request(lambda: model.set_lr_scheduler("builtins.eval"), "CosineWarmupScheduler")
    bad_request(lambda: model.set_template("ms://someone/template-plugin"), "Template")
    bad_request(lambda: model.apply_patch("ms://x/y"))
    bad_request(lambda: model.set_loss("MSELoss"), "regression head", "GKDLoss")  # named, with the reason
    bad_request(lambda: model.set_loss("PPOValueLoss"), "value head")
    bad_request(lambda: model.set_loss("InfonceLoss"), "embeddings")
    bad_request(lambda: model.set_template("DeepseekV4Template"), "DeepSeek-V4", "Template")
    # the slots still take the allowed names afterwards
    model.set_loss("CrossEntropyLoss")
    model.set_optimizer("AdamW", lr=LR)


def test_sampler_adapter(native_server: NativeServer, connect: Callable[[str], Any]) -> None:
    """add_adapter_to_sampler with a plain dict config (the only kind this client can send), then sampling with its
    name: a fresh slot holds no weights (the weight sync is not offered), so it samples the base model."""
    srv = native_server
    connect(srv.api_key_a)  # type: ignore[attr-defined]
    sampler = vLLMSampler(model_id=MODEL_NAME)
    added = sampler.add_adapter_to_sampler("a", {"r": 8, "target_modules": "all-linear"})
    assert (added.status, added.adapter_name) == ("ok", "a") and sampler.adapter_name == "a"
    feature = prompt_feature(srv.model_dir)
    params = {**GREEDY, "prompt_logprobs": 1}
    base = sampler.sample(inputs=[feature], sampling_params=params)
    named = sampler.sample(inputs=[feature], sampling_params=params, adapter_name="a")
    check_samples(named, 1)
    want, got = base[0].sequences[0], named[0].sequences[0]
    assert got.tokens == want.tokens
    for g, w in zip(got.logprobs or [], want.logprobs or []):
        assert g[0][0] == w[0][0] and math.isclose(g[0][1], w[0][1], abs_tol=1e-5)
    assert named[0].prompt_logprobs is not None and base[0].prompt_logprobs is not None
    for g, w in zip(named[0].prompt_logprobs[1:], base[0].prompt_logprobs[1:]):
        assert g is not None and w is not None and math.isclose(g, w, abs_tol=1e-5)

    # a real peft LoraConfig: this client sends its __dict__, which JSON cannot hold (the reference's *verified*)
    with pytest.raises(TypeError):
        sampler.add_adapter_to_sampler("real", lora())
    err = _refused(lambda: sampler.add_adapter_to_sampler("big", {"r": 100000}))
    assert err.response is not None and err.response.status_code == 400 and "r must be" in str(err)
    err = _refused(lambda: sampler.sample(inputs=[feature], sampling_params=GREEDY, adapter_name="never-added"))
    assert err.response is not None and err.response.status_code == 404 and "add_adapter_to_sampler" in str(err)

    connect(srv.api_key_b)  # type: ignore[attr-defined]  # B's key and session: A's name is not B's
    _refused(lambda: sampler.sample(inputs=[feature], sampling_params=GREEDY, adapter_name="a"))
