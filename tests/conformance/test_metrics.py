"""`/metrics` after one training step and one sample through the stock SDK: every counter moved by what was done."""

from __future__ import annotations

import httpx
import tinker
from tinker import types

from tests.support.prom import delta, scrape, value
from tests.support.server import ServerProcess

TRAIN = [[3, 8, 13, 21, 34, 55, 89, 144], [5, 17, 42, 99, 7, 23, 61]]
PROMPT = [5, 17, 42, 99, 7, 23, 61, 11, 2]


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def test_counters_follow_a_step_and_a_sample(server: ServerProcess) -> None:
    model = server.base_model
    with tinker.ServiceClient(base_url=server.base_url, api_key=server.api_key_a) as sc:
        tc = sc.create_lora_training_client(base_model=model, rank=4).result()
        before = scrape(server.base_url)
        tc.forward_backward([datum(t) for t in TRAIN], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampler = sc.create_sampling_client(base_model=model).result()
        out = sampler.sample(types.ModelInput.from_ints(PROMPT), 2,
                             types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])).result()
        after = scrape(server.base_url)

    trained = sum(len(t) - 1 for t in TRAIN)  # the datums' model_input tokens
    sampled = sum(len(s.tokens) for s in out.sequences)
    assert sampled == 12
    assert delta(before, after, "twinkle_tokens_total", base_model=model, kind="trained") == trained
    assert delta(before, after, "twinkle_tokens_total", base_model=model, kind="sampled") == sampled
    assert delta(before, after, "twinkle_tokens_total", base_model=model, kind="prefilled") == len(PROMPT)
    assert delta(before, after, "twinkle_tokens_total", base_model=model, kind="forward") == 0

    # one tenant (A's id, never its name or key) moved, by the same amounts
    moved = {dict(ls)["tenant"]: after[(n, ls)] - before.get((n, ls), 0.0) for (n, ls) in after
             if n == "twinkle_tenant_tokens_total" and dict(ls)["kind"] == "trained"
             and after[(n, ls)] != before.get((n, ls), 0.0)}
    assert list(moved.values()) == [trained], moved
    tenant = next(iter(moved))
    assert tenant not in ("tenant-a", "tenant-b") and delta(
        before, after, "twinkle_tenant_tokens_total", tenant=tenant, kind="sampled") == sampled

    for kind in ("forward_backward", "optim_step", "sample"):
        assert delta(before, after, "twinkle_jobs_total", base_model=model, kind=kind, outcome="ok") == 1, kind
        assert delta(before, after, "twinkle_job_duration_seconds_count", base_model=model, kind=kind) == 1, kind
    assert delta(before, after, "twinkle_jobs_total", outcome="server_error") == 0

    # the forward_backward ran as one merged pass of one job and its tokens
    assert delta(before, after, "twinkle_merged_step_jobs_count", base_model=model) == 1
    assert delta(before, after, "twinkle_merged_step_jobs_sum", base_model=model) == 1
    assert delta(before, after, "twinkle_merged_step_tokens_sum", base_model=model) == trained

    # the sampler decoded the two sequences together in every step
    steps = delta(before, after, "twinkle_sampler_batch_rows_count", base_model=model)
    assert steps >= 5 and delta(before, after, "twinkle_sampler_batch_rows_sum", base_model=model) == 2 * steps

    # HTTP requests by route template (the per-step routes answered by the gate's fast path included)
    for route in ("/api/v1/forward_backward", "/api/v1/optim_step", "/api/v1/asample"):
        assert delta(before, after, "twinkle_http_requests_total", route=route, method="POST", status="200") == 1
    assert value(after, "twinkle_http_requests_total", route="/api/v1/retrieve_future", status="200") >= 3
    assert delta(before, after, "twinkle_tenant_requests_total", tenant=tenant) >= 5

    # scrape-time gauges: nothing left queued, the adapter on the device
    for lane in ("train", "sample"):
        assert (("twinkle_queue_depth", frozenset({("base_model", model), ("lane", lane)})) in after)
        assert value(after, "twinkle_queue_depth", base_model=model, lane=lane) == 0
    assert value(after, "twinkle_adapters", base_model=model, tier="device") >= 1
    assert value(after, "twinkle_held_jobs") == 0


def test_metrics_show_no_secret_and_label_no_raw_path(server: ServerProcess) -> None:
    httpx.get(f"{server.base_url}/api/v1/training_runs/not-a-run", headers={"X-API-Key": server.api_key_a})
    httpx.get(f"{server.base_url}/no/such/path/abc123")
    text = httpx.get(f"{server.base_url}/metrics").text
    assert server.api_key_a not in text and server.api_key_a[:12] not in text
    assert "tenant-a" not in text and "not-a-run" not in text and "abc123" not in text
    samples = scrape(server.base_url)
    assert value(samples, "twinkle_http_requests_total", route="/api/v1/training_runs/{run_id}", status="404") >= 1
    assert value(samples, "twinkle_http_requests_total", route="unmatched", status="404") >= 1


def test_metrics_token(tmp_path, server_model_dir) -> None:  # type: ignore[no-untyped-def]
    srv = ServerProcess(tmp_path / "srv", str(server_model_dir), env={"TWINKLE_METRICS_TOKEN": "scrape-me"}).start()
    try:
        refused = httpx.get(f"{srv.base_url}/metrics")
        assert refused.status_code == 401 and refused.json()["category"] == "user"
        assert httpx.get(f"{srv.base_url}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        scrape(srv.base_url, {"Authorization": "Bearer scrape-me"})
    finally:
        srv.stop()
