"""RL with twinkle-kit 0.5.1's native client (`twinkle_client`), unmodified, against the server's native routes: the
cookbook's GRPO step (vLLMSampler samples with logprobs, `new_input_feature` + the sampler's logprobs as `old_logps`,
GRPOLoss / GRPOMetric), a GRPO loop whose sampler follows the trained adapter, DPO against the base model as the
reference (`forward_only(disable_lora=True)`), the client's own multi-turn rollout (`ClientMultiTurnRollout`), and
the end of a session whose heartbeat stopped (its adapter released with a 404, its checkpoint still resumable).
Run by scripts/test_native.sh (e.g. `scripts/test_native.sh -k rl_native`).

The served model is a tiny random Llama whose lm_head is frozen under LoRA (all-linear leaves it out): its output
distribution can only move a little, so sampled rewards would barely rise over a few iterations. The learning check is
the deterministic one instead: training on a fixed sampled group raises the logprob of the rewarded completions and
lowers that of the penalised ones.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import requests
from peft import LoraConfig
from twinkle_client import init_twinkle_client
from twinkle_client.http import get_base_url, get_session_id, http_post
from twinkle_client.model import MultiLoraTransformersModel
from twinkle_client.sampler import vLLMSampler

from tests.native.conftest import MODEL_NAME, NativeServer
from tests.native.data import prompt_feature, prompt_trajectory

pytestmark = pytest.mark.timeout(300)

LR = 1e-2
GROUP = 4  # completions per prompt
QUESTIONS = ("Who are you?", "What is the capital of France?")
SAMPLE = {"max_tokens": 6, "temperature": 1.0, "logprobs": 1, "num_samples": GROUP}
LOGP_TOL = 2e-4  # sampler vs trainer logprob of the same token (same weights, float32, CPU)


def plain(obj: Any) -> Any:
    """numpy arrays / scalars -> JSON lists / numbers (MultiLoraTransformersModel sends `inputs` as they are)."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    tolist = getattr(obj, "tolist", None)
    return tolist() if callable(tolist) else obj


def new_model(adapter: str, loss: str, lr: float = LR, **loss_kwargs: Any) -> MultiLoraTransformersModel:
    model = MultiLoraTransformersModel(model_id=MODEL_NAME)
    model.add_adapter_to_model(adapter, LoraConfig(r=8, target_modules="all-linear"), gradient_accumulation_steps=1)
    model.set_template("Template")
    model.set_processor("InputProcessor", padding_side="right")
    model.set_loss(loss, **loss_kwargs)
    model.set_optimizer("AdamW", lr=lr)
    return model


def reward(tokens: list[int]) -> float:
    """The toy rule: the fraction of even token ids in the completion."""
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


def group_advantages(rewards: list[float], group: int = GROUP) -> list[float]:
    r = np.asarray(rewards, dtype=float).reshape(-1, group)
    adv = (r - r.mean(axis=1, keepdims=True)) / (r.std(axis=1, keepdims=True) + 1e-6)
    return adv.reshape(-1).tolist()


def label_logps(logps: list[list[float]], features: list[dict[str, Any]]) -> list[list[float]]:
    """The per-token logps of a forward result ([row][position], aligned with the shifted labels) on each row's
    label tokens."""
    out = []
    for row, f in zip(logps, features):
        out.append([float(row[i]) for i, label in enumerate(f["labels"]) if label != -100])
    return out


def flat(rows: list[list[float]]) -> list[float]:
    return [x for row in rows for x in row]


def sampled_group(sampler: vLLMSampler, prompts: list[Any], seed: int,
                  adapter_uri: str | None = None) -> tuple[list[dict[str, Any]], list[list[float]], list[float]]:
    """(new_input_features, old_logps, rewards) of GROUP completions per prompt, checked against the wire contract."""
    samples = sampler.sample(inputs=prompts, sampling_params={**SAMPLE, "seed": seed}, adapter_uri=adapter_uri)
    assert len(samples) == len(prompts)
    features, old, rewards = [], [], []
    for sample in samples:
        assert len(sample.sequences) == GROUP
        for seq in sample.sequences:
            assert 1 <= len(seq.tokens) <= SAMPLE["max_tokens"] and seq.stop_reason in ("stop", "length")
            assert seq.logprobs is not None and len(seq.logprobs) == len(seq.tokens)
            assert all(len(top) == 1 and top[0][0] == t for top, t in zip(seq.logprobs, seq.tokens))
            f = seq.new_input_feature
            assert f is not None and f["input_ids"][-len(seq.tokens):] == seq.tokens
            assert [t for t in f["labels"] if t != -100] == seq.tokens  # one label (and one old logp) per token
            assert len(f["labels"]) == len(f["input_ids"]) == f["length"]
            features.append(f)
            old.append([lp[0][1] for lp in seq.logprobs])  # as the cookbooks read them
            rewards.append(reward(seq.tokens))
    return features, old, rewards


def test_grpo_step_on_policy(native_server: NativeServer, connect: Callable[[str], Any]) -> None:
    srv = native_server
    connect(srv.api_key_a)  # type: ignore[attr-defined]
    sampler = vLLMSampler(model_id=MODEL_NAME)
    sampler.set_template("Template", model_id=MODEL_NAME)
    # a client-encoded prompt feature and a Trajectory (encoded by the sampler's template), GROUP samples each
    features, old, rewards = sampled_group(sampler, [plain(prompt_feature(srv.model_dir))], seed=1)
    f2, o2, r2 = sampled_group(sampler, [prompt_trajectory()], seed=2)
    assert f2[0]["messages"][-1]["role"] == "assistant"  # the generated turn appended to the Trajectory
    features, old, rewards = features + f2, old + o2, rewards + r2
    adv = group_advantages(rewards)

    model = new_model("grpo", "GRPOLoss", epsilon=0.2)
    model.add_metric("GRPOMetric")
    out = model.forward_backward(inputs=features, advantages=adv, old_logps=old).result
    assert math.isfinite(out["loss"]) and abs(out["loss"]) < 1e-3, out["loss"]  # ratio 1, advantages sum to ~0
    # the trainer sees the sampler's logprobs: the same weights (a fresh adapter is the base model)
    for got, want in zip(label_logps(out["logps"], features), old):
        np.testing.assert_allclose(got, want, atol=LOGP_TOL)
    model.clip_grad_and_step()
    metric = model.calculate_metric(is_training=True).result
    assert abs(float(metric["train/logp_diff_mean"])) < 1e-3, metric
    assert 0 <= float(metric["train/approx_kl"]) < 1e-4, metric

    # GRPOLoss without advantages is refused, not trained on
    with pytest.raises(requests.HTTPError) as err:
        model.forward_backward(inputs=features)
    assert err.value.response is not None and err.value.response.status_code == 400
    assert "advantages" in str(err.value)


def test_grpo_loop_raises_rewarded_logprobs(native_server: NativeServer, connect: Callable[[str], Any]) -> None:
    srv = native_server
    connect(srv.api_key_a)  # type: ignore[attr-defined]
    sampler = vLLMSampler(model_id=MODEL_NAME)
    prompts = [plain(prompt_feature(srv.model_dir, q)) for q in QUESTIONS]
    model = new_model("grpo-loop", "GRPOLoss", epsilon=0.2)
    model.add_metric("GRPOMetric")

    # iterations: the sampler samples with the adapter as trained so far (is_sampler save -> adapter_uri), so each
    # step is on policy again: the trainer's logps of the sampled tokens are the sampler's
    kls, mean_rewards = [], []
    first: tuple[list[dict[str, Any]], list[list[float]], list[float]] | None = None
    for it in range(3):
        uri = None if it == 0 else model.save(f"grpo-it{it}", is_sampler=True).twinkle_path
        features, old, rewards = sampled_group(sampler, prompts, seed=10 + it, adapter_uri=uri)
        first = first or (features, old, rewards)
        mean_rewards.append(float(np.mean(rewards)))
        out = model.forward_backward(inputs=features, advantages=group_advantages(rewards), old_logps=old).result
        for got, want in zip(label_logps(out["logps"], features), old):
            np.testing.assert_allclose(got, want, atol=LOGP_TOL)
        model.clip_grad_and_step()
        metric = model.calculate_metric(is_training=True).result
        assert abs(float(metric["train/logp_diff_mean"])) < 1e-3, (it, metric)
        kls.append(float(metric["train/approx_kl"]))
    assert all(0 <= k < 1e-4 for k in kls), kls
    assert all(0 <= r <= 1 for r in mean_rewards), mean_rewards

    # the learning signal, deterministic: a few more steps on the first group raise the logprob of its rewarded
    # completions and lower that of its penalised ones (against what the sampler gave before any training)
    assert first is not None
    features, old, rewards = first
    adv = group_advantages(rewards)
    assert max(adv) > 0.5 and min(adv) < -0.5, rewards  # the toy rule separates the group
    for _ in range(4):
        model.forward_backward(inputs=features, advantages=adv, old_logps=old)
        model.clip_grad_and_step()
    now = label_logps(model.forward_only(inputs=features).result["logps"], features)
    delta = [float(np.mean(n) - np.mean(o)) for n, o in zip(now, old)]
    # (on this model about +-0.2 to 0.4 nats per token after 5 steps, sign for sign)
    assert all(d > 0 for a, d in zip(adv, delta) if a > 0.5), (adv, delta)
    assert all(d < 0 for a, d in zip(adv, delta) if a < -0.5), (adv, delta)
    assert sum(a * d for a, d in zip(adv, delta)) > 0, (adv, delta)  # the surrogate objective went up
    # the base model (the reference) is untouched
    base = label_logps(model.forward_only(inputs=features, disable_lora=True).result["logps"], features)
    for got, want in zip(base, old):
        np.testing.assert_allclose(got, want, atol=LOGP_TOL)


def dpo_pairs(tokenizer_dir: Any) -> list[dict[str, Any]]:
    """(chosen, rejected) rows, chosen first in each pair, encoded client-side with twinkle's Template."""
    from twinkle.data_format import Message, Trajectory
    from twinkle.template import Template

    template = Template(model_id=str(tokenizer_dir))
    pairs = [("Who are you?", "I am Blinky, a helpful assistant.", "The weather is cold today."),
             ("What is the capital of France?", "The capital of France is Paris.", "One two three four.")]
    rows = []
    for question, chosen, rejected in pairs:
        for answer in (chosen, rejected):
            traj = Trajectory(messages=[Message(role="user", content=question),
                                        Message(role="assistant", content=answer)])
            rows.append(plain(dict(template.encode(traj))))
    return rows


def test_dpo_against_the_base_model(native_server: NativeServer, connect: Callable[[str], Any]) -> None:
    srv = native_server
    connect(srv.api_key_a)  # type: ignore[attr-defined]
    pairs = dpo_pairs(srv.model_dir)
    model = new_model("dpo", "DPOLoss", beta=0.5)
    model.add_metric("DPOMetric", beta=0.5)
    ref = model.forward_only(inputs=pairs, disable_lora=True)
    fresh = model.forward_only(inputs=pairs).result
    ref_logps = flat(label_logps(ref.result["logps"], pairs))
    np.testing.assert_allclose(flat(label_logps(fresh["logps"], pairs)), ref_logps,
                               rtol=1e-5, atol=1e-6)  # a new adapter is the base model
    losses = []
    for _ in range(5):
        out = model.forward_backward(inputs=pairs, ref_outputs=ref.result).result
        assert math.isfinite(out["loss"]), out
        losses.append(float(out["loss"]))
        model.clip_grad_and_step()
    assert losses[0] == pytest.approx(math.log(2), rel=1e-4), losses  # policy == reference: margin 0
    assert losses[-1] < losses[0], losses
    metric = model.calculate_metric(is_training=True).result
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert key in metric, metric
    assert str(metric["rewards/accuracies"]).endswith("%") and float(metric["rewards/margins"]) > 0, metric
    # the reference stays the base model, the policy moved
    again = model.forward_only(inputs=pairs, disable_lora=True).result
    np.testing.assert_allclose(flat(label_logps(again["logps"], pairs)), ref_logps, rtol=1e-5, atol=1e-6)
    moved = model.forward_only(inputs=pairs).result
    assert not np.allclose(flat(label_logps(moved["logps"], pairs)), ref_logps, atol=1e-4)
    # an odd number of rows is not (chosen, rejected) pairs
    with pytest.raises(requests.HTTPError) as err:
        model.forward_backward(inputs=pairs[:3], ref_outputs=ref.result)
    assert err.value.response is not None and err.value.response.status_code == 400


def test_client_multi_turn_rollout(native_server: NativeServer, connect: Callable[[str], Any]) -> None:
    """twinkle_client.rollout.ClientMultiTurnRollout, two turns per trajectory: the first asks for a (toy) tool,
    whose answer and the next generation prompt the rollout appends as -100 bridge tokens; the second ends. The
    rollout itself checks that the logprobs of all turns match the labels != -100 of the final feature (upstream's
    old_logps alignment), which holds only if `new_input_feature` keeps the earlier turns' labels. The trajectories
    then train a GRPO step on policy."""
    from twinkle.data_format import Message, Trajectory
    from twinkle.data_format.sampling import SamplingParams
    from twinkle.template import Template
    from twinkle_agentic.tools.base import Tool
    from twinkle_agentic.tools.tool_manager import ToolManager
    from twinkle_client.rollout import ClientMultiTurnRollout

    srv = native_server
    connect(srv.api_key_a)  # type: ignore[attr-defined]

    class FirstTurnCallsTool(Template):
        """The tiny random model writes no tool-call markup: this template's parser reads the first `n` turns it
        sees (the first turn of each of n trajectories) as a call of the toy tool, later ones as none."""

        def __init__(self, *args: Any, n: int, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.remaining = n

        def parse_tool_call(self, decoded: str) -> list[dict[str, Any]]:
            if self.remaining <= 0:
                return []
            self.remaining -= 1
            return [{"type": "function", "function": {"name": "lookup", "arguments": '{"query": "Paris"}'}}]

    class Lookup(Tool):
        def __init__(self) -> None:
            self.calls: list[dict[str, Any]] = []

        def __call__(self, tool_name: str, arguments: dict[str, Any]) -> str:
            self.calls.append(arguments)
            return "Paris is the capital of France."

        def tool_info(self) -> Any:
            return {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}

    trajectories = [Trajectory(messages=[Message(role="user", content=q)]) for q in QUESTIONS]
    template = FirstTurnCallsTool(model_id=str(srv.model_dir), n=len(trajectories))
    vocab = len(template.tokenizer)
    # every id a stop token: each turn ends after its first token with stop_reason "stop" (a "length" stop would end
    # the trajectory before the tool turn)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=5, logprobs=1, stop=list(range(vocab)))
    tool = Lookup()
    rollout = ClientMultiTurnRollout(vLLMSampler(model_id=MODEL_NAME), template, tool_manager=ToolManager([tool]),
                                     sampling_params=params, max_turns=3)
    outs = rollout(trajectories)

    assert len(outs) == len(trajectories) and len(tool.calls) == len(trajectories)
    for out in outs:
        assert out["turns"] == 2 and out["stop_reason"] == "stop" and not out["truncated"], out
        roles = [m["role"] for m in out["messages"]]
        assert roles == ["user", "assistant", "tool", "assistant"], roles
        logprobs = out["logprobs"]
        labels = out["labels"]
        assert logprobs is not None and len(logprobs) == 2  # one token per turn
        assert len(labels) == len(out["input_ids"]) and sum(t != -100 for t in labels) == 2
        # the tool answer sits between the turns as -100 bridge tokens
        first, second = [i for i, t in enumerate(labels) if t != -100]
        assert second - first > 5
        assert [labels[first], labels[second]] == [lp[0][0] for lp in logprobs]

    # the trajectories train as they are (old_logps = both turns' logprobs), on policy
    model = new_model("rollout", "GRPOLoss", epsilon=0.2)
    model.add_metric("GRPOMetric")
    old = [[lp[0][1] for lp in out["logprobs"]] for out in outs]
    res = model.forward_backward(inputs=outs, advantages=[1.0, -1.0], old_logps=old).result
    for got, want in zip(label_logps(res["logps"], outs), old):
        np.testing.assert_allclose(got, want, atol=LOGP_TOL)
    model.clip_grad_and_step()
    metric = model.calculate_metric(is_training=True).result
    assert abs(float(metric["train/logp_diff_mean"])) < 1e-3, metric


# --- session expiry -------------------------------------------------------------------------------------------

SESSION_TIMEOUT = 3


@pytest.fixture(scope="module")
def short_session_server(native_server: NativeServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A second server (the same tiny model folder) whose sessions end 3 s after their last heartbeat, swept every
    second."""
    srv = NativeServer(tmp_path_factory.mktemp("short-sessions"), native_server.models_root, native_server.python)
    srv.env.update({"TWINKLE_SESSION_TIMEOUT_SECONDS": str(SESSION_TIMEOUT),
                    "TWINKLE_MAINTENANCE_INTERVAL_SECONDS": "1"})
    srv.api_key = srv.create_key("tenant-expiry")  # type: ignore[attr-defined]
    srv.start()
    yield srv
    srv.stop()


def _status_of(call: Callable[[], Any]) -> int:
    """The HTTP status a client call failed with; a 410 surfaces as StopIteration and fails the test."""
    try:
        call()
    except StopIteration:
        pytest.fail("the server answered 410, which twinkle_client turns into StopIteration")
    except requests.HTTPError as err:
        assert err.response is not None
        return err.response.status_code
    return 200


def _expire(srv: NativeServer, batch: list[dict[str, Any]], adapter: str) -> tuple[Any, MultiLoraTransformersModel]:
    """A client with a trained adapter whose heartbeat then stopped, once the server answers its calls with an error
    (status checked by the caller); returns (the closed client, its model)."""
    client = init_twinkle_client(base_url=srv.base_url, api_key=srv.api_key,  # type: ignore[attr-defined]
                                 session_heartbeat_interval=1)
    model = new_model(adapter, "CrossEntropyLoss")
    model.forward_backward(inputs=batch)
    model.clip_grad_and_step()
    client.close()
    deadline = time.monotonic() + SESSION_TIMEOUT + 20
    while time.monotonic() < deadline and _status_of(lambda: model.forward_only(inputs=batch)) == 200:
        time.sleep(1)
    return client, model


def test_session_expiry_releases_the_adapter(short_session_server: NativeServer,
                                             sc_batches: list[list[dict[str, Any]]]) -> None:
    srv = short_session_server
    batch = sc_batches[0]
    clients: list[Any] = []
    try:
        clients.append(init_twinkle_client(base_url=srv.base_url, api_key=srv.api_key,  # type: ignore[attr-defined]
                                           session_heartbeat_interval=1))
        old_session = get_session_id()
        model = new_model("expiring", "CrossEntropyLoss")
        model.forward_backward(inputs=batch)
        model.clip_grad_and_step()
        saved = model.save("before-expiry", save_optimizer=True, consumed_train_samples=len(batch)).twinkle_path
        loss = float(model.forward_only(inputs=batch).result["loss"])

        time.sleep(SESSION_TIMEOUT + 2)  # the heartbeat thread keeps the session alive past the timeout
        assert float(model.forward_only(inputs=batch).result["loss"]) == pytest.approx(loss, rel=1e-6)

        clients[0].close()  # the heartbeat stops (there is no end-session call)
        deadline = time.monotonic() + SESSION_TIMEOUT + 20
        status = 200
        while status == 200 and time.monotonic() < deadline:
            time.sleep(1)
            status = _status_of(lambda: model.forward_only(inputs=batch))
        assert status == 404, f"the adapter still answered {status} after the session timed out"
        assert _status_of(lambda: model.forward_backward(inputs=batch)) == 404
        assert _status_of(lambda: model.save("too-late")) == 404
        # a new client (a new session) resumes the saved checkpoint into a new adapter of the same name
        client = init_twinkle_client(base_url=srv.base_url, api_key=srv.api_key,  # type: ignore[attr-defined]
                                     session_heartbeat_interval=1)
        clients.append(client)
        assert get_session_id() != old_session
        run_id = saved[len("twinkle://"):].split("/")[0]
        assert run_id in [r.training_run_id for r in client.list_training_runs()]
        resumed = new_model("expiring", "CrossEntropyLoss")
        progress = resumed.resume_from_checkpoint(saved)
        assert progress["consumed_train_samples"] == len(batch)
        assert float(resumed.forward_only(inputs=batch).result["loss"]) == pytest.approx(loss, rel=1e-5)
        resumed.forward_backward(inputs=batch)
        resumed.clip_grad_and_step()
    finally:
        for c in clients:
            c.close()


def test_a_timed_out_session_stays_ended(short_session_server: NativeServer,
                                         sc_batches: list[list[dict[str, Any]]]) -> None:
    """Upstream deletes a timed-out session (a later heartbeat: 404 "Unknown session"); here its adapters are
    released, so the session should be over too: its heartbeat a 404 (never 410), no new adapter in it."""
    srv = short_session_server
    _, model = _expire(srv, sc_batches[0], "stale")
    assert _status_of(lambda: model.forward_only(inputs=sc_batches[0])) == 404
    session = get_session_id()
    observed: dict[str, int] = {}
    holder: list[MultiLoraTransformersModel] = []
    observed["add_adapter"] = _status_of(lambda: holder.append(new_model("stale-again", "CrossEntropyLoss")))
    if holder:  # taken: is it usable, or released by the next sweep?
        time.sleep(2.5)
        observed["new_adapter_forward"] = _status_of(lambda: holder[0].forward_only(inputs=sc_batches[0]))
    observed["heartbeat"] = _status_of(
        lambda: http_post(url=f"{get_base_url()}/twinkle/session_heartbeat", json_data={"session_id": session}))
    assert observed == {"add_adapter": 404, "heartbeat": 404}, observed
