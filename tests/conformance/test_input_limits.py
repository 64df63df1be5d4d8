"""Every input limit of issue 19, on every client family that can send it, as one table (SECURITY.md "Input limits").

A server of its own with tight limits (body 32 KiB, 4 datums, LoRA rank 8, caps of 4 live sessions, 6 models and 3
sampling sessions per tenant) on the tiny model (vocabulary 384, context 1024). Each OVER case sends the input just
past a limit and must get its status with the limit and the value named in the body, and queue nothing: after it a
probe tenant's forward_backward and sample run, and the workers' finished jobs (`twinkle_jobs_total`, Skips aside)
moved by exactly those two. Each UNDER case sends the input at the limit and must be accepted.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from tests.conformance.isolation_world import ADAM
from tests.conformance.limits_support import Tenant, is_body, jdatum
from tests.conformance.openapi_check import Contract
from tests.conformance.test_native_datasets import meta
from tests.conformance.test_quotas import _fb_body as rows_body
from tests.conformance.test_security import _fb_body
from tests.support.native_http import LORA, Native, rows
from tests.support.prom import scrape
from tests.support.server import ServerProcess

BODY, DATUMS, RANK, SESSIONS, MODELS, SAMPLERS = 32768, 4, 8, 4, 6, 3


@pytest.fixture(scope="module")
def srv(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    env = {"TWINKLE_MAX_REQUEST_BYTES": str(BODY), "TWINKLE_MAX_DATUMS_PER_REQUEST": str(DATUMS),
           "TWINKLE_MAX_LORA_RANK": str(RANK), "TWINKLE_MAX_SESSIONS_PER_TENANT": str(SESSIONS),
           "TWINKLE_MAX_MODELS_PER_TENANT": str(MODELS), "TWINKLE_MAX_SAMPLING_SESSIONS_PER_TENANT": str(SAMPLERS)}
    s = ServerProcess(tmp_path_factory.mktemp("input-limits"), str(server_model_dir), env=env)
    s.keys = {t: s.create_key(t) for t in ("a", "b", "c", "probe")}  # type: ignore[attr-defined]
    s.start()
    yield s
    s.stop()


@dataclass
class World:
    srv: ServerProcess
    vocab: int
    ctx: int
    a: Tenant
    probe: Tenant
    native: Native
    contract: Contract

    def native_op(self, op: str, **body: Any) -> httpx.Response:
        return self.native.http.post(f"/model/{self.srv.base_model}/twinkle/{op}", content=json.dumps(
            {"adapter_name": "default", **body}), headers={"Content-Type": "application/json"})

    def dataset(self) -> str:
        """A server-held native dataset of one row."""
        r = self.native.http.post("/processor/twinkle/create", json={
            "processor_type": "dataset", "class_type": "Dataset", "dataset_meta": meta([{"query": "q"}])})
        return str(r.json()["processor_id"])

    def native_sample(self, inputs: list[dict[str, Any]], **params: Any) -> httpx.Response:
        return self.native.http.post(f"/sampler/{self.srv.base_model}/twinkle/sample", json={
            "inputs": inputs, "sampling_params": {"max_tokens": 1, **params}})

    def sampler_adapter(self, name: str, **config: Any) -> httpx.Response:
        return self.native.http.post(f"/sampler/{self.srv.base_model}/twinkle/add_adapter_to_sampler", json={
            "adapter_name": name, "config": {**json.loads(LORA), **config}})

    def chat(self, **body: Any) -> httpx.Response:
        return self.a.post("/v1/chat/completions", json={"model": self.srv.base_model, "max_tokens": 1, "messages": [
            {"role": "user", "content": "hi"}], **body})

    def jobs(self) -> Counter[str]:
        """Jobs the workers finished, by kind (Skips, which a refused request's seq_id becomes, left out)."""
        return Counter({dict(ls)["kind"]: int(v) for (n, ls), v in scrape(self.srv.base_url).items()
                        if n == "twinkle_jobs_total" and dict(ls)["kind"] != "skip" and v})

    def settle(self) -> None:
        """The probe tenant's forward_backward and sample, run to their end: whatever was queued before is done."""
        self.probe.done(self.probe.fb(lambda m, s: _fb_body(m, s, [5, 6], [6, 7], [1.0, 1.0])))
        self.probe.done(self.probe.sample([5, 6]))


@pytest.fixture(scope="module")
def w(srv: ServerProcess, server_model_dir: Path) -> World:
    config = json.loads((server_model_dir / "config.json").read_text())
    keys = srv.keys  # type: ignore[attr-defined]
    native = Native(srv, keys["a"])
    assert native.ok("add_adapter_to_model", adapter_name="default", config=LORA)["adapter_name"] == "default"
    a = Tenant(srv, keys["a"]).setup()
    a.done(a.post("save_weights", json={"model_id": a.model, "seq_id": a.take_seq(), "path": "kept"}))
    return World(srv, config["vocab_size"], config["max_position_embeddings"], a, Tenant(srv, keys["probe"]).setup(),
                 native, Contract(httpx.get(f"{srv.base_url}/openapi.json", timeout=30).json()))


Send = Callable[[World], httpx.Response]
# (limit, client family, the request just over the limit, its status, words its body must hold)
OVER: list[tuple[str, str, Send, int, tuple[str, ...]]] = [
    ("body size", "tinker protobuf", lambda w: w.a.fb(lambda m, s: rows_body(m, s, [[5] * 1100] * 2)), 413,
     (f"{BODY} bytes",)),
    ("body size", "tinker json", lambda w: w.a.json_fb([jdatum([5] * 1000)] * 4), 413, (f"{BODY} bytes",)),
    ("body size", "native", lambda w: w.native_op("forward_backward", inputs=[{"input_ids": [5] * (BODY // 2)}]), 413,
     (f"{BODY} bytes",)),
    ("body size", "openai", lambda w: w.chat(messages=[{"role": "user", "content": "x" * BODY}]), 413,
     (f"{BODY} bytes",)),
    ("body size", "rest", lambda w: w.a.post("sessions/search", json={"display_name": "x" * BODY}), 413,
     (f"{BODY} bytes",)),
    ("datums per request", "tinker protobuf", lambda w: w.a.fb(lambda m, s: rows_body(m, s, [[5, 6]] * 5)), 400,
     ("5 datums", f"limit is {DATUMS}")),
    ("datums per request", "tinker json", lambda w: w.a.json_fb([jdatum([5, 6])] * 5), 400,
     ("5 datums", f"limit is {DATUMS}")),
    ("datums per request", "native", lambda w: w.native_op("forward_backward", inputs=rows(n=5)), 400,
     ("5 rows", f"at most {DATUMS}")),
    ("datums per request", "native dataloader", lambda w: w.native.http.post("/processor/twinkle/create", json={
        "processor_type": "dataloader", "class_type": "DataLoader", "dataset": w.dataset(), "batch_size": DATUMS + 1}),
     400, ("batch_size", f"at most {DATUMS}")),
    ("tokens per datum", "tinker protobuf", lambda w: w.a.fb(lambda m, s: rows_body(m, s, [[5] * (w.ctx + 2)])),
     400, (f"{1025} tokens", "context of 1024")),
    ("tokens per datum", "tinker json", lambda w: w.a.json_fb([jdatum([5] * (w.ctx + 1))]), 400,
     ("1025 tokens", "context of 1024")),
    ("tokens per datum", "native", lambda w: w.native_op("forward_backward", inputs=[
        {"input_ids": [5] * (w.ctx + 1), "labels": [6] * (w.ctx + 1)}]), 400, ("1025 tokens", "at most 1024")),
    ("tokens per datum", "tinker sample", lambda w: w.a.sample([5] * w.ctx), 400, ("1024 tokens", "context is 1024")),
    ("tokens per datum", "native sample", lambda w: w.native_sample([{"input_ids": [5] * w.ctx}]), 400,
     ("1024 tokens", "context (1024)")),
    ("tokens per datum", "openai", lambda w: w.chat(messages=[{"role": "user", "content": "q x " * 1500}]), 400,
     ("tokens", "context is 1024")),
    ("vocabulary", "tinker protobuf", lambda w: w.a.fb(lambda m, s: _fb_body(m, s, [5, w.vocab], [6, 7], [1, 1])),
     400, ("outside the vocabulary", "384")),
    ("vocabulary", "tinker protobuf", lambda w: w.a.fb(lambda m, s: _fb_body(m, s, [5, 6], [6, -1], [1, 1])), 400,
     ("target_tokens", "outside the vocabulary")),
    ("vocabulary", "tinker json", lambda w: w.a.json_fb([jdatum([5, w.vocab])]), 400, ("outside the vocabulary",)),
    ("vocabulary", "native", lambda w: w.native_op("forward_backward", inputs=[
        {"input_ids": [5, w.vocab], "labels": [6, 7]}]), 400, ("input_ids", "outside the vocabulary [0, 384)")),
    ("vocabulary", "tinker sample", lambda w: w.a.sample([5, w.vocab]), 400, ("prompt token ids", "[0, 384)")),
    ("vocabulary", "tinker sample stop", lambda w: w.a.sample([5, 6], stop=[w.vocab]), 400, ("stop", "[0, 384)")),
    ("vocabulary", "native sample", lambda w: w.native_sample([{"input_ids": [5, w.vocab]}]), 400,
     ("vocabulary [0, 384)",)),
    ("non-finite", "tinker protobuf", lambda w: w.a.fb(lambda m, s: _fb_body(m, s, [5, 6], [6, 7], [1, np.nan])),
     400, ("weights", "NaN or Inf")),
    ("non-finite", "tinker protobuf", lambda w: w.a.fb(lambda m, s: is_body(m, s, [1.0, np.inf])), 400,
     ("advantages", "NaN or Inf")),
    ("non-finite", "tinker json", lambda w: w.a.json_fb([jdatum([5, 6], [1.0, float("nan")])]), 400,
     ("weights", "NaN or Inf")),
    ("non-finite", "tinker optim_step", lambda w: w.a.post("optim_step", json={
        "model_id": w.a.model, "seq_id": w.a.seq, "adam_params": {**ADAM, "learning_rate": float("inf")}}), 422,
     ("learning_rate", "finite")),
    ("non-finite", "tinker sample", lambda w: w.a.sample([5, 6], temperature=float("nan")), 422,
     ("temperature", "finite")),
    ("non-finite", "openai", lambda w: w.chat(top_p=float("nan")), 422, ("top_p",)),
    ("non-finite", "native", lambda w: w.native_op("set_optimizer", optimizer_cls="AdamW", lr=float("nan")), 400,
     ("lr",)),
    ("non-finite", "native loss", lambda w: w.native_op("set_loss", loss_cls="SimPOLoss", gamma=float("nan")), 400,
     ("gamma", "finite")),
    ("max_tokens", "tinker sample", lambda w: w.a.sample([5, 6], max_tokens=w.ctx + 1), 400,
     ("max_tokens 1025", "context of 1024")),
    ("max_tokens", "native sample", lambda w: w.native_sample([{"input_ids": [5, 6]}], max_tokens=w.ctx + 1), 400,
     ("max_tokens 1025", "context of 1024")),
    ("max_tokens", "openai", lambda w: w.chat(max_tokens=w.ctx + 1), 400, ("max_tokens 1025", "context of 1024")),
    ("num_samples", "tinker sample", lambda w: w.a.sample([5, 6], num_samples=129), 400, ("num_samples", "128")),
    ("num_samples", "native sample", lambda w: w.native_sample([{"input_ids": [5, 6]}], num_samples=129), 400,
     ("num_samples", "128")),
    ("num_samples", "openai", lambda w: w.chat(n=17), 422, ("n", "16")),
    ("lora rank", "tinker", lambda w: w.a.create_model(w.a.session, 90, rank=RANK + 1), 400,
     ("rank 9", f"maximum {RANK}", "max_lora_rank")),
    ("lora rank", "native", lambda w: w.native_op("add_adapter_to_model", adapter_name="r9", config=json.dumps(
        {**json.loads(LORA), "r": RANK + 1})), 400, ("r must be", f"1 to {RANK}", "9")),
    ("lora rank", "native sampler", lambda w: w.sampler_adapter("r9", r=RANK + 1), 400,
     ("r must be", f"1 to {RANK}", "9")),
    ("lora target modules", "native sampler", lambda w: w.sampler_adapter("tm", target_modules=["not_a_layer"]), 400,
     ("target_modules", "not_a_layer")),
    ("lora target modules", "native", lambda w: w.native_op("add_adapter_to_model", adapter_name="tm", config=(
        json.dumps({**json.loads(LORA), "target_modules": ["q_proj", "not_a_layer"]}))), 400,
     ("target_modules", "not_a_layer")),
    ("lora target modules", "tinker", lambda w: w.a.post("create_model", json={
        "session_id": w.a.session, "model_seq_id": 91, "base_model": w.srv.base_model, "lora_config": {
            "rank": 2, "train_attn": False, "train_mlp": False, "train_unembed": False}}), 400, ("train_attn",)),
    ("checkpoint name", "tinker", lambda w: w.a.post("save_weights", json={
        "model_id": w.a.model, "seq_id": w.a.seq, "path": "../escape"}), 400, ("checkpoint name", "../escape")),
    ("checkpoint name", "tinker", lambda w: w.a.post("save_weights", json={
        "model_id": w.a.model, "seq_id": w.a.seq, "path": "n" * 129}), 400, ("checkpoint name", "nnnn")),
    ("checkpoint name", "rest", lambda w: w.a.post("save_weights_external", json={
        "model_id": w.a.model, "seq_id": w.a.seq, "path": "a b"}), 422, ("path", "pattern")),
    ("project name", "rest", lambda w: w.a.http.put(f"/api/v1/sessions/{w.a.session}/project",
                                                    json={"project_id": "p" * 129}), 422, ("128 characters",)),
    ("adapter name", "native", lambda w: w.native.op("add_adapter_to_model", adapter_name="x" * 65, config=LORA),
     400, ("adapter_name", "1-64")),
    ("adapter name", "native sampler", lambda w: w.sampler_adapter("x" * 65), 400, ("adapter_name", "1-64")),
    ("metadata", "tinker", lambda w: w.a.post("create_session", json={
        "user_metadata": {f"k{i}": "v" for i in range(65)}}), 422, ("65 entries", "limit is 64")),
    ("metadata", "tinker", lambda w: w.a.post("create_session", json={"user_metadata": {"k" * 129: "v"}}), 422,
     ("129 characters", "limit is 128")),
    ("metadata", "tinker", lambda w: w.a.post("create_model", json={
        "session_id": w.a.session, "model_seq_id": 92, "base_model": w.srv.base_model,
        "user_metadata": {"k": "v" * 1025}}), 422, ("longer than 1024",)),
    ("metadata", "tinker", lambda w: w.a.post("create_session", json={"tags": ["t" * 129]}), 422,
     ("tags", "128 characters")),
    ("metadata", "native", lambda w: w.native.http.post("/twinkle/create_session", json={
        "metadata": {f"k{i}": "v" for i in range(65)}}), 400, ("metadata", "64 entries")),
    ("ttl", "tinker", lambda w: w.a.post("save_weights", json={
        "model_id": w.a.model, "seq_id": w.a.seq, "path": "ttl", "ttl_seconds": 3599}), 400,
     ("ttl_seconds", "3600")),
    ("ttl", "rest copy", lambda w: w.a.post("copy_weights", json={
        "source_path": f"tinker://{w.a.model}/weights/kept", "ttl_seconds": 3599}), 400, ("ttl_seconds", "3600")),
    ("ttl", "rest", lambda w: w.a.http.put(f"/api/v1/training_runs/{w.a.model}/checkpoints/weights/kept/ttl",
                                           json={"ttl_seconds": 10 * 365 * 24 * 3600 + 1}), 400,
     ("ttl_seconds", "315360000")),
]


@pytest.mark.parametrize("limit, family, send, status, words", OVER, ids=[f"{c[0]}-{c[1]}" for c in OVER])
def test_over_the_limit_is_refused_and_queues_nothing(w: World, limit: str, family: str, send: Send, status: int,
                                                      words: tuple[str, ...]) -> None:
    before = w.jobs()
    r = send(w)
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert body["category"] == "user" and isinstance(body["detail"], str)
    w.contract.check(r)  # the status is one the OpenAPI document declares for the route, with its body schema
    for word in words:
        assert word in r.text, (word, body)
    if "save_weights" in str(r.request.url) or "optim_step" in str(r.request.url):
        w.a.seq += status == 400
    w.settle()
    assert w.jobs() - before == Counter({"forward_backward": 1, "sample": 1}), (w.jobs() - before)


def _native_adapter(native: Native, name: str, rank: int, modules: list[str]) -> httpx.Response:
    config = json.dumps({**json.loads(LORA), "r": rank, "target_modules": modules})
    return native.op("add_adapter_to_model", adapter_name=name, config=config)


# (limit, client family, the request at the limit): it must be accepted (a future it answers must succeed)
UNDER: list[tuple[str, str, Send]] = [
    ("body size", "tinker protobuf", lambda w: w.a.done(w.a.fb(lambda m, s: rows_body(m, s, [[5] * 1001] * 2)))),
    ("datums per request", "tinker protobuf", lambda w: w.a.done(w.a.fb(lambda m, s: rows_body(m, s, [[5, 6]] * 4)))),
    ("datums per request", "native", lambda w: w.native_op("forward_backward", inputs=rows(n=DATUMS))),
    ("tokens per datum", "tinker protobuf", lambda w: w.a.done(w.a.fb(lambda m, s: rows_body(m, s,
                                                                                           [[5] * (w.ctx + 1)])))),
    ("tokens per datum", "tinker sample", lambda w: w.a.done(w.a.sample([5] * (w.ctx - 1)))),
    ("vocabulary", "tinker protobuf", lambda w: w.a.done(w.a.fb(lambda m, s: _fb_body(m, s, [0, w.vocab - 1],
                                                                                      [w.vocab - 1, 0], [1, 1])))),
    ("vocabulary", "native sample", lambda w: w.native_sample([{"input_ids": [0, w.vocab - 1]}])),
    ("max_tokens", "tinker sample", lambda w: w.a.done(w.a.sample([5] * (w.ctx - 4), max_tokens=w.ctx))),
    ("max_tokens", "native sample", lambda w: w.native_sample([{"input_ids": [5] * (w.ctx - 4)}], max_tokens=w.ctx)),
    ("max_tokens", "openai", lambda w: w.chat(max_tokens=w.ctx, messages=[{"role": "user", "content": "q x " * 150}],
                                              stop=[" ", "\n", "a", "e", "o"])),
    ("num_samples", "tinker sample", lambda w: w.a.done(w.a.sample([5, 6], num_samples=128))),
    ("num_samples", "native sample", lambda w: w.native_sample([{"input_ids": [5, 6]}], num_samples=128)),
    ("num_samples", "openai", lambda w: w.chat(n=16)),
    ("lora rank", "tinker", lambda w: w.a.done(w.a.create_model(w.a.session, 1, rank=RANK))),
    ("lora rank, target modules, adapter name", "native",
     lambda w: _native_adapter(w.native, "x" * 64, RANK, ["q_proj"])),
    ("lora rank, target modules, adapter name", "native sampler",
     lambda w: w.sampler_adapter("x" * 64, r=RANK, target_modules=["q_proj"])),
    ("checkpoint name, ttl", "tinker", lambda w: w.a.done(w.a.post("save_weights", json={
        "model_id": w.a.model, "seq_id": w.a.take_seq(), "path": "n" * 128, "ttl_seconds": 3600}))),
    ("ttl", "rest", lambda w: w.a.http.put(f"/api/v1/training_runs/{w.a.model}/checkpoints/weights/{'n' * 128}/ttl",
                                           json={"ttl_seconds": 10 * 365 * 24 * 3600})),
    ("metadata", "tinker", lambda w: w.a.post("create_session", json={"tags": ["t" * 128] * 64, "user_metadata": {
        **{f"k{i}": "v" for i in range(62)}, "k" * 128: "v", "long": "v" * 1024}})),
]


@pytest.mark.parametrize("limit, family, send", UNDER, ids=[f"{c[0]}-{c[1]}" for c in UNDER])
def test_at_the_limit_is_accepted(w: World, limit: str, family: str, send: Send) -> None:
    r = send(w)
    assert r.status_code in (200, 204), (r.status_code, r.text[:500])


def test_live_sessions_models_and_sampling_sessions_per_tenant(w: World) -> None:
    c = Tenant(w.srv, w.srv.keys["c"])  # type: ignore[attr-defined]
    sessions = [c.new_session() for _ in range(SESSIONS - 1)]
    native = Native(w.srv, c.key)  # the cap-th live session, through the native route
    before = w.jobs()
    for r in (c.post("create_session", json={}), native.http.post("/twinkle/create_session", json={})):
        assert r.status_code == 429 and "max_sessions_per_tenant" in r.text and f"limit is {SESSIONS}" in r.text
        w.contract.check(r)
    c.ok(f"sessions/{sessions.pop()}/finish", json={})  # only live sessions count
    sessions.append(c.new_session())
    assert c.post("create_session", json={}).status_code == 429

    models = [c.create_model(sessions[0], i) for i in range(MODELS - 1)]
    assert native.ok("add_adapter_to_model", adapter_name="default", config=LORA)  # the cap-th model
    saved = c.done(c.post("save_weights", json={"model_id": models[0].json()["model_id"], "seq_id": 1, "path": "s"}))
    refused = [c.create_model(sessions[0], 99),
               _native_adapter(native, "second", 2, ["q_proj"]),
               c.post("load_weights", json={"path": saved.json()["path"], "session_id": sessions[0],
                                            "model_seq_id": 98})]
    for r in refused:
        assert r.status_code == 429 and "max_models_per_tenant" in r.text and f"limit is {MODELS}" in r.text, r.text
        w.contract.check(r)
    assert c.post("get_info", json={"model_id": f"{sessions[0]}:train:99"}).status_code == 404  # nothing was made

    for i in range(SAMPLERS):
        c.ok("create_sampling_session", json={"session_id": sessions[1], "sampling_session_seq_id": i,
                                              "base_model": w.srv.base_model})
    r = c.post("create_sampling_session", json={"session_id": sessions[1], "sampling_session_seq_id": 50,
                                                "base_model": w.srv.base_model})
    assert r.status_code == 429 and "max_sampling_sessions_per_tenant" in r.text, r.text
    w.contract.check(r)
    assert c.http.get(f"/api/v1/samplers/{sessions[1]}:sample:50").status_code == 404  # nothing was made
    w.settle()
    done = w.jobs() - before  # the creates that were accepted, the save, the probe; nothing of the refused ones
    assert done == Counter({"create_model": MODELS, "save_weights": 1, "forward_backward": 1, "sample": 1}), done
    c.ok(f"sessions/{sessions[0]}/finish", json={})  # its models end with it: room again
    assert c.create_model(sessions[2], 0).status_code == 200


def test_bad_input_does_not_harm_another_tenants_work_in_flight(w: World) -> None:
    """B's forward (queued, not yet collected) while A sends one of every refused input: B's result is what a twin
    model of the same seed computes alone."""
    data = [types.Datum(model_input=types.ModelInput.from_ints([5, 17, 42, 99, 7]),
                        loss_fn_inputs={"target_tokens": [17, 42, 99, 7, 23], "weights": [1.0] * 5})] * 3
    with tinker.ServiceClient(base_url=w.srv.base_url, api_key=w.srv.keys["b"]) as sc:  # type: ignore[attr-defined]
        tc = sc.create_lora_training_client(base_model=w.srv.base_model, rank=2, seed=7).result()
        fut = tc.forward(data, "cross_entropy")
        for _, _, send, status, _ in OVER:
            if status != 413:  # the body-size cases are refused before a byte is read: nothing to race with
                assert send(w).status_code == status
        loss = fut.result().metrics["loss:sum"]
        twin = sc.create_lora_training_client(base_model=w.srv.base_model, rank=2, seed=7).result()
        assert twin.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(loss, rel=1e-6)
        assert np.isfinite(loss)
