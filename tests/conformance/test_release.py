"""Models of ended sessions are released (server/services/release.py): the stock SDK's training client of a
closed ServiceClient gets 410, the worker frees the adapter, and a saved state brings the run back exactly. The
session's custom losses are capped and go with it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.conformance.test_custom_loss_http import _body, _graph, _post, _session
from tests.conformance.test_sft import batch
from tests.support.server import ServerProcess


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    s = ServerProcess(tmp_path_factory.mktemp("release-server"), str(tiny_model_dir),
                      env={"TWINKLE_MAINTENANCE_INTERVAL_SECONDS": "0.5", "TWINKLE_MAX_CUSTOM_LOSSES_PER_SESSION": "2"})
    s.api_key = s.create_key("tenant-r")  # type: ignore[attr-defined]
    s.start()
    yield s
    s.stop()


def forward_loss(tc: tinker.TrainingClient, data: list[types.Datum]) -> float:
    return float(tc.forward(data, "cross_entropy").result().metrics["loss:sum"])


def test_a_finished_sessions_model_is_released_and_its_saved_state_brings_it_back(srv: ServerProcess) -> None:
    key: str = srv.api_key  # type: ignore[attr-defined]
    data = batch()
    with tinker.ServiceClient(base_url=srv.base_url, api_key=key) as sc:
        tc = sc.create_lora_training_client(base_model=srv.base_model, rank=4, seed=7).result()
        for _ in range(3):
            tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = tc.save_state("before-release").result().path
        trained = forward_loss(tc, data)
        model_id = tc.model_id
    # Leaving the `with` finished the session; the maintenance loop (every 0.5 s here) releases its model. Polled
    # with get_info, which queues nothing: a training request accepted before the release would hold it back.
    headers = {"X-API-Key": key}
    deadline = time.monotonic() + 60
    while True:
        r = httpx.post(f"{srv.base_url}/api/v1/get_info", json={"model_id": model_id}, headers=headers)
        if r.status_code == 410 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert r.status_code == 410, r.text
    assert "released when its session ended" in r.text
    body = {"model_id": model_id, "seq_id": 100, "adam_params": {"learning_rate": 1e-3}}
    r = httpx.post(f"{srv.base_url}/api/v1/optim_step", json=body, headers=headers)
    assert r.status_code == 410, r.text  # nothing more is queued for it
    deadline = time.monotonic() + 60
    while f"released {model_id}" not in srv.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert f"released {model_id}" in srv.log()  # the worker dropped the adapter and its recovery state

    with tinker.ServiceClient(base_url=srv.base_url, api_key=key) as sc:
        restored = sc.create_training_client_from_state(path).result()
        assert abs(forward_loss(restored, data) - trained) <= 1e-6 * abs(trained)
        tc = sc.create_lora_training_client(base_model=srv.base_model, rank=4, seed=8).result()  # a live session's model
        tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        time.sleep(1.5)  # several maintenance rounds: a live session's model is never released
        assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] > 0


def test_custom_losses_are_capped_per_session_and_dropped_when_it_ends(srv: ServerProcess) -> None:
    key: str = srv.api_key  # type: ignore[attr-defined]
    session = _session(srv, key)
    first, second = (_post(srv, key, "create_custom_loss", _body(session, _graph(), seq=i)) for i in (1, 2))
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    third = _post(srv, key, "create_custom_loss", _body(session, _graph(), seq=3))
    assert third.status_code == 400 and "limit" in third.json()["detail"], third.text
    retry = _post(srv, key, "create_custom_loss", _body(session, _graph(), seq=1))  # a retry is no new loss
    assert retry.status_code == 200 and retry.json()["request_id"] == first.json()["request_id"]
    loss_id = first.json()["request_id"]
    assert _post(srv, key, "retrieve_future", {"request_id": loss_id}).status_code == 200
    assert _post(srv, key, f"sessions/{session}/finish", {"reason": {"type": "success"}}).status_code == 200
    deadline = time.monotonic() + 30
    while _post(srv, key, "retrieve_future", {"request_id": loss_id}).status_code != 404:
        assert time.monotonic() < deadline, "the ended session's custom losses were not dropped"
        time.sleep(0.3)


def test_finishing_a_session_releases_its_models_at_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    """No maintenance round in sight (one an hour): the release comes from finish_session itself."""
    s = ServerProcess(tmp_path, str(tiny_model_dir), env={"TWINKLE_MAINTENANCE_INTERVAL_SECONDS": "3600"})
    key = s.create_key("tenant-f")
    s.start()
    try:
        with tinker.ServiceClient(base_url=s.base_url, api_key=key) as sc:
            tc = sc.create_lora_training_client(base_model=s.base_model, rank=4, seed=1).result()
            tc.forward_backward(batch(), "cross_entropy").result()
            model_id = tc.model_id
        deadline = time.monotonic() + 10
        while True:
            r = httpx.post(f"{s.base_url}/api/v1/get_info", json={"model_id": model_id}, headers={"X-API-Key": key})
            if r.status_code == 410 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.status_code == 410 and "released when its session ended" in r.text, r.text
    finally:
        s.stop()
