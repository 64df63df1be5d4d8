"""Server-side custom losses through the stock SDK (create_custom_loss + forward_backward_custom with the handle):
the same loss and the same trained weights as the same function run client-side, a DPO-style loss that trains,
4xx for missing inputs and wrong ranks, a size bomb that fails only its own job, and idempotent creates."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.conformance.test_sft import batch, make_datum
from tests.conformance.test_state import _weights
from tests.support.server import ServerProcess

BETA = 0.5


@pytest.fixture(scope="module")
def sc(server: ServerProcess):  # type: ignore[no-untyped-def]
    client = tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a)
    yield client
    client.close("success")


@pytest.fixture(scope="module")
def nll_handle(sc):  # type: ignore[no-untyped-def]
    return sc.create_custom_loss(weighted_nll, {"logprobs": 1, "weights": 1, "scale": 0}).result()


def weighted_nll(logprobs, weights, scale):  # type: ignore[no-untyped-def]
    """Per datum: -sum(weights * logprobs) * scale (scale is a rank-0 input), plus a squared-logprob term."""
    base = -(logprobs * weights).sum() * scale
    loss = base + 0.01 * torch.square(logprobs).mean()
    return loss, {"custom/nll:sum": base, "custom/mean_lp:mean": logprobs.mean()}


def dpo(logprobs, ref_logprobs, chosen, rejected):  # type: ignore[no-untyped-def]
    """DPO on one datum packing prompt+chosen+prompt+rejected: masks pick each completion's tokens."""
    delta = logprobs - ref_logprobs
    margin = (delta * chosen).sum() - (delta * rejected).sum()
    loss = -torch.nn.functional.logsigmoid(BETA * margin)
    return loss, {"custom/dpo:sum": loss, "custom/margin:mean": margin}


def mean_logprob(logprobs):  # type: ignore[no-untyped-def]
    return logprobs.mean(), {}


def _data(rng: np.random.Generator) -> list[types.Datum]:
    data = []
    for n in (9, 12, 7):
        d = make_datum(rng.integers(5, 200, size=n + 1).tolist())
        d.loss_fn_inputs["weights"] = types.TensorData.from_numpy(rng.uniform(-1, 2, n).astype(np.float32))
        d.loss_fn_inputs["scale"] = types.TensorData.from_numpy(np.array(rng.uniform(0.5, 2), dtype=np.float32))
        data.append(d)
    return data


def _client_side(fn, names):  # type: ignore[no-untyped-def]
    """The same per-datum function as a plain forward_backward_custom callable (runs in this process)."""

    def loss_fn(data: list[types.Datum], logprobs: list[torch.Tensor]):  # type: ignore[no-untyped-def]
        total, sums = torch.zeros(()), {}
        for d, lp in zip(data, logprobs):
            loss, metrics = fn(lp, *(d.loss_fn_inputs[n].to_torch() for n in names))
            total = total + loss
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v.detach())
        return total, {k: v / len(data) if k.endswith(":mean") else v for k, v in sums.items()}

    return loss_fn


def test_server_side_loss_equals_client_side(server: ServerProcess, sc, nll_handle) -> None:  # type: ignore[no-untyped-def]
    handle = nll_handle
    assert handle.loss_id is not None  # uploaded: this server runs custom losses (client/config says so)
    data = _data(np.random.default_rng(5))
    adam = types.AdamParams(learning_rate=1e-2)
    remote = sc.create_lora_training_client(base_model=server.base_model, rank=4, seed=21).result()
    local = sc.create_lora_training_client(base_model=server.base_model, rank=4, seed=21).result()
    for step in range(2):
        a = remote.forward_backward_custom(data, handle).result()
        remote.optim_step(adam).result()
        b = local.forward_backward_custom(data, _client_side(weighted_nll, ["weights", "scale"])).result()
        local.optim_step(adam).result()
        assert "surrogate_loss:sum" not in a.metrics and "surrogate_loss:sum" in b.metrics  # a ran server-side
        # fp32 on both sides: the same forward, the same per-datum math, sums of ~30 terms; the two paths differ
        # only in summation order of the metrics (float64 on the server, Python floats here).
        for key in ("loss:sum", "custom/nll:sum", "custom/mean_lp:mean"):
            assert a.metrics[key] == pytest.approx(b.metrics[key], rel=1e-6, abs=1e-6), (step, key)
        for oa, ob in zip(a.loss_fn_outputs, b.loss_fn_outputs):
            np.testing.assert_allclose(oa["logprobs"].to_numpy(), ob["logprobs"].to_numpy(), atol=1e-6)
    wa = _weights(server, remote.save_weights_for_sampler("custom-remote").result().path)
    wb = _weights(server, local.save_weights_for_sampler("custom-local").result().path)
    # The server's autograd gradient and the SDK's (-dC/dlogprobs sent as cross-entropy weights) are the same
    # float32 numbers through the same backward, so two Adam steps agree to float32 rounding.
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < 1e-6
    assert max(wa[k].abs().max().item() for k in wa if "lora_B" in k) > 1e-3  # it trained


def test_dpo_loss_by_handle_trains(server: ServerProcess, sc) -> None:  # type: ignore[no-untyped-def]
    handle = sc.create_custom_loss(dpo, {"logprobs": 1, "ref_logprobs": 1, "chosen": 1, "rejected": 1}).result()
    ref_handle = sc.create_custom_loss(mean_logprob, {"logprobs": 1}).result()  # forward only: the reference
    rng = np.random.default_rng(6)
    data = []
    for _ in range(3):
        p, c, r = (rng.integers(5, 200, size=k).tolist() for k in (5, 4, 4))
        seq = p + c + p + r
        d = make_datum(seq)
        n = len(seq) - 1
        chosen = np.zeros(n, np.float32)
        chosen[len(p) - 1 : len(p) + len(c) - 1] = 1
        rejected = np.zeros(n, np.float32)
        rejected[n - len(r) :] = 1
        d.loss_fn_inputs.update(chosen=types.TensorData.from_numpy(chosen),
                                rejected=types.TensorData.from_numpy(rejected))
        data.append(d)
    tc = sc.create_lora_training_client(base_model=server.base_model, rank=8, seed=22).result()
    plain = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]})
             for d in data]
    for d, out in zip(data, tc.forward(plain, "custom", {"loss_id": ref_handle.loss_id}).result().loss_fn_outputs):
        d.loss_fn_inputs["ref_logprobs"] = out["logprobs"]
    losses, margins = [], []
    for _ in range(6):
        out = tc.forward_backward_custom(data, handle).result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        losses.append(out.metrics["loss:sum"])
        margins.append(out.metrics["custom/margin:mean"])
    assert losses[0] == pytest.approx(3 * np.log(2), rel=1e-4)  # policy == reference at the start
    assert losses[-1] < losses[0] * 0.7, losses
    assert margins[-1] > 0 and out.metrics["custom/dpo:sum"] == pytest.approx(out.metrics["loss:sum"], rel=1e-6)


def test_inputs_are_checked_before_queueing(server: ServerProcess, sc, nll_handle) -> None:  # type: ignore[no-untyped-def]
    handle = nll_handle
    tc = sc.create_lora_training_client(base_model=server.base_model, rank=2).result()
    good = _data(np.random.default_rng(7))
    missing = [types.Datum(model_input=d.model_input, loss_fn_inputs={k: v for k, v in d.loss_fn_inputs.items()
                                                                       if k != "scale"}) for d in good]
    # forward() skips the SDK's own input check, so these reach the server as they are
    with pytest.raises(tinker.BadRequestError, match="scale"):
        tc.forward(missing, "custom", {"loss_id": handle.loss_id}).result()
    wrong_rank = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        **d.loss_fn_inputs, "weights": types.TensorData.from_numpy(np.ones((d.model_input.length, 2), np.float32))})
        for d in good]
    with pytest.raises(tinker.BadRequestError, match="rank 2"):
        tc.forward(wrong_rank, "custom", {"loss_id": handle.loss_id}).result()
    with pytest.raises(tinker.BadRequestError, match="loss_id"):
        tc.forward(good, "custom").result()
    with pytest.raises(tinker.NotFoundError):
        tc.forward(good, "custom", {"loss_id": "custom-loss-0000"}).result()
    # the rejected requests consumed their seq_ids; the model goes on
    out = tc.forward_backward_custom(good, handle).result()
    assert np.isfinite(out.metrics["loss:sum"])


def test_size_bomb_fails_only_its_own_job(server: ServerProcess, sc) -> None:  # type: ignore[no-untyped-def]
    def bomb(logprobs):  # type: ignore[no-untyped-def]
        n = logprobs.shape[0]
        big = logprobs.repeat(n * 100000, n * 100000)  # ~10**13 elements if it were allocated
        return big.sum(), {}

    def nan_loss(logprobs):  # type: ignore[no-untyped-def]
        return (logprobs * float("nan")).sum(), {}

    bomb_handle = sc.create_custom_loss(bomb, {"logprobs": 1}).result()
    nan_handle = sc.create_custom_loss(nan_loss, {"logprobs": 1}).result()
    tc = sc.create_lora_training_client(base_model=server.base_model, rank=2).result()
    data = _data(np.random.default_rng(8))
    with pytest.raises(tinker.RequestFailedError, match="exceeds the limit") as e:
        tc.forward_backward_custom(data, bomb_handle).result()
    assert e.value.category == types.RequestErrorCategory.User
    with pytest.raises(tinker.RequestFailedError, match="not finite"):
        tc.forward_backward_custom(data, nan_handle).result()
    assert np.isfinite(tc.forward_backward(batch(), "cross_entropy").result().metrics["loss:sum"])  # it goes on
