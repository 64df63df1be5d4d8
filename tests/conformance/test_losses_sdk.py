"""Losses through the stock SDK: every RL loss runs end to end, custom losses (client-side path), accumulation,
non-finite inputs rejected, and a short DPO run through forward_backward_custom lowers the DPO loss."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.conformance.test_state import _weights
from tests.conformance.test_sft import batch, make_datum
from tests.support.server import ServerProcess


def _rl_datum(rng: np.random.Generator, n: int = 8, **extra: list[float]) -> types.Datum:
    tokens = rng.integers(5, 200, size=n + 1).tolist()
    inputs = {"target_tokens": tokens[1:], "logprobs": (-rng.uniform(3, 7, n)).tolist(),
              "advantages": rng.normal(size=n).tolist(), **extra}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


@pytest.fixture(scope="module")
def sc(server: ServerProcess):  # type: ignore[no-untyped-def]
    client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a)
    yield client
    client.close("success")


@pytest.mark.parametrize(
    "loss_fn, config, extra",
    [
        ("importance_sampling", None, {}),
        ("ppo", {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3}, {}),
        ("cispo", None, {}),
        ("dro", {"beta": 0.1}, {}),
        ("gspo", None, {"sequence_ratio_mask": [1.0] * 8}),
    ],
)
def test_rl_losses_run_through_the_sdk(server: ServerProcess, sc, loss_fn, config, extra) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(1)
    tc = sc.create_lora_training_client(base_model=server.base_model, rank=2).result()
    data = [_rl_datum(rng, **extra) for _ in range(3)]
    out = tc.forward_backward(data, loss_fn, loss_fn_config=config).result()
    assert np.isfinite(out.metrics["loss:sum"])
    assert [len(o["logprobs"].tolist()) for o in out.loss_fn_outputs] == [8, 8, 8]
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_unknown_loss_missing_input_and_nan_are_4xx(server: ServerProcess, sc) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(2)
    tc = sc.create_lora_training_client(base_model=server.base_model, rank=2).result()
    with pytest.raises(tinker.BadRequestError, match="advantages"):
        tc.forward_backward([make_datum([1, 2, 3, 4])], "importance_sampling").result()
    bad = _rl_datum(rng)
    bad.loss_fn_inputs["advantages"] = types.TensorData.from_numpy(np.array([np.nan] + [0.0] * 7, dtype=np.float32))
    with pytest.raises(tinker.BadRequestError, match="NaN"):
        tc.forward_backward([bad], "importance_sampling").result()
    with pytest.raises(tinker.BadRequestError, match="optimizer"):
        sc.create_lora_training_client(base_model=server.base_model, rank=2,
                                       optimizer=types.DimuonOptimizerConfig()).result()
    # the model goes on working after the rejections
    assert np.isfinite(tc.forward_backward(batch(), "cross_entropy").result().metrics["loss:sum"])


def test_two_half_batches_equal_one_full_batch(server: ServerProcess, sc) -> None:  # type: ignore[no-untyped-def]
    data = batch()
    adam = types.AdamParams(learning_rate=1e-2)
    full = sc.create_lora_training_client(base_model=server.base_model, rank=4, seed=11).result()
    halves = sc.create_lora_training_client(base_model=server.base_model, rank=4, seed=11).result()
    for _ in range(2):
        full.forward_backward(data, "cross_entropy").result()
        full.optim_step(adam).result()
        halves.forward_backward(data[:2], "cross_entropy").result()
        halves.forward_backward(data[2:], "cross_entropy").result()
        halves.optim_step(adam).result()
    a = _weights(server, full.save_weights_for_sampler("full").result().path)
    b = _weights(server, halves.save_weights_for_sampler("halves").result().path)
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert max(a[k].abs().max().item() for k in a if "lora_B" in k) > 0


def test_custom_loss_equals_weighted_cross_entropy(server: ServerProcess, sc) -> None:  # type: ignore[no-untyped-def]
    data = batch()
    w = [np.linspace(-1, 2, d.model_input.length).astype(np.float32) for d in data]
    adam = types.AdamParams(learning_rate=1e-2)

    def custom(batch_data: list[types.Datum], logprobs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        loss = sum(-(lp * torch.tensor(wi)).sum() for lp, wi in zip(logprobs, w))
        return loss, {"custom_loss": float(loss)}

    a = sc.create_lora_training_client(base_model=server.base_model, rank=4, seed=12).result()
    b = sc.create_lora_training_client(base_model=server.base_model, rank=4, seed=12).result()
    a.forward_backward_custom(data, custom).result()
    a.optim_step(adam).result()
    weighted = [types.Datum(model_input=d.model_input,
                            loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"], "weights": wi.tolist()})
                for d, wi in zip(data, w)]
    b.forward_backward(weighted, "cross_entropy").result()
    b.optim_step(adam).result()
    wa = _weights(server, a.save_weights_for_sampler("custom").result().path)
    wb = _weights(server, b.save_weights_for_sampler("weighted").result().path)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-6


def test_dpo_through_forward_backward_custom_lowers_dpo_loss(server: ServerProcess, sc) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(3)
    prompts = [rng.integers(5, 200, size=6).tolist() for _ in range(3)]
    pairs = [(p + rng.integers(5, 200, size=4).tolist(), p + rng.integers(5, 200, size=4).tolist()) for p in prompts]
    data = [make_datum(seq) for pair in pairs for seq in pair]  # chosen, rejected, chosen, rejected, ...
    for d in data:  # score only the completion tokens
        n = d.model_input.length
        d.loss_fn_inputs["weights"] = types.TensorData.from_numpy(
            np.array([0.0] * (n - 4) + [1.0] * 4, dtype=np.float32))
    tc = sc.create_lora_training_client(base_model=server.base_model, rank=8, seed=13).result()
    ref = [torch.tensor(o["logprobs"].tolist()) for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]
    masks = [torch.tensor(d.loss_fn_inputs["weights"].tolist()) for d in data]
    beta = 0.5

    def dpo(batch_data: list[types.Datum], logprobs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        total = torch.zeros(())
        for i in range(0, len(logprobs), 2):
            chosen = ((logprobs[i] - ref[i]) * masks[i]).sum()
            rejected = ((logprobs[i + 1] - ref[i + 1]) * masks[i + 1]).sum()
            total = total - torch.nn.functional.logsigmoid(beta * (chosen - rejected))
        return total, {"dpo": float(total)}

    losses = []
    for _ in range(8):
        out = tc.forward_backward_custom(data, dpo).result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        losses.append(out.metrics["loss:sum"])
    assert losses[0] == pytest.approx(3 * np.log(2), rel=1e-4)  # policy == reference at the start
    assert losses[-1] < losses[0] * 0.7, losses
