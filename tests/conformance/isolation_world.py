"""Tenant A's resources for the isolation matrix (test_isolation_matrix.py): one of everything a route can name
(sessions, a training run and its checkpoints of each kind, a future, a sampling session, a custom loss, a hub
push, a native session with an adapter and a sampler adapter, a server-side dataset, signed download URLs), made
through the real clients' requests; and tenant B's own session and run, to carry A's ids in B's requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import tinker
from tinker import types

from tests.conformance.test_custom_loss_http import _body as custom_loss_body
from tests.conformance.test_custom_loss_http import _graph
from tests.conformance.test_native_datasets import meta
from tests.support.native_http import Native, setup_adapter
from tests.support.server import ServerProcess

ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}


@dataclass
class World:
    base_model: str
    session: str  # A's Tinker session
    run: str  # A's training run (model id)
    future: str  # a request_id of A's
    weights: str  # tinker://<run>/weights/s (private)
    sampler: str  # tinker://<run>/sampler_weights/p (private)
    export: str  # tinker://<run>/external_weights/e
    urls: dict[str, str]  # A's export's signed download URLs
    b_urls: dict[str, str]  # B's own export's signed download URLs
    sampling_session: str
    loss_id: str
    push_id: str
    native_session: str
    native_path: str  # twinkle://<native run>/weights/mine
    upload_id: str  # A's native upload_to_hub request id
    processor: str  # A's server-side dataset
    b_session: str  # B's Tinker session
    b_run: str  # B's training run
    b_native_session: str


def _ok(r: httpx.Response) -> Any:
    assert r.status_code in (200, 202), (r.request.method, r.request.url, r.status_code, r.text)
    return r.json()


def build(server: ServerProcess) -> World:
    a_key, b_key = server.api_key_a, server.api_key_b  # type: ignore[attr-defined]
    url = f"{server.base_url}/api/v1"
    ha = {"X-API-Key": a_key}
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=a_key)
    tc = sc.create_lora_training_client(base_model=server.base_model, rank=2).result()
    run = tc.model_id
    weights = tc.save_state("s").result().path
    sampler = tc.save_weights_for_sampler("p").result().path
    export = tc.save_weights_external("e").result().path  # type: ignore[attr-defined]
    rc = tinker.RestClient(base_url=server.base_url, api_key=a_key)
    urls = dict(rc.get_external_weights_urls(export).result().urls)
    session = run.split(":train:")[0]
    sampling = _ok(httpx.post(f"{url}/create_sampling_session", headers=ha, json={
        "session_id": session, "sampling_session_seq_id": 9, "model_path": sampler}))
    future = _ok(httpx.post(f"{url}/create_model", headers=ha, json={
        "session_id": session, "model_seq_id": 9, "base_model": server.base_model,
        "lora_config": {"rank": 2}}))["request_id"]
    loss = _ok(httpx.post(f"{url}/create_custom_loss", headers=ha, json=custom_loss_body(session, _graph())))
    loss_id = loss["request_id"]  # the create's future is named by the loss id
    _ok(httpx.put(f"{server.base_url}/native/v1/hub/tokens/huggingface", headers=ha, json={"token": "hf_a_secret"}))
    push_id = _ok(httpx.post(f"{server.base_url}/native/v1/checkpoints/push", headers=ha,
                             json={"tinker_path": weights, "repo_id": "alice/lora"}))["push_id"]
    native = Native(server, a_key)
    setup_adapter(native, gas=1)
    native_path = native.ok("save", name="mine", adapter_name="default")["twinkle_path"]
    _ok(native.http.post(f"/sampler/{server.base_model}/twinkle/add_adapter_to_sampler",
                         json={"adapter_name": "default", "config": {"r": 2}}))  # A's sampler adapter
    upload_id = native.ok("upload_to_hub", checkpoint_dir=native_path, hub_model_id="alice/native",
                          hub_token="hf_a_secret", adapter_name="default")["request_id"]
    dataset = {"processor_type": "dataset", "class_type": "Dataset", "dataset_meta": meta([{"query": "q", "response": "r"}])}
    processor = _ok(native.http.post("/processor/twinkle/create", json=dataset))["processor_id"]
    b_sc = tinker.ServiceClient(base_url=server.base_url, api_key=b_key)
    b_tc = b_sc.create_lora_training_client(base_model=server.base_model, rank=2).result()
    b_export = b_tc.save_weights_external("e").result().path  # type: ignore[attr-defined]
    b_urls = dict(tinker.RestClient(base_url=server.base_url, api_key=b_key).get_external_weights_urls(b_export)
                  .result().urls)
    b_native = Native(server, b_key)
    return World(server.base_model, session, run, future, weights, sampler, export, urls, b_urls,
                 sampling["sampling_session_id"], loss_id, push_id, native.session, native_path, upload_id, processor,
                 b_tc.model_id.split(":train:")[0], b_tc.model_id, b_native.session)
