"""Server-side custom losses in the cluster wiring (gateway + Redis + Postgres + a worker process): the loss is
stored in Postgres (migration 0005), travels inside the jobs through Redis, and a worker killed mid-run rebuilds
the model by replaying those jobs without any lookup: the final weights equal an uninterrupted run's."""

from __future__ import annotations

import random

import pytest
import tinker
import torch

from tests.integration.test_cluster_sdk import (  # noqa: F401
    Cluster,
    _logs_on_failure,
    adapter_state,
    cluster,
)
from tests.support.process import CrashInjector
from tests.support.sft import sft

pytest.importorskip("redis")


def shaped_nll(logprobs, weights):  # type: ignore[no-untyped-def]
    nll = -(logprobs * weights).sum()
    return nll + 0.05 * torch.square(logprobs).mean(), {"custom/nll:sum": nll}


@pytest.mark.slow
def test_custom_loss_survives_worker_kills(cluster: Cluster) -> None:  # noqa: F811
    steps, kills = 10, 2
    with tinker.ServiceClient(base_url=cluster.gateway.base_url, api_key=cluster.api_key) as sc:
        handle = sc.create_custom_loss(shaped_nll, {"logprobs": 1, "weights": 1}).result()
        assert handle.loss_id is not None
        ref = sc.create_lora_training_client(base_model=cluster.gateway.base_model, rank=4, seed=8)
        ref_losses = sft(ref, steps, custom_loss=handle)
        expected = adapter_state(cluster, ref, "custom-reference")

        rng = random.Random(6)
        crash = CrashInjector(cluster.worker, set(rng.sample(range(1, steps - 2), kills)), rng, max_delay=0.2)
        rebuilt_before = cluster.worker.log().count("rebuilt ")

        tc = sc.create_lora_training_client(base_model=cluster.gateway.base_model, rank=4, seed=8)
        losses = sft(tc, steps, during=crash, custom_loss=handle)
        got = adapter_state(cluster, tc, "custom-crashed")
    crash.join()
    cluster.worker.wait_ready()
    assert 1 <= cluster.worker.log().count("rebuilt ") - rebuilt_before <= kills  # the custom-loss jobs were replayed
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert got.keys() == expected.keys()
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst < 1e-6, worst
    assert any(v.abs().max().item() > 0 for k, v in got.items() if "lora_B" in k)  # it trained
