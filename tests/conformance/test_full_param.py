"""Full-parameter training on a lease, end to end (native protocol over HTTP, as twinkle_client sends it): where the
operator offers it, `add_adapter_to_model(config=None)` trains a private copy of the base model (loss falls), a
LoRA tenant trains beside it undisturbed, a full checkpoint resumes to the same loss and can be sampled, a second
full-parameter run waits for the lease (Tinker create_model without lora_config: try_again, paused_capacity) and
starts once the first run's client is gone (its session timed out: the lease is reclaimed); where it is not offered, the request is a 400 saying so."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.native_http import Native, rows, setup_adapter
from tests.support.server import ServerProcess


@pytest.fixture(scope="module")
def leased(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("full-param"), str(tiny_model_dir),
                        env={"TWINKLE_FULL_PARAM_MODELS": "*", "TWINKLE_FULL_PARAM_RUNS_PER_MODEL": "1",
                             "TWINKLE_SESSION_TIMEOUT_SECONDS": "3", "TWINKLE_MAINTENANCE_INTERVAL_SECONDS": "1"})
    srv.api_key_a = srv.create_key("tenant-a")  # type: ignore[attr-defined]
    srv.api_key_b = srv.create_key("tenant-b")  # type: ignore[attr-defined]
    srv.start()
    yield srv
    srv.stop()


def _full_adapter(c: Native, name: str = "full") -> None:
    assert c.ok("create") == {"status": "ok"}
    assert c.ok("add_adapter_to_model", adapter_name=name, config=None)["adapter_name"] == name
    c.ok("set_loss", loss_cls="CrossEntropyLoss", adapter_name=name)
    c.ok("set_optimizer", optimizer_cls="AdamW", adapter_name=name, lr=1e-3)


class _Beat(threading.Thread):
    """A client's heartbeat for its session (the session timeout is 3 s here)."""

    def __init__(self, c: Native) -> None:
        super().__init__(daemon=True)
        self.c, self.stopped = c, threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.5):
            self.c.http.post("/twinkle/session_heartbeat", json={"session_id": self.c.session})


def test_full_param_run_trains_beside_lora_resumes_samples_and_holds_the_lease(leased: ServerProcess) -> None:
    a = Native(leased, leased.api_key_a)  # type: ignore[attr-defined]
    b = Native(leased, leased.api_key_b)  # type: ignore[attr-defined]
    beats = [_Beat(a), _Beat(b)]
    for t in beats:
        t.start()
    try:
        _full_adapter(a)
        setup_adapter(b, gas=1)
        data = rows(3)
        losses, lora = [], []
        for _ in range(4):
            losses.append(a.ok("forward_backward", inputs=data, adapter_name="full")["result"]["loss"])
            a.ok("clip_grad_and_step", adapter_name="full")
            lora.append(b.ok("forward_backward", inputs=data, adapter_name="default")["result"]["loss"])
            b.ok("clip_grad_and_step", adapter_name="default")
        assert losses[-1] < losses[0] and lora[-1] < lora[0], (losses, lora)
        assert "full-parameter training" in a.ok("get_train_configs", adapter_name="full")["result"]

        path = a.ok("save", name="full-1", save_optimizer=True, adapter_name="full")["twinkle_path"]
        r = a.http.post(f"/sampler/{a.model}/twinkle/sample", json={
            "inputs": [data[0]], "sampling_params": {"max_tokens": 4, "temperature": 0.0, "logprobs": 1},
            "adapter_name": "", "num_samples": 1, "adapter_uri": path})
        assert r.status_code == 200, r.text
        assert 1 <= len(r.json()["samples"][0]["sequences"][0]["tokens"]) <= 4

        # a second full-parameter run (tenant B, Tinker protocol) waits for the lease
        headers = {"X-API-Key": leased.api_key_b}  # type: ignore[attr-defined]
        api = f"{leased.base_url}/api/v1"
        sess = httpx.post(f"{api}/create_session", headers=headers, json={
            "tags": [], "user_metadata": None, "sdk_version": "0.38.0", "type": "create_session"}).json()["session_id"]
        created = httpx.post(f"{api}/create_model", headers=headers, json={
            "session_id": sess, "model_seq_id": 0, "base_model": leased.base_model, "lora_config": None,
            "type": "create_model"})
        assert created.status_code == 200, created.text
        future = httpx.post(f"{api}/retrieve_future", headers=headers, timeout=60,
                            json={"request_id": created.json()["request_id"]}).json()
        assert future["type"] == "try_again" and future["queue_state"] == "paused_capacity", future
        assert "full-parameter lease" in future["queue_state_reason"], future

        # tenant A's client goes away: its session times out, the lease is reclaimed, B's run starts
        beats[0].stopped.set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            httpx.post(f"{api}/session_heartbeat", headers=headers, json={"session_id": sess, "type": "session_heartbeat"})
            future = httpx.post(f"{api}/retrieve_future", headers=headers, timeout=60,
                                json={"request_id": created.json()["request_id"]}).json()
            if future.get("type") != "try_again":
                break
        assert future.get("type") != "try_again" and "error" not in future, future
    finally:
        for t in beats:
            t.stopped.set()


def test_a_resumed_full_checkpoint_gives_the_same_loss(leased: ServerProcess) -> None:
    a = Native(leased, leased.api_key_a)  # type: ignore[attr-defined]
    beat = _Beat(a)
    beat.start()
    try:
        _full_adapter(a)  # waits for the lease if the previous test's run still holds it
        data = rows(5)
        for _ in range(2):
            a.ok("forward_backward", inputs=data, adapter_name="full")
            a.ok("clip_grad_and_step", adapter_name="full")
        path = a.ok("save", name="full-2", save_optimizer=True, adapter_name="full")["twinkle_path"]
        ref = a.ok("forward_only", inputs=data, adapter_name="full")["result"]["loss"]
        a.ok("load", name=path, adapter_name="full", load_optimizer=True)
        assert a.ok("forward_only", inputs=data, adapter_name="full")["result"]["loss"] == pytest.approx(ref, rel=1e-6)
    finally:
        beat.stopped.set()


def test_full_param_is_a_400_where_not_offered(server: ServerProcess) -> None:
    c = Native(server, server.api_key_a)  # type: ignore[attr-defined]
    assert c.ok("create") == {"status": "ok"}
    r = c.op("add_adapter_to_model", adapter_name="full", config=None)
    assert r.status_code == 400 and "not enabled for base model" in r.json()["detail"], r.text
