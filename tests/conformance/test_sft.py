"""The stock SDK trains a LoRA: an ordinary SFT loop lowers the loss; forward matches an independent PEFT run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.support.server import ServerProcess


def make_datum(tokens: list[int]) -> types.Datum:
    inp, target = tokens[:-1], tokens[1:]
    return types.Datum(
        model_input=types.ModelInput.from_ints(inp),
        loss_fn_inputs={"target_tokens": target, "weights": [1.0] * len(target)},
    )


def batch() -> list[types.Datum]:
    rng = np.random.default_rng(0)
    return [make_datum(rng.integers(5, 200, size=12).tolist()) for _ in range(4)]


def test_sft_loop_lowers_loss(server: ServerProcess) -> None:
    data = batch()
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = sc.create_lora_training_client(base_model=server.base_model, rank=8, seed=1).result()
        losses = []
        for _ in range(30):
            fb = tc.forward_backward(data, "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=5e-3))
            out = fb.result()
            opt.result()
            losses.append(out.metrics["loss:sum"])
            assert len(out.loss_fn_outputs) == len(data)
        assert losses[-1] < losses[0] * 0.8, losses


def test_forward_logprobs_match_peft(server: ServerProcess) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    data = batch()
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = sc.create_lora_training_client(base_model=server.base_model, rank=4, seed=2).result()
        for _ in range(3):  # move B away from zero so the adapter matters
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        fwd = tc.forward(data, "cross_entropy").result()
        path = tc.save_weights_for_sampler("peft-check").result().path
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    folders = list(server.data_dir.glob(f"checkpoints/*/{run_id}/{kind}/{name}"))
    assert len(folders) == 1, folders
    base = AutoModelForCausalLM.from_pretrained(server.base_model, dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base, str(folders[0])).eval()
    for datum, out in zip(data, fwd.loss_fn_outputs):
        ids = torch.tensor([datum.model_input.to_ints()])
        targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist())
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        expected = logp.gather(-1, targets[:, None])[:, 0]
        got = torch.tensor(out["logprobs"].tolist())
        assert torch.allclose(got, expected, atol=1e-4), (got - expected).abs().max()
