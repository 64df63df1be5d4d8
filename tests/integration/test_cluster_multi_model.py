"""Several base models in the cluster wiring: a gateway (no model loaded, TWINKLE_REDIS_URL) and one
`twinkle-server worker` serving two tiny models under their served names (real Redis and Postgres). The stock SDK
lists both, trains on each (loss falls on each model's own vocabulary), and a model nobody serves is a 404 that names
the served ones."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.conformance.test_multi_model import _batch
from tests.integration.conftest import fresh_database, running
from tests.support.server import ServerProcess, WorkerProcess
from tests.support.tiny_model import build_tiny_model

pytest.importorskip("redis")
NAMES = ("tiny-a", "tiny-b")


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, redis_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("cluster-mm")
    second = build_tiny_model(root / "tiny-b", seed=7, vocab_size=320, num_attention_heads=2, num_key_value_heads=1)
    with fresh_database("twinkle_mm") as database_url:
        env = {"TWINKLE_REDIS_URL": redis_url, "TWINKLE_REDIS_PREFIX": f"mm{uuid.uuid4().hex[:8]}",
               "TWINKLE_DATABASE_URL": database_url, "TWINKLE_LONG_POLL_SECONDS": "10"}
        names = ("--served-model-name", NAMES[0], "--base-model", str(second), "--served-model-name", NAMES[1])
        gateway = ServerProcess(root, str(tiny_model_dir), env=env, args=names)
        worker = WorkerProcess(root, str(tiny_model_dir), env=env, args=names)
        gateway.api_key_a = gateway.create_key("tenant-a")  # type: ignore[attr-defined]
        gateway.vocab = {NAMES[0]: 384, NAMES[1]: 320}  # type: ignore[attr-defined]
        with running(gateway, worker):
            yield gateway


def test_one_worker_serves_two_models_each_trains(cluster: ServerProcess) -> None:
    key = cluster.api_key_a  # type: ignore[attr-defined]
    with tinker.ServiceClient(base_url=cluster.base_url, api_key=key) as sc:
        caps = tinker.RestClient(base_url=cluster.base_url, api_key=key).get_server_capabilities().result()
        assert sorted(m.model_name for m in caps.supported_models) == list(NAMES)
        for name in NAMES:
            tc = sc.create_lora_training_client(base_model=name, rank=4, seed=3).result()
            data = _batch(cluster.vocab[name], seed=1)  # type: ignore[attr-defined]
            losses = []
            for _ in range(5):
                fb = tc.forward_backward(data, "cross_entropy")
                tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
                losses.append(fb.result().metrics["loss:sum"])
            assert losses[-1] < losses[0] * 0.95, (name, losses)
    api, headers = f"{cluster.base_url}/api/v1", {"X-API-Key": key}
    session = httpx.post(f"{api}/create_session", headers=headers, json={
        "tags": [], "user_metadata": None, "sdk_version": "0.38.0", "type": "create_session"}).json()["session_id"]
    r = httpx.post(f"{api}/create_model", headers=headers, json={
        "session_id": session, "model_seq_id": 0, "base_model": "not-served", "lora_config": {"rank": 4},
        "type": "create_model"})
    assert r.status_code == 404 and "tiny-a" in r.text and "tiny-b" in r.text, r.text
