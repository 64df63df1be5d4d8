"""The stock tinker SDK against the cluster wiring: gateway (`serve` with TWINKLE_REDIS_URL, no model loaded),
a real Redis, Postgres, and a separate `twinkle-server worker` process. Includes the fault tests: the worker is
killed (SIGKILL) five times mid-training and the final weights and optimizer state still equal an uninterrupted
run's; the gateway is killed and restarted mid-run and the client finishes without errors."""

from __future__ import annotations

import random
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from tests.integration.conftest import fresh_database, running
from tests.support.process import CrashInjector
from tests.support.server import ServerProcess, WorkerProcess
from tests.support.sft import batch, sft

pytest.importorskip("redis")


class Cluster:
    def __init__(self, root: Path, model: str, redis_url: str, database_url: str) -> None:
        self.data_dir = root
        self.env = {
            "TWINKLE_REDIS_URL": redis_url, "TWINKLE_REDIS_PREFIX": f"e2e{uuid.uuid4().hex[:8]}",
            "TWINKLE_DATABASE_URL": database_url, "TWINKLE_WORKER_LEASE_SECONDS": "2",
            "TWINKLE_SNAPSHOT_EVERY_STEPS": "3", "TWINKLE_LONG_POLL_SECONDS": "10",
        }
        self.gateway = ServerProcess(root, model, env=self.env)
        self.worker = WorkerProcess(root, model, env=self.env)
        self.api_key = ""

    def logs(self) -> str:
        return f"--- gateway ---\n{self.gateway.log()}\n--- worker ---\n{self.worker.log()}"


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with fresh_database("twinkle_e2e") as database_url:
        c = Cluster(tmp_path_factory.mktemp("cluster"), str(tiny_model_dir), redis_url, database_url)
        c.api_key = c.gateway.create_key("tenant-a")
        with running(c.gateway, c.worker):
            yield c


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[None]:
    yield
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        print(cluster.logs())


def adapter_state(c: Cluster, tc: tinker.TrainingClient, name: str) -> dict[str, torch.Tensor]:
    path = tc.save_state(name).result().path
    run_id, kind, ckpt = path.removeprefix("tinker://").split("/")
    (folder,) = list(c.data_dir.glob(f"checkpoints/*/{run_id}/{kind}/{ckpt}"))
    state = load_file(str(folder / "adapter_model.safetensors"))
    state.update({f"optim/{k}": v for k, v in load_file(str(folder / "optimizer.safetensors")).items()})
    return state


def test_sdk_trains_through_gateway_redis_and_worker(cluster: Cluster) -> None:
    with tinker.ServiceClient(base_url=cluster.gateway.base_url, api_key=cluster.api_key) as sc:
        caps = sc.get_server_capabilities()
        assert [m.model_name for m in caps.supported_models] == [cluster.gateway.base_model]
        tc = sc.create_lora_training_client(base_model=cluster.gateway.base_model, rank=4, seed=3)
        losses = sft(tc, 12, same_batch=True)
        assert losses[-1] < losses[0] * 0.9, losses
        path = tc.save_weights_for_sampler("e2e").result().path
        assert path.endswith("/sampler_weights/e2e")
        sampler = sc.create_sampling_client(model_path=path)  # the worker's sample lane, through Redis
        prompt = types.ModelInput.from_ints(batch(0)[0].model_input.to_ints()[:4])
        out = sampler.sample(prompt, num_samples=2, sampling_params=types.SamplingParams(max_tokens=5, seed=1)).result()
        assert len(out.sequences) == 2 and all(1 <= len(s.tokens) <= 5 for s in out.sequences)
    assert "loading base model" not in cluster.gateway.log()  # the gateway ran no model
    assert "loading base model" in cluster.worker.log()


def test_retrieve_futures_and_cancel_future_endpoints(cluster: Cluster) -> None:
    headers = {"X-API-Key": cluster.api_key}
    with httpx.Client(base_url=cluster.gateway.base_url, headers=headers, timeout=30) as http:
        body = {"target": {"type": "sampling_session", "sampling_session_id": "nope", "cloned_sampler_id": 0},
                "prev_cursor": 0, "timeout": 0, "retrieved_request_ids": []}
        r = http.post("/api/v1/retrieve_futures", json=body)
        assert r.status_code == 404 and "sampling session nope not found" in r.text, r.text  # not the caller's
        r = http.post("/api/v1/cancel_future", json={"request_id": str(uuid.uuid4())})
        assert r.status_code == 404, r.text
        session_id = http.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        r = http.post("/api/v1/create_model", json={"session_id": session_id, "model_seq_id": 0,
                                                    "base_model": cluster.gateway.base_model,
                                                    "lora_config": {"rank": 2}})
        assert r.status_code == 200, r.text
        request_id = r.json()["request_id"]
        r = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        assert r.status_code == 200 and "model_id" in r.json(), r.text
        r = http.post("/api/v1/cancel_future", json={"request_id": request_id})
        assert r.status_code == 200 and r.json() == {"request_id": request_id, "cancelled": False}, r.text


@pytest.mark.slow
def test_worker_killed_five_times_gives_the_same_weights(cluster: Cluster) -> None:
    steps, kills = 24, 5
    with tinker.ServiceClient(base_url=cluster.gateway.base_url, api_key=cluster.api_key) as sc:
        ref = sc.create_lora_training_client(base_model=cluster.gateway.base_model, rank=4, seed=7)
        sft(ref, steps)
        expected = adapter_state(cluster, ref, "reference")

        rng = random.Random(5)
        crash = CrashInjector(cluster.worker, set(rng.sample(range(1, steps - 2), kills)), rng, max_delay=0.25)
        rebuilt_before = cluster.worker.log().count("rebuilt ")

        tc = sc.create_lora_training_client(base_model=cluster.gateway.base_model, rank=4, seed=7)
        sft(tc, steps, during=crash)
        got = adapter_state(cluster, tc, "crashed")
    crash.join()
    cluster.worker.wait_ready()
    assert len(crash.killers) == kills
    # A successor that got jobs before it was killed rebuilt the model (one killed right after it started may not)
    rebuilt = cluster.worker.log().count("rebuilt ") - rebuilt_before
    assert 1 <= rebuilt <= kills, rebuilt
    assert got.keys() == expected.keys()
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    assert worst < 1e-6, worst
    assert any(v.abs().max().item() > 0 for k, v in got.items() if "lora_B" in k)  # it trained


@pytest.mark.slow
def test_gateway_restart_during_a_run(cluster: Cluster) -> None:
    with tinker.ServiceClient(base_url=cluster.gateway.base_url, api_key=cluster.api_key) as sc:
        tc = sc.create_lora_training_client(base_model=cluster.gateway.base_model, rank=4, seed=2)
        restarts: list[threading.Thread] = []

        def restart(step: int) -> None:
            if step == 3:
                cluster.gateway.kill()
                t = threading.Thread(target=cluster.gateway.start)
                t.start()
                restarts.append(t)

        losses = sft(tc, 10, during=restart)
        assert len(losses) == 10 and all(np.isfinite(losses))
        for t in restarts:
            t.join()
        assert tc.save_weights_for_sampler("after-restart").result().path.endswith("after-restart")
