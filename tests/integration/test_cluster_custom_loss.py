"""Server-side custom losses in the cluster wiring (gateway + Redis + Postgres + a worker process): the loss is
stored in Postgres (migration 0005), travels inside the jobs through Redis, and a worker killed mid-run rebuilds
the model by replaying those jobs without any lookup: the final weights equal an uninterrupted run's."""

from __future__ import annotations

import random
import threading

import pytest
import tinker
import torch
from tinker import types

from tests.integration.test_cluster_sdk import Cluster, _logs_on_failure, adapter_state, cluster  # noqa: F401
from tests.support.sft import batch

pytest.importorskip("redis")


def shaped_nll(logprobs, weights):  # type: ignore[no-untyped-def]
    nll = -(logprobs * weights).sum()
    return nll + 0.05 * torch.square(logprobs).mean(), {"custom/nll:sum": nll}


def _train(tc: tinker.TrainingClient, handle, steps: int, during=lambda _: None) -> list[float]:  # type: ignore[no-untyped-def]
    losses = []
    for step in range(steps):
        fb = tc.forward_backward_custom(batch(step), handle)
        opt = tc.optim_step(types.AdamParams(learning_rate=2e-2))
        during(step)
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


@pytest.mark.slow
def test_custom_loss_survives_worker_kills(cluster: Cluster) -> None:  # noqa: F811
    steps, kills = 10, 2
    with tinker.ServiceClient(base_url=cluster.gateway.base_url, api_key=cluster.api_key) as sc:
        handle = sc.create_custom_loss(shaped_nll, {"logprobs": 1, "weights": 1}).result()
        assert handle.loss_id is not None
        ref = sc.create_lora_training_client(base_model=cluster.gateway.base_model, rank=4, seed=8)
        ref_losses = _train(ref, handle, steps)
        expected = adapter_state(cluster, ref, "custom-reference")

        rng = random.Random(6)
        kill_steps = set(rng.sample(range(1, steps - 2), kills))
        killers: list[threading.Thread] = []
        rebuilt_before = cluster.worker.log().count("rebuilt ")

        def crash(step: int) -> None:
            if step not in kill_steps:
                return
            for t in killers:
                t.join()
            cluster.worker.wait_ready()

            def kill_later(delay: float) -> None:
                threading.Event().wait(delay)
                cluster.worker.kill()
                cluster.worker.start(wait=False)

            t = threading.Thread(target=kill_later, args=(rng.uniform(0.0, 0.2),))
            t.start()
            killers.append(t)

        tc = sc.create_lora_training_client(base_model=cluster.gateway.base_model, rank=4, seed=8)
        losses = _train(tc, handle, steps, during=crash)
        got = adapter_state(cluster, tc, "custom-crashed")
    for t in killers:
        t.join()
    cluster.worker.wait_ready()
    assert 1 <= cluster.worker.log().count("rebuilt ") - rebuilt_before <= kills  # the custom-loss jobs were replayed
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert got.keys() == expected.keys()
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst < 1e-6, worst
    assert any(v.abs().max().item() > 0 for k, v in got.items() if "lora_B" in k)  # it trained
