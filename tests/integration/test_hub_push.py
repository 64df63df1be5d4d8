"""Hub push end to end: the server (a subprocess) uploads checkpoints with huggingface_hub to a local fake Hub on a
free port (TWINKLE_HF_ENDPOINT), in the background, with a status the client polls on the native API.

The server gets HF_HUB_OFFLINE=0 (it must reach the fake Hub) and HF_HUB_DISABLE_XET=1 (the fake speaks the LFS
upload protocol, not Xet).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest
import tinker

from tests.conformance.rest_support import trained_client
from tests.integration.fake_hub import FakeHub
from tests.support.server import ServerProcess

TOKEN_A = "hf_tenantA_0123456789abcdefSECRET"


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    with FakeHub({TOKEN_A}) as h:
        yield h


@pytest.fixture(scope="module")
def srv(hub: FakeHub, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {"TWINKLE_HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1",
           "TWINKLE_MAINTENANCE_INTERVAL_SECONDS": "1"}
    s = ServerProcess(tmp_path_factory.mktemp("hub-server"), str(tiny_model_dir), env=env)
    s.api_key_a = s.create_key("tenant-a")  # type: ignore[attr-defined]
    s.api_key_b = s.create_key("tenant-b")  # type: ignore[attr-defined]
    s.start()
    yield s
    s.stop()


def native(srv: ServerProcess, method: str, path: str, key: str = "a", **kw: Any) -> httpx.Response:
    headers = {"X-API-Key": getattr(srv, f"api_key_{key}")}
    return httpx.request(method, f"{srv.base_url}/native/v1{path}", headers=headers, timeout=30, **kw)


def wait_push(srv: ServerProcess, push_id: str, key: str = "a", timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        body = native(srv, "GET", f"/pushes/{push_id}", key).json()
        if body["status"] in ("succeeded", "failed"):
            return body
        time.sleep(0.2)
    raise AssertionError(f"push {push_id} did not finish: {body}")


def folder_files(srv: ServerProcess, tinker_path: str) -> dict[str, bytes]:
    run_id, kind, name = tinker_path.removeprefix("tinker://").split("/")
    (folder,) = srv.data_dir.glob(f"checkpoints/*/{run_id}/{kind}/{name}")
    return {f.relative_to(folder).as_posix(): f.read_bytes() for f in folder.rglob("*") if f.is_file()}


def test_push_is_private_by_default_and_token_stays_secret(srv: ServerProcess, hub: FakeHub) -> None:
    with tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key_a) as sc:  # type: ignore[attr-defined]
        path = trained_client(sc, srv.base_model).save_weights_for_sampler("pushme").result().path
    assert native(srv, "POST", "/checkpoints/push", json={"tinker_path": path, "repo_id": "alice/lora"}).status_code == 400
    stored = native(srv, "PUT", "/hub/tokens/huggingface", json={"token": TOKEN_A})
    assert stored.status_code == 200 and stored.json()["configured"] and TOKEN_A not in stored.text
    assert TOKEN_A not in native(srv, "GET", "/hub/tokens/huggingface").text

    started = native(srv, "POST", "/checkpoints/push", json={"tinker_path": path, "repo_id": "alice/lora"})
    assert started.status_code == 202 and started.json()["status"] in ("queued", "running", "succeeded")
    done = wait_push(srv, started.json()["push_id"])
    assert done["status"] == "succeeded", done
    assert done["url"].startswith(f"{hub.url}/alice/lora/commit/") and done["private"]

    repo = hub.repos["alice/lora"]
    assert repo.visibility == "private"
    expected = folder_files(srv, path)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(expected)
    assert repo.files == expected
    size = sum(len(b) for b in expected.values())
    assert (done["bytes_done"], done["bytes_total"]) == (size, size)  # the upload's progress, complete
    assert f"Bearer {TOKEN_A}" in hub.seen_auth
    assert TOKEN_A not in srv.log()
    assert TOKEN_A.encode() not in (srv.data_dir / "twinkle.db").read_bytes()  # encrypted at rest


def test_pusher_reports_progress_as_it_uploads(hub: FakeHub, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The pusher itself (workers/checkpoints/hub.py) on a two-file checkpoint: progress starts at 0, never goes
    back, passes through the first file's size and ends at the total, which is the files' size."""
    from huggingface_hub import constants
    from pydantic import SecretStr

    from api_schemas.hub import HubPushSpec
    from jobqueue.storage import CheckpointStorage
    from workers.checkpoints.hub import push

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    store = CheckpointStorage(tmp_path)
    folder = tmp_path / "t" / "run" / "sampler_weights" / "a"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_bytes(b'{"r": 8}')
    (folder / "adapter_model.safetensors").write_bytes(bytes(range(256)) * 4096)
    seen: list[tuple[int, int]] = []
    spec = HubPushSpec(provider="huggingface", endpoint=hub.url, token=SecretStr(TOKEN_A), repo_id="alice/progress",
                       storage_key="t/run/sampler_weights/a", commit_message="c")
    push(spec, store, lambda done, total: seen.append((done, total)))
    total = 8 + 256 * 4096
    assert seen[0] == (0, total) and seen[-1] == (total, total)
    assert all(a[0] <= b[0] and b[1] == total for a, b in zip(seen, seen[1:]))
    assert {done for done, _ in seen} & {8, 256 * 4096}  # a point after the first file uploaded
    assert hub.repos["alice/progress"].files["adapter_model.safetensors"] == bytes(range(256)) * 4096


def test_failures_are_reported_and_tenants_isolated(srv: ServerProcess, hub: FakeHub) -> None:
    bad_token = "hf_tenantB_wrong_token_999"
    with tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key_b) as sc:  # type: ignore[attr-defined]
        b_path = trained_client(sc, srv.base_model, steps=0).save_weights_for_sampler("b").result().path
    assert native(srv, "PUT", "/hub/tokens/huggingface", "b", json={"token": bad_token}).status_code == 200
    started = native(srv, "POST", "/checkpoints/push", "b", json={"tinker_path": b_path, "repo_id": "bob/lora"})
    done = wait_push(srv, started.json()["push_id"], "b")
    assert done["status"] == "failed" and "401" in done["error"] and bad_token not in done["error"]
    assert "bob/lora" not in hub.repos

    a_paths = [c.tinker_path for c in tinker.RestClient(base_url=srv.base_url, api_key=srv.api_key_a)  # type: ignore[attr-defined]
               .list_user_checkpoints().result().checkpoints]
    assert a_paths
    stolen = native(srv, "POST", "/checkpoints/push", "b", json={"tinker_path": a_paths[0], "repo_id": "bob/stolen"})
    assert stolen.status_code == 404
    assert native(srv, "GET", f"/pushes/{started.json()['push_id']}", "a").status_code == 404
    assert native(srv, "GET", "/hub/tokens/modelscope", "b").json()["configured"] is False


def test_auto_push_when_the_run_finishes(srv: ServerProcess, hub: FakeHub) -> None:
    assert native(srv, "PUT", "/hub/tokens/huggingface", json={"token": TOKEN_A}).status_code == 200
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key_a)  # type: ignore[attr-defined]
    tc = trained_client(sc, srv.base_model)
    rule = native(srv, "PUT", f"/training_runs/{tc.model_id}/auto_push",
                  json={"repo_id": "alice/auto", "private": False})
    assert rule.status_code == 200 and rule.json()["push_id"] is None
    assert native(srv, "PUT", f"/training_runs/{tc.model_id}/auto_push", "b",
                  json={"repo_id": "bob/x"}).status_code == 404
    tc.save_state("early").result()
    path = tc.save_weights_for_sampler("final").result().path
    time.sleep(2.5)  # several maintenance rounds: nothing is pushed while the session is live
    assert native(srv, "GET", f"/training_runs/{tc.model_id}/auto_push").json()["push_id"] is None
    sc.close("success").result()

    deadline = time.monotonic() + 30
    while (push_id := native(srv, "GET", f"/training_runs/{tc.model_id}/auto_push").json()["push_id"]) is None:
        assert time.monotonic() < deadline, "auto-push never started"
        time.sleep(0.3)
    done = wait_push(srv, push_id)
    assert done["status"] == "succeeded" and done["trigger"] == "auto" and done["tinker_path"] == path, done
    assert hub.repos["alice/auto"].visibility == "public"
    assert hub.repos["alice/auto"].files == folder_files(srv, path)


def test_native_upload_to_hub_and_status(srv: ServerProcess, hub: FakeHub) -> None:
    """twinkle_client's upload_to_hub: a twinkle:// path (the same checkpoint as its tinker:// one), the token in
    the request (stored encrypted), polled to `completed`; a server directory is refused; B sees nothing of A's."""
    with tinker.ServiceClient(base_url=srv.base_url, api_key=srv.api_key_a) as sc:  # type: ignore[attr-defined]
        path = trained_client(sc, srv.base_model, steps=0).save_weights_for_sampler("native").result().path
    twinkle_path = path.replace("tinker://", "twinkle://", 1)

    def post(key: str, **body: Any) -> httpx.Response:
        return httpx.post(f"{srv.base_url}/api/v1/model/{srv.base_model}/twinkle/upload_to_hub", json=body,
                          headers={"Authorization": f"Bearer {getattr(srv, f'api_key_{key}')}"}, timeout=30)

    def poll(key: str, request_id: str) -> httpx.Response:
        return httpx.get(f"{srv.base_url}/api/v1/model/{srv.base_model}/twinkle/upload_status/{request_id}",
                         headers={"Authorization": f"Bearer {getattr(srv, f'api_key_{key}')}"}, timeout=30)

    refused = post("a", checkpoint_dir=str(srv.data_dir), hub_model_id="hf://alice/leak", hub_token=TOKEN_A)
    assert refused.status_code == 400 and "twinkle://" in refused.json()["detail"]
    started = post("a", checkpoint_dir={"twinkle_path": twinkle_path, "checkpoint_dir": None},
                   hub_model_id="hf://alice/native", hub_token=TOKEN_A)
    assert started.status_code == 200, started.text
    request_id = started.json()["request_id"]
    deadline = time.monotonic() + 60
    while (body := poll("a", request_id).json())["status"] not in ("completed", "failed"):
        assert body["status"] in ("queued", "running") and time.monotonic() < deadline
        time.sleep(0.2)
    assert body == {"request_id": request_id, "status": "completed", "error": None}
    assert hub.repos["alice/native"].files == folder_files(srv, path)
    assert poll("b", request_id).status_code == 404
    assert post("b", checkpoint_dir=twinkle_path, hub_model_id="hf://bob/stolen", hub_token="x").status_code == 404
    assert TOKEN_A not in srv.log()
