"""Ephemeral sampler weights are reclaimed: once their client session has finished, files and session are gone."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.support.server import ServerProcess


@pytest.fixture(scope="module")
def quick_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("reclaim"), str(tiny_model_dir),
                        env={"TWINKLE_MAINTENANCE_INTERVAL_SECONDS": "0.5"})
    srv.api_key_a = srv.create_key("tenant-a")  # type: ignore[attr-defined]
    srv.start()
    yield srv
    srv.stop()


def test_ephemeral_weights_go_when_the_session_ends(quick_server: ServerProcess) -> None:
    srv = quick_server
    with tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key_a) as sc:  # type: ignore[attr-defined]
        tc = sc.create_lora_training_client(base_model=srv.base_model, rank=4, seed=1).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        out = sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=2)).result()
        assert len(out.sequences[0].tokens) == 2
        sid = sampler._sampling_session_id
        folders = list(srv.data_dir.glob("checkpoints/*/*/ephemeral/*"))
        assert len(folders) == 1 and (folders[0] / "adapter_model.safetensors").exists()
        time.sleep(1.5)  # a maintenance round runs while the session lives: nothing goes
        assert folders[0].exists()
    deadline = time.monotonic() + 20
    while folders[0].exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not folders[0].exists()
    r = httpx.get(f"{srv.base_url}/api/v1/samplers/{sid}", headers={"X-API-Key": srv.api_key_a})  # type: ignore[attr-defined]
    assert r.status_code == 404
