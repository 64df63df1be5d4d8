"""save_state -> a new training client from that state (with optimizer) continues exactly like an uninterrupted run."""

from __future__ import annotations

import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from tests.conformance.test_sft import batch
from tests.support.server import ServerProcess


def _weights(server: ServerProcess, path: str) -> dict[str, torch.Tensor]:
    run_id, kind, name = path.removeprefix("tinker://").split("/")
    (folder,) = server.data_dir.glob(f"checkpoints/*/{run_id}/{kind}/{name}")
    return load_file(str(folder / "adapter_model.safetensors"))


def test_resume_with_optimizer_matches_uninterrupted(server: ServerProcess) -> None:
    data = batch()
    adam = types.AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1.0)
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = sc.create_lora_training_client(base_model=server.base_model, rank=4, seed=3).result()
        for _ in range(3):
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(adam).result()
        state_path = tc.save_state("mid").result().path
        assert state_path.endswith("/weights/mid")
        tc.forward_backward(data, "cross_entropy").result()
        tc.optim_step(adam).result()
        uninterrupted = tc.save_weights_for_sampler("uninterrupted").result().path

        resumed = sc.create_training_client_from_state_with_optimizer(state_path).result()
        resumed.forward_backward(data, "cross_entropy").result()
        resumed.optim_step(adam).result()
        resumed_path = resumed.save_weights_for_sampler("resumed").result().path

        # weights only (fresh optimizer state) must differ: the check above is not vacuous
        fresh = sc.create_training_client_from_state(state_path).result()
        fresh.forward_backward(data, "cross_entropy").result()
        fresh.optim_step(adam).result()
        fresh_path = fresh.save_weights_for_sampler("fresh").result().path

    a, b, c = _weights(server, uninterrupted), _weights(server, resumed_path), _weights(server, fresh_path)
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-6
    assert max((a[k] - c[k]).abs().max().item() for k in a) > 1e-4


def test_save_state_name_conflict_and_bad_names(server: ServerProcess) -> None:
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = sc.create_lora_training_client(base_model=server.base_model, rank=2).result()
        tc.save_state("dup").result()
        try:
            tc.save_state("dup").result()
            raise AssertionError("a second save_state with the same name must fail")
        except tinker.BadRequestError as e:
            assert "already exists" in str(e.body)
        try:
            tc.save_state("../escape").result()
            raise AssertionError("a name with a slash must be rejected")
        except tinker.BadRequestError as e:
            assert "must match" in str(e.body)
        # the model keeps working after rejected requests (their seq_ids were consumed, not left as gaps)
        out = tc.forward_backward(batch(), "cross_entropy").result()
        assert "loss:sum" in out.metrics
