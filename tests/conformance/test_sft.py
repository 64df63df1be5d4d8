"""The stock SDK trains a LoRA: an ordinary SFT loop lowers the loss; forward matches an independent PEFT run."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types

from tests.support.peft_check import assert_logprobs_match_peft
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
            metrics = opt.result().metrics or {}
            # the optimization metrics only: no counter a client's metric row would mistake for its own "step"
            assert set(metrics) == {"grad_norm", "grad_clip_coef", "learning_rate"}, metrics
            assert metrics["grad_norm"] > 0 and metrics["learning_rate"] == 5e-3
            losses.append(out.metrics["loss:sum"])
            assert len(out.loss_fn_outputs) == len(data)
        assert losses[-1] < losses[0] * 0.8, losses


def test_forward_logprobs_match_peft(server: ServerProcess) -> None:
    pytest.importorskip("peft")

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
    assert_logprobs_match_peft(server.base_model, folders[0], data, fwd.loss_fn_outputs)


def test_tokenizer_loads_offline_and_lora_targets_follow_config(server: ServerProcess) -> None:
    from safetensors.torch import load_file

    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = sc.create_lora_training_client(
            base_model=server.base_model, rank=3, train_attn=False, train_mlp=True, train_unembed=False
        ).result()
        tok = tc.get_tokenizer()
        assert tok.decode(tok.encode("hello world")) == "hello world"
        path = tc.save_weights_for_sampler("mlp-only").result().path
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    (folder,) = server.data_dir.glob(f"checkpoints/*/{run_id}/{kind}/{name}")
    keys = load_file(str(folder / "adapter_model.safetensors")).keys()
    assert keys and all(any(m in k for m in ("gate_proj", "up_proj", "down_proj")) for k in keys)
    assert all(v.shape[0] == 3 for k, v in load_file(str(folder / "adapter_model.safetensors")).items() if "lora_A" in k)


@pytest.fixture(scope="module")
def chunking_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    srv = ServerProcess(tmp_path_factory.mktemp("chunks"), str(tiny_model_dir),
                        env={"TWINKLE_CLIENT_FWDBWD_MAX_CHUNK_LEN": "2"})
    key = srv.create_key("chunky")
    srv.start()
    yield srv, key
    srv.stop()


def test_chunked_requests_run_in_seq_order(chunking_server) -> None:  # type: ignore[no-untyped-def]
    """7 datums with 2 per chunk: 4 requests sent in parallel, first chunk last; outputs come back in order and
    the gradient is the sum over chunks (same step as one unchunked pass of the same data on the same seed)."""
    srv, key = chunking_server
    rng = np.random.default_rng(5)
    data = [make_datum(rng.integers(5, 200, size=int(rng.integers(4, 12))).tolist()) for _ in range(7)]
    with tinker.ServiceClient(base_url=srv.base_url, api_key=key) as sc:
        a = sc.create_lora_training_client(base_model=srv.base_model, rank=4, seed=9).result()
        fwd = a.forward(data, "cross_entropy").result()
        fb = a.forward_backward(data, "cross_entropy").result()
        a.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after = a.forward(data, "cross_entropy").result()
    assert len(fwd.loss_fn_outputs) == 7 and len(after.loss_fn_outputs) == 7
    for datum, out in zip(data, fwd.loss_fn_outputs):
        assert len(out["logprobs"].tolist()) == datum.model_input.length
    total = -sum(float(np.sum(o["logprobs"].tolist())) for o in fwd.loss_fn_outputs)
    assert fb.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    after_total = -sum(float(np.sum(o["logprobs"].tolist())) for o in after.loss_fn_outputs)
    assert after_total < total  # the summed gradient of all chunks was applied
