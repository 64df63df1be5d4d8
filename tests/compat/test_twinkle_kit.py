"""tinker 0.16.1 under twinkle-kit 0.5.1's patch (what `twinkle.init_tinker_client()` applies): Bearer and routing
headers on every request, twinkle:// checkpoint paths, create_full_training_client. Runs after test_tinker016.py (the
patch changes the SDK for the rest of the process); skipped unless twinkle_client is installed beside tinker 0.16.1."""

from __future__ import annotations

import importlib.util

import pytest
import tinker
from tinker import types

from tests.compat.test_tinker016 import batch
from tests.support.server import ServerProcess

pytestmark = pytest.mark.skipif(
    tinker.__version__ != "0.16.1" or importlib.util.find_spec("twinkle_client") is None,
    reason="needs tinker 0.16.1 with twinkle-kit's client (scripts/test_sdk_compat.sh installs both)")


def test_training_and_sampling_under_twinkle_kits_patch(compat_server: ServerProcess) -> None:
    # twinkle.init_tinker_client() is this call after a `requires("tinker")` check (whose module imports torch)
    from twinkle_client.utils.patch_tinker import patch_tinker

    patch_tinker()
    srv = compat_server
    # the patched client adds Authorization / Twinkle-Authorization: Bearer and the Ray Serve routing headers
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key_a)  # type: ignore[attr-defined]
    tc = sc.create_lora_training_client(base_model=srv.base_model, rank=8, seed=2)
    data = batch(5)
    losses = _train(tc, data, lr=2e-2, steps=6)
    assert losses[-1] < losses[0] * 0.9, losses

    path = tc.save_weights_for_sampler("under-twinkle").result().path
    sampling = sc.create_sampling_client(model_path=path.replace("tinker://", "twinkle://"))
    resp = sampling.sample(prompt=types.ModelInput.from_ints([5, 6, 7]), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=4)).result()
    assert len(resp.sequences) == 1 and 1 <= len(resp.sequences[0].tokens) <= 4

    state = tc.save_state("under-twinkle").result().path
    resumed = sc.create_training_client_from_state(state.replace("tinker://", "twinkle://"))
    assert resumed.forward(data, "cross_entropy").result().metrics["loss:sum"] > 0

    with pytest.raises(tinker.BadRequestError, match="full-parameter training is not enabled for base model"):
        sc.create_full_training_client(base_model=srv.base_model)  # type: ignore[attr-defined]



def test_full_training_client_where_the_operator_offers_it(full_param_server: ServerProcess) -> None:
    """twinkle-kit's create_full_training_client (create_model without a LoRA config) gets a full-parameter run: its
    loss falls, get_info says it is no LoRA, its state saves, and its weights sample."""
    from twinkle_client.utils.patch_tinker import patch_tinker

    patch_tinker()
    srv = full_param_server
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key_a)  # type: ignore[attr-defined]
    tc = sc.create_full_training_client(base_model=srv.base_model)  # type: ignore[attr-defined]
    info = tc.get_info()
    assert info.is_lora is False and info.lora_rank is None, info
    losses = _train(tc, batch(5), lr=1e-3, steps=4)
    assert losses[-1] < losses[0] * 0.9, losses
    assert tc.save_state("full-run").result().path.startswith("tinker://")
    path = tc.save_weights_for_sampler("full-run-sampler").result().path
    sampling = sc.create_sampling_client(model_path=path)
    resp = sampling.sample(prompt=types.ModelInput.from_ints([5, 6, 7]), num_samples=1,
                           sampling_params=types.SamplingParams(max_tokens=4)).result()
    assert len(resp.sequences) == 1 and 1 <= len(resp.sequences[0].tokens) <= 4


def _train(tc: tinker.TrainingClient, data: list[types.Datum], lr: float, steps: int) -> list[float]:
    """cross_entropy + Adam steps; the loss of each."""
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=lr)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses
