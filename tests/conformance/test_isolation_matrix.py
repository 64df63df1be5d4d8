"""The isolation matrix, generated from the route table: every route that takes an id or a path is called by tenant
B with tenant A's (session, run, future, sampling session, checkpoints of each kind as tinker:// and twinkle://
paths, custom loss, push, native session, adapter and sampler adapter, server-side dataset) and must answer 404, as
for an id that does not exist. A route added to the app without a line in CASES or NO_ID fails
test_every_route_is_in_the_matrix.

Signed download URLs take no key: a tampered, an expired, and B's own URL pointed at A's export answer 403; B
cannot get URLs for A's export (404).
"""

from __future__ import annotations

import sqlite3
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from tinker.proto import tinker_public_pb2 as pb

from api_schemas.models import ServedModel
from jobqueue.local_queue import LocalQueue
from server.api.gate import api_routes
from server.app import create_app
from server.config import Settings
from server.services.downloads import _message
from server.services.secrets import Keyring, load_secret
from tests.conformance.isolation_world import ADAM, World, build
from tests.conformance.openapi_check import Contract
from tests.conformance.test_custom_loss_http import _body as custom_loss_body
from tests.conformance.test_custom_loss_http import _graph
from tests.conformance.test_security import _fb_body
from tests.support.native_http import rows
from tests.support.server import ServerProcess

Req = tuple[str, dict[str, Any]]  # (path, httpx keyword arguments); the method is the route's
Case = Callable[[World], Req]


def _fill(value: Any, w: World) -> Any:
    """`value` with "{w.<field>}" strings filled in from the world, nested ones included."""
    if isinstance(value, str):
        return value.format(w=w)
    if isinstance(value, dict):
        return {k: _fill(v, w) for k, v in value.items()}
    return [_fill(v, w) for v in value] if isinstance(value, list) else value


def _json(path: str, body: dict[str, Any], session: str | None = None) -> Case:
    """B's request with a JSON body; `session`: an X-Twinkle-Session-Id (native routes)."""
    headers = {} if session is None else {"X-Twinkle-Session-Id": session}
    return lambda w: (path.format(w=w), {"json": _fill(body, w), "headers": _fill(headers, w)})


def _get(path: str) -> Case:
    return lambda w: (path.format(w=w), {})


def _native(op: str, body: dict[str, Any] | None = None, session: str = "{w.native_session}",
            kind: str = "model") -> Case:
    """A native model/sampler route with A's session id in B's X-Twinkle-Session-Id (or B's own + A's path)."""
    def case(w: World) -> Req:
        payload = _fill(body or {}, w)
        headers = {"X-Twinkle-Session-Id": session.format(w=w)}
        return f"/api/v1/{kind}/{w.base_model}/twinkle/{op}", {"json": {"adapter_name": "default", **payload},
                                                                "headers": headers}
    return case


_RUN = "/api/v1/training_runs/{w.run}"
_CKPT = "/api/v1/training_runs/{w.run}/checkpoints/weights/s"


def _fb(w: World) -> Req:
    """A's run in B's protobuf forward_backward."""
    return "/api/v1/forward_backward", {"content": _fb_body(w.run, 1, [5, 6], [6, 7], [1.0, 1.0]),
                                        "headers": {"Content-Type": "application/x-protobuf"}}


def _custom_fb(w: World) -> Req:
    """B's own run, with A's custom loss."""
    msg = pb.ForwardBackwardRequest.FromString(_fb_body(w.b_run, 1, [5, 6], [6, 7], [1.0, 1.0], loss_fn="custom"))
    msg.loss_fn_config_v2["loss_id"].text = w.loss_id
    return "/api/v1/forward_backward", {"content": msg.SerializeToString(),
                                        "headers": {"Content-Type": "application/x-protobuf"}}
_MODEL_OPS = ["add_adapter_to_model", "set_template", "set_processor", "set_loss", "set_optimizer",
              "set_lr_scheduler", "add_metric", "forward_backward", "forward_only", "forward",
              "calculate_loss", "backward", "clip_grad_norm", "clip_grad_and_step", "step", "zero_grad", "lr_step",
              "calculate_metric", "get_train_configs", "upload_to_hub", "get_state_dict", "save"]  # A's session

# (METHOD, route path as FastAPI has it) -> B's request naming A's resource. Several cases per route where it
# takes several ids (e.g. A's session, and B's own session with A's checkpoint).
CASES: dict[tuple[str, str], list[Case]] = {
    ("POST", "/api/v1/forward_backward"): [_fb, _custom_fb],
    ("POST", "/api/v1/forward"): [_json("/api/v1/forward", {"model_id": "{w.run}", "seq_id": 1, "forward_input": {
        "data": [], "loss_fn": "cross_entropy"}})],
    ("POST", "/api/v1/optim_step"): [_json("/api/v1/optim_step", {"model_id": "{w.run}", "seq_id": 1,
                                                                  "adam_params": ADAM})],
    ("POST", "/api/v1/save_weights"): [_json("/api/v1/save_weights", {"model_id": "{w.run}", "seq_id": 1,
                                                                      "path": "x"})],
    ("POST", "/api/v1/save_weights_for_sampler"): [_json("/api/v1/save_weights_for_sampler", {
        "model_id": "{w.run}", "seq_id": 1, "path": "x"})],
    ("POST", "/api/v1/load_weights"): [
        _json("/api/v1/load_weights", {"model_id": "{w.run}", "seq_id": 1, "path": "{w.weights}"}),
        _json("/api/v1/load_weights", {"model_id": "{w.b_run}", "seq_id": 1, "path": "{w.weights}"}),
        _json("/api/v1/load_weights", {"model_id": "{w.b_run}", "seq_id": 2, "path": "{w.native_path}"})],
    ("POST", "/api/v1/retrieve_future"): [_json("/api/v1/retrieve_future", {"request_id": r})
                                          for r in ("{w.future}", "{w.loss_id}")],
    ("POST", "/api/v1/retrieve_futures"): [_json("/api/v1/retrieve_futures", {"target": {
        "type": "sampling_session", "sampling_session_id": "{w.sampling_session}"}, "timeout": 0})],
    ("POST", "/api/v1/cancel_future"): [_json("/api/v1/cancel_future", {"request_id": "{w.future}"})],
    ("POST", "/api/v1/create_sampling_session"): [
        _json("/api/v1/create_sampling_session", {"session_id": "{w.session}", "sampling_session_seq_id": 1,
                                                  "base_model": "{w.base_model}"}),
        _json("/api/v1/create_sampling_session", {"session_id": "{w.b_session}", "sampling_session_seq_id": 1,
                                                  "model_path": "{w.sampler}"})],
    ("GET", "/api/v1/samplers/{sampler_id}"): [_get("/api/v1/samplers/{w.sampling_session}")],
    ("POST", "/api/v1/asample"): [
        _json("/api/v1/asample", {"sampling_session_id": "{w.sampling_session}", "seq_id": 1, "num_samples": 1,
                                  "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]},
                                  "sampling_params": {"max_tokens": 1}})],
    ("POST", "/api/v1/session_heartbeat"): [_json("/api/v1/session_heartbeat", {"session_id": "{w.session}"})],
    ("POST", "/api/v1/sessions/{session_id}/finish"): [_json("/api/v1/sessions/{w.session}/finish", {})],
    ("POST", "/api/v1/create_model"): [_json("/api/v1/create_model", {
        "session_id": "{w.session}", "model_seq_id": 1, "base_model": "{w.base_model}", "lora_config": {"rank": 2}})],
    ("POST", "/api/v1/get_info"): [_json("/api/v1/get_info", {"model_id": "{w.run}"})],
    ("POST", "/v1/chat/completions"): [
        _json("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 1}) for model in ("{w.sampler}", "{w.sampling_session}")],
    ("GET", "/api/v1/training_runs/{run_id}/checkpoints"): [_get(_RUN + "/checkpoints")],
    ("DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}"): [_get(_CKPT)],
    ("POST", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/publish"): [_get(_CKPT + "/publish")],
    ("DELETE", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/publish"): [_get(_CKPT + "/publish")],
    ("PUT", "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/ttl"): [
        _json(_CKPT + "/ttl", {"ttl_seconds": 7200})],
    ("GET", "/api/v1/training_runs/{run_id}/checkpoints/external_weights/{name}/external_weights_urls"): [
        _get(_RUN + "/checkpoints/external_weights/e/external_weights_urls")],
    ("POST", "/api/v1/save_weights_external"): [_json("/api/v1/save_weights_external", {
        "model_id": "{w.run}", "seq_id": 1, "path": "x"})],
    ("POST", "/api/v1/weights_info"): [_json("/api/v1/weights_info", {"tinker_path": p})
                                       for p in ("{w.weights}", "{w.sampler}", "{w.export}", "{w.native_path}")],
    ("POST", "/api/v1/copy_weights"): [_json("/api/v1/copy_weights", {"source_path": "{w.weights}"})],
    ("GET", "/api/v1/training_runs/{run_id}"): [_get(_RUN)],
    ("GET", "/api/v1/sessions/{session_id}"): [_get("/api/v1/sessions/{w.session}")],
    ("PUT", "/api/v1/sessions/{session_id}/project"): [_json("/api/v1/sessions/{w.session}/project",
                                                            {"project_id": "p"})],
    ("GET", "/api/v1/sessions/{session_id}/trace_export"): [_get("/api/v1/sessions/{w.session}/trace_export")],
    ("POST", "/api/v1/create_custom_loss"): [
        lambda w: ("/api/v1/create_custom_loss", {"json": custom_loss_body(w.session, _graph())})],
    ("POST", "/native/v1/checkpoints/push"): [_json("/native/v1/checkpoints/push", {
        "tinker_path": "{w.weights}", "repo_id": "bob/stolen"})],
    ("GET", "/native/v1/pushes/{push_id}"): [_get("/native/v1/pushes/{w.push_id}")],
    ("PUT", "/native/v1/training_runs/{run_id}/auto_push"): [_json("/native/v1/training_runs/{w.run}/auto_push",
                                                                  {"repo_id": "bob/x"})],
    ("GET", "/native/v1/training_runs/{run_id}/auto_push"): [_get("/native/v1/training_runs/{w.run}/auto_push")],
    ("DELETE", "/native/v1/training_runs/{run_id}/auto_push"): [_get("/native/v1/training_runs/{w.run}/auto_push")],
    ("POST", "/api/v1/twinkle/session_heartbeat"): [_json("/api/v1/twinkle/session_heartbeat",
                                                          {"session_id": "{w.native_session}"})],
    ("GET", "/api/v1/twinkle/training_runs/{run_id}"): [lambda w: (f"/api/v1/twinkle/training_runs/{_nrun(w)}", {})],
    ("GET", "/api/v1/twinkle/training_runs/{run_id}/checkpoints"): [
        lambda w: (f"/api/v1/twinkle/training_runs/{_nrun(w)}/checkpoints", {})],
    ("GET", "/api/v1/twinkle/checkpoint_path/{run_id}/{checkpoint_id:path}"): [
        lambda w: (f"/api/v1/twinkle/checkpoint_path/{_nrun(w)}/weights/mine", {})],
    ("DELETE", "/api/v1/twinkle/training_runs/{run_id}/checkpoints/{checkpoint_id:path}"): [
        lambda w: (f"/api/v1/twinkle/training_runs/{_nrun(w)}/checkpoints/weights/mine", {})],
    ("POST", "/api/v1/twinkle/weights_info"): [_json("/api/v1/twinkle/weights_info", {"twinkle_path": p})
                                               for p in ("{w.native_path}", "{w.weights}")],
    **{("POST", f"/api/v1/model/{{model:path}}/twinkle/{op}"): [_native(op, {"inputs": rows(n=1)})]
       for op in _MODEL_OPS},
    ("POST", "/api/v1/model/{model:path}/twinkle/load"): [
        _native("load", {"name": p}, session="{w.b_native_session}") for p in ("{w.native_path}", "{w.weights}")],
    ("POST", "/api/v1/model/{model:path}/twinkle/upload_to_hub"): [
        _native("upload_to_hub", {"checkpoint_dir": "{w.native_path}", "hub_model_id": "bob/stolen"}, session=s)
        for s in ("{w.native_session}", "{w.b_native_session}")],
    ("POST", "/api/v1/model/{model:path}/twinkle/resume_from_checkpoint"): [
        _native("resume_from_checkpoint", {"name": "{w.native_path}"}, session="{w.b_native_session}")],
    ("GET", "/api/v1/model/{model:path}/twinkle/upload_status/{request_id}"): [
        lambda w: (f"/api/v1/model/{w.base_model}/twinkle/upload_status/{w.upload_id}", {})],
    ("POST", "/api/v1/sampler/{model:path}/twinkle/sample"): [
        *(_native("sample", {"inputs": rows(n=1), "adapter_uri": p}, session="{w.b_native_session}", kind="sampler")
          for p in ("{w.native_path}", "{w.sampler}")),
        # A's sampler adapter "default" (add_adapter_to_sampler), named in A's session and in B's own
        *(_native("sample", {"inputs": rows(n=1)}, session=s, kind="sampler")
          for s in ("{w.native_session}", "{w.b_native_session}"))],
    ("POST", "/api/v1/sampler/{model:path}/twinkle/add_adapter_to_sampler"): [
        _native("add_adapter_to_sampler", {"config": {"r": 2}}, kind="sampler")],
    ("POST", "/api/v1/processor/twinkle/call"): [
        _json("/api/v1/processor/twinkle/call", {"processor_id": "{w.processor}", "function": "__len__"}, session=s)
        for s in ("{w.native_session}", "{w.b_native_session}")],
    ("POST", "/api/v1/processor/twinkle/create"): [
        _json("/api/v1/processor/twinkle/create", {"processor_type": "dataloader", "class_type": "DataLoader",
                                                   "dataset": "{w.processor}", "batch_size": 1}, session=s)
        for s in ("{w.native_session}", "{w.b_native_session}")],
}

# Routes that take no id or path of anything a tenant owns, and why.
NO_ID: dict[tuple[str, str], str] = {
    ("POST", "/api/v1/create_session"): "creates the caller's own",
    ("POST", "/api/v1/client/config"): "server-wide settings", ("POST", "/api/v1/client/dynamic_config"): "ditto",
    ("POST", "/api/v1/telemetry"): "accepted and dropped", ("GET", "/api/v1/get_server_capabilities"): "served models",
    ("GET", "/api/v1/healthz"): "no key", ("GET", "/healthz"): "no key", ("GET", "/readyz"): "no key",
    ("GET", "/api/v1/twinkle/healthz"): "no key", ("GET", "/api/v1/twinkle/get_server_capabilities"): "served models",
    ("GET", "/v1/models"): "lists the caller's own", ("GET", "/api/v1/checkpoints"): "lists the caller's own",
    ("GET", "/api/v1/training_runs"): "lists the caller's own (and published)",
    ("GET", "/api/v1/sessions"): "lists the caller's own", ("POST", "/api/v1/sessions/search"): "the caller's own",
    ("GET", "/api/v1/billing/usage/checkpoints/current"): "the caller's own usage",
    ("GET", "/native/v1/usage"): "the caller's own usage", ("GET", "/metrics"): "server-wide counts (its own token)",
    ("GET", "/dashboard"): "the page itself, no data", ("GET", "/dashboard/"): "the page itself, no data",
    ("GET", "/dashboard/static/{name}"): "the page's own files, a fixed list (no tenant data)",
    ("GET", "/dashboard/api/overview"): "the caller's own; an operator key's: all (test_dashboard.py)",
    ("GET", "/api/v1/twinkle/capacity_info"): "the caller's own", ("GET", "/api/v1/twinkle/training_runs"): "own",
    ("POST", "/api/v1/twinkle/create_session"): "creates the caller's own",
    ("PUT", "/native/v1/hub/tokens/{provider}"): "writes the caller's own token (provider names a hub)",
    ("GET", "/native/v1/hub/tokens/{provider}"): "the caller's own token's state (test_hub_tokens_stay_private)",
    ("DELETE", "/native/v1/hub/tokens/{provider}"): "deletes the caller's own token, if any",
    ("GET", "/api/v1/downloads/{checkpoint_row}/{relpath:path}"): "no key: the signature (test_signed_downloads)",
    ("POST", "/api/v1/sampler/{model:path}/twinkle/create"): "a no-op acknowledgement; reads no session",
    ("POST", "/api/v1/model/{model:path}/twinkle/create"): "a no-op acknowledgement; reads no session",
    ("POST", "/api/v1/model/{model:path}/twinkle/apply_patch"): "always refused (400) before any lookup",
    ("POST", "/api/v1/sampler/{model:path}/twinkle/apply_patch"): "always refused (400) before any lookup",
    ("POST", "/api/v1/sampler/{model:path}/twinkle/set_template"): "checks the name against the allow-list only; "
                                                                    "stores nothing, reads no session",
}


def _nrun(w: World) -> str:
    return w.native_path.split("/")[2]


def _routes() -> set[tuple[str, str]]:
    app = create_app(Settings(data_dir=Path(tempfile.mkdtemp())), LocalQueue(),
                     {"m": ServedModel(name="m", vocab_size=10, max_context=10, tokenizer_id="m")})
    return {(m, path) for path, methods, _ in api_routes(app.router.routes) for m in methods}


def test_every_route_is_in_the_matrix() -> None:
    routes = _routes()
    assert not set(CASES) & set(NO_ID)
    missing = routes - set(CASES) - set(NO_ID)
    assert not missing, f"routes without an isolation case (add one to CASES, or to NO_ID with a reason): {missing}"
    assert not (set(CASES) | set(NO_ID)) - routes, "the matrix names routes the app does not have"


@pytest.fixture(scope="module")
def world(server: ServerProcess) -> World:
    return build(server)


@pytest.fixture(scope="module")
def contract(server: ServerProcess) -> Contract:
    return Contract(httpx.get(f"{server.base_url}/openapi.json", timeout=30).json())


@pytest.mark.parametrize("route", sorted(CASES), ids=lambda r: f"{r[0]} {r[1]}")
def test_tenant_b_gets_404_for_tenant_as_ids(server: ServerProcess, world: World, contract: Contract,
                                             route: tuple[str, str]) -> None:
    method, _ = route
    key = server.api_key_b  # type: ignore[attr-defined]
    headers = {"X-API-Key": key, "Authorization": f"Bearer {key}"}
    for case in CASES[route]:
        path, kw = case(world)
        r = httpx.request(method, server.base_url + path, headers={**headers, **kw.pop("headers", {})}, timeout=60,
                          **kw)
        assert r.status_code == 404, (method, path, kw, r.status_code, r.text[:400])
        assert r.json()["category"] == "user"
        contract.check(r)  # and the document declares that 404, with its body
    # and A still reads its own run (nothing B sent took it away)
    a = httpx.get(f"{server.base_url}/api/v1/training_runs/{world.run}",
                  headers={"X-API-Key": server.api_key_a}, timeout=30)  # type: ignore[attr-defined]
    assert a.status_code == 200, a.text


def test_hub_tokens_stay_private(server: ServerProcess, world: World) -> None:
    """A stored a token; B's view of the provider says none is configured, and A's never shows the token."""
    for key, configured in ((server.api_key_b, False), (server.api_key_a, True)):  # type: ignore[attr-defined]
        r = httpx.get(f"{server.base_url}/native/v1/hub/tokens/huggingface", headers={"X-API-Key": key}, timeout=30)
        assert r.status_code == 200 and r.json()["configured"] is configured and "hf_a_secret" not in r.text


def test_signed_downloads(server: ServerProcess, world: World, contract: Contract) -> None:
    url = next(iter(world.urls.values()))
    assert httpx.get(url, timeout=30).status_code == 200  # the URL itself is the permission
    parts = urlsplit(url)
    q = {k: v[0] for k, v in parse_qs(parts.query).items()}
    base = f"{server.base_url}{parts.path}"
    tampered = q["sig"][:-2] + ("00" if not q["sig"].endswith("00") else "11")
    assert contract.check(httpx.get(base, params={**q, "sig": tampered}, timeout=30)) == 403
    assert httpx.get(base, params={**q, "expires": int(q["expires"]) + 1}, timeout=30).status_code == 403
    assert contract.check(httpx.get(base, params={**q, "sig": "\u00e9" * 43}, timeout=30)) == 403  # was a 500
    # expired: signed right (with the server's own secret, as the gateway would have) for a moment past
    row, rel = int(parts.path.split("/")[4]), parts.path.split("/", 5)[5]
    with sqlite3.connect(server.data_dir / "twinkle.db") as db:
        (storage_key,) = db.execute("select storage_key from checkpoints where id = ?", (row,)).fetchone()
    past = int(time.time()) - 10
    keys = Keyring(load_secret(Settings(data_dir=server.data_dir)))
    expired = httpx.get(base, params={"expires": past, "sig": keys.sign(_message(row, storage_key, rel, past))},
                        timeout=30)
    assert contract.check(expired) == 403 and "expired" in expired.json()["detail"], expired.text
    b_url = urlsplit(next(iter(world.b_urls.values())))
    b_q = {k: v[0] for k, v in parse_qs(b_url.query).items()}
    a_row = parts.path.split("/")[4]
    stolen = b_url.path.split("/")
    stolen[4] = a_row  # B's signature on A's export
    assert httpx.get(server.base_url + "/".join(stolen), params=b_q, timeout=30).status_code == 403
