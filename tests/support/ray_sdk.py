"""The pieces of tests/integration/ray_flow.py that drive the service: the `serve --backend ray` gateway process,
replica heartbeats read from Redis, the stock-SDK SFT + sampling flow, and the trainer-kill check."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from tests.support.process import ManagedProcess, free_port, quiet_env
from tests.support.server import cli
from tests.support.sft import batch, sft


class Gateway(ManagedProcess):
    what = "gateway"
    log_tail = 15000

    def __init__(self, data_dir: Path, config: Path, ray_address: str, env: dict[str, str]) -> None:
        self.data_dir, self.config, self.ray_address = data_dir, config, ray_address
        self.env = quiet_env(env)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = ""
        self._last = ""
        super().__init__(data_dir.parent / "gateway.log")

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.api_key = cli("keys", "create", "--tenant", "ray-tenant", data_dir=self.data_dir, env=self.env).strip()
        self.launch([sys.executable, "-m", "deploy.cli", "serve", "--backend", "ray", "--ray-address",
                     self.ray_address, "--config", str(self.config), "--host", "127.0.0.1", "--port", str(self.port),
                     "--data-dir", str(self.data_dir)], self.env)

    def wait_ready(self, timeout: float = 300.0, alive: Callable[[], None] = lambda: None) -> float:
        """Until `/readyz` answers 200 (database, Redis and a live replica of every deployment); returns seconds.
        `alive` is called on every poll (it raises when something the gateway needs has died)."""

        def ready() -> bool:
            alive()
            try:
                r = httpx.get(f"{self.base_url}/readyz", timeout=5)
            except httpx.HTTPError as e:
                self._last = repr(e)
                return False
            self._last = r.text
            return r.status_code == 200

        try:
            return self.wait_until(ready, timeout, interval=0.5)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\nlast /readyz: {self._last}") from None


def heartbeats(redis_url: str, prefix: str) -> dict[str, list[dict[str, Any]]]:
    """Live replicas per deployment, as `/readyz` sees them."""
    import redis.asyncio as aioredis

    from jobqueue.heartbeats import Heartbeats
    from jobqueue.keys import Keys

    async def read() -> dict[str, list[dict[str, Any]]]:
        client = aioredis.Redis.from_url(redis_url)
        try:
            status = await Heartbeats(client, Keys(prefix)).status()
            return {d.name: [{"pid": b.pid, "node": b.node, "replica": b.replica, "info": b.info} for b in d.live]
                    for d in status}
        finally:
            await client.aclose()

    return asyncio.run(read())


def sdk_flow(gw: Gateway, model: str, served: list[str] | None = None, api_key: str | None = None,
             name: str = "sdk_flow") -> dict[str, Any]:
    """Stock SDK: capabilities (`served`, default [model]), LoRA SFT, save for the sampler, sample from the adapter and
    from the base model; as the gateway's tenant, or the one `api_key` belongs to."""
    import tinker
    from tinker import types

    t0 = time.monotonic()
    with tinker.ServiceClient(base_url=gw.base_url, api_key=api_key or gw.api_key) as sc:
        caps = [m.model_name for m in sc.get_server_capabilities().supported_models]
        tc = sc.create_lora_training_client(base_model=model, rank=4, seed=3)
        losses = sft(tc, 8, same_batch=True)
        path = tc.save_weights_for_sampler("ray-e2e").result().path
        prompt = types.ModelInput.from_ints(batch(0)[0].model_input.to_ints()[:4])
        params = types.SamplingParams(max_tokens=5, seed=1)
        tuned = sc.create_sampling_client(model_path=path).sample(prompt, num_samples=2, sampling_params=params)
        base = sc.create_sampling_client(base_model=model).sample(prompt, num_samples=1, sampling_params=params)
        seqs, base_seqs = tuned.result().sequences, base.result().sequences
    ok = (sorted(caps) == sorted(served or [model]) and losses[-1] < losses[0] * 0.9
          and path.endswith("/sampler_weights/ray-e2e")
          and len(seqs) == 2 and all(1 <= len(s.tokens) <= 5 for s in seqs) and len(base_seqs) == 1)
    return {"check": name, "ok": ok, "seconds": round(time.monotonic() - t0, 1), "models": caps, "path": path,
            "loss_first": losses[0], "loss_last": losses[-1], "sampled": [list(s.tokens) for s in seqs],
            "sampled_tokens": sum(len(s.tokens) for s in (*seqs, *base_seqs)), "prompt_tokens": 2 * 4}


def traces(receiver: Any, timeout: float = 30.0) -> dict[str, Any]:
    """The flow's traces as an OTLP collector got them from every process (tracing on: TWINKLE_OTEL_ENDPOINT): the
    trace of a forward_backward request holds the trainer replica's job spans, that of an asample request the sample
    router's, each a child of the gateway's request span (the trace context crossed Redis in the job)."""
    want = {"/api/v1/forward_backward": ["ray:trainer"], "/api/v1/asample": ["ray:sample-router"]}
    deadline = time.monotonic() + timeout
    while True:
        spans = receiver.spans()
        found: dict[str, list[str]] = {}
        for route in want:
            requests = {s["trace_id"]: s for s in spans if s["name"] == f"POST {route}"}
            children = [s for s in spans if s["trace_id"] in requests
                        and s["parent_span_id"] == requests[s["trace_id"]]["span_id"]]
            runs = [s for s in children
                    if s["name"] == "twinkle.job.run" and s["attributes"].get("twinkle.outcome") == "ok"]
            found[route] = sorted({s["resource"].get("twinkle.process", "") for s in runs})
        ok = found == want
        if ok or time.monotonic() > deadline:
            return {"check": "traces", "ok": ok, "job_run_processes": found,
                    "processes": sorted({s["resource"].get("twinkle.process", "") for s in spans}),
                    "services": sorted({s["resource"].get("service.name", "") for s in spans})}
        time.sleep(0.5)


def model_replicas(gw: Gateway, redis_url: str, prefix: str, served: list[str], timeout: float = 20.0,
                   ) -> dict[str, Any]:
    """Each served model has its own live trainer, sampler and sample-router replica (the base model each reports in
    its heartbeat), and each model's trainer trained (its trained tokens in the gateway's /metrics, labelled
    worker=deployment#replica)."""
    from tests.support.prom import scrape

    models: dict[str, list[str]] = {}
    for beats in heartbeats(redis_url, prefix).values():
        for b in beats:
            if b["info"].get("kind") in ("trainer", "sampler", "sample-router"):
                models.setdefault(b["info"]["kind"], []).append(str(b["info"].get("base_model")))
    replicas = {kind: sorted(ms) for kind, ms in sorted(models.items())}
    deadline = time.monotonic() + timeout
    while True:  # replicas publish their metrics every few seconds
        trained = sorted({dict(ls).get("worker", "").split("#")[0] for (n, ls), v in scrape(gw.base_url).items()
                          if n == "twinkle_tokens_total" and dict(ls)["kind"] == "trained" and v > 0})
        if len(trained) >= len(served) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    ok = (all(replicas.get(k) == sorted(served) for k in ("trainer", "sampler", "sample-router"))
          and len(trained) == len(served) and all(w.startswith("trainer-") for w in trained))
    return {"check": "model_replicas", "ok": ok, "replicas": replicas, "trained_by": trained}


def replica_metrics(gw: Gateway, flow: dict[str, Any], timeout: float = 20.0) -> dict[str, Any]:
    """The replicas' metrics in the gateway's /metrics (published through Redis, labelled worker=deployment#replica):
    the sampled and prompt tokens of the flow, and trained tokens from the trainer replica."""
    from tests.support.prom import scrape

    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(gw.base_url)
        tokens = {(dict(ls)["kind"], dict(ls).get("worker", "")): v for (n, ls), v in samples.items()
                  if n == "twinkle_tokens_total"}
        by_kind: dict[str, float] = {}
        for (kind, _), v in tokens.items():
            by_kind[kind] = by_kind.get(kind, 0.0) + v
        ok = (by_kind.get("sampled") == flow["sampled_tokens"] and by_kind.get("prefilled") == flow["prompt_tokens"]
              and by_kind.get("trained", 0) > 0
              and all(w.startswith("trainer-") for (k, w) in tokens if k == "trained")
              and all(w.startswith("sampler-") for (k, w) in tokens if k in ("sampled", "prefilled")))
        if ok or time.monotonic() > deadline:
            return {"check": "metrics", "ok": ok, "tokens": {f"{k}@{w}": v for (k, w), v in tokens.items()}}
        time.sleep(0.5)


def adapter_state(data_dir: Path, tc: Any, name: str) -> dict[str, Any]:
    from safetensors.torch import load_file

    path = tc.save_state(name).result().path
    run_id, kind, ckpt = path.removeprefix("tinker://").split("/")
    (folder,) = list(data_dir.glob(f"checkpoints/*/{run_id}/{kind}/{ckpt}"))
    state = load_file(str(folder / "adapter_model.safetensors"))
    state.update({f"optim/{k}": v for k, v in load_file(str(folder / "optimizer.safetensors")).items()})
    return state


def _trainer_pids(redis_url: str, prefix: str) -> list[int]:
    return [b["pid"] for name, bs in heartbeats(redis_url, prefix).items() if name.startswith("trainer-") for b in bs]


def weights_survive_kill(gw: Gateway, redis_url: str, prefix: str, model: str, cluster: Any) -> dict[str, Any]:
    """SIGKILL the trainer replica mid-run: Serve replaces it, the replacement rebuilds the adapter from snapshot +
    replay, and the final weights and optimizer state equal those of an uninterrupted run with the same data."""
    import tinker

    t0 = time.monotonic()
    steps, kill_at = 7, 4  # snapshots every 3 optim_steps: the rebuild loads one and replays after it
    (old_pid,) = _trainer_pids(redis_url, prefix)
    rebuilt_before = cluster.grep_serve_logs("rebuilt ")
    with tinker.ServiceClient(base_url=gw.base_url, api_key=gw.api_key) as sc:
        ref = sc.create_lora_training_client(base_model=model, rank=4, seed=7)
        sft(ref, steps)
        expected = adapter_state(gw.data_dir, ref, "reference")

        def kill(step: int) -> None:
            if step == kill_at:
                os.kill(old_pid, signal.SIGKILL)

        tc = sc.create_lora_training_client(base_model=model, rank=4, seed=7)
        t_kill = time.monotonic()
        sft(tc, steps, during=kill)
        got = adapter_state(gw.data_dir, tc, "after-kill")
        recovered_s = time.monotonic() - t_kill
    worst = max((got[k] - expected[k]).abs().max().item() for k in expected)
    # The dead replica's heartbeat stays listed until it expires; the run may finish before that.
    deadline = time.monotonic() + 60
    new_pids = _trainer_pids(redis_url, prefix)
    while (old_pid in new_pids or not new_pids) and time.monotonic() < deadline:
        time.sleep(0.5)
        new_pids = _trainer_pids(redis_url, prefix)
    rebuilt = cluster.grep_serve_logs("rebuilt ") - rebuilt_before
    ready = gw.wait_ready(timeout=60)
    ok = (got.keys() == expected.keys() and worst < 1e-6 and len(new_pids) == 1 and new_pids[0] != old_pid
          and rebuilt >= 1)
    return {"check": "trainer_kill", "ok": ok, "max_abs_diff": worst, "old_pid": old_pid, "new_pids": new_pids,
            "rebuilt_logged": rebuilt, "run_with_kill_s": round(recovered_s, 1), "ready_after_s": round(ready, 1),
            "seconds": round(time.monotonic() - t0, 1)}


def _sampler_replicas(redis_url: str, prefix: str) -> list[dict[str, Any]]:
    return [b for name, bs in heartbeats(redis_url, prefix).items() if name.startswith("sampler-") for b in bs]


def session_affinity(gw: Gateway, redis_url: str, prefix: str, model: str, sessions: int = 12) -> dict[str, Any]:
    """Many sampling sessions, several requests each, over two sampler replicas: every session is served by exactly
    one replica, and the sessions are spread over both."""
    import tinker
    from tinker import types

    t0 = time.monotonic()
    while len(_sampler_replicas(redis_url, prefix)) < 2 and time.monotonic() - t0 < 120:
        time.sleep(1)  # /readyz needs one live replica per deployment; this check needs both
    time.sleep(3)  # the router's handle learns of a new replica within moments of it starting
    prompt = types.ModelInput.from_ints(batch(1)[0].model_input.to_ints()[:4])
    with tinker.ServiceClient(base_url=gw.base_url, api_key=gw.api_key) as sc:
        clients = [sc.create_sampling_client(base_model=model) for _ in range(sessions)]
        for _ in range(3):
            futures = [c.sample(prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=2, seed=i))
                       for i, c in enumerate(clients)]
            assert all(len(f.result().sequences) == 1 for f in futures)
    time.sleep(2.5)  # one heartbeat period: the replicas report what they served
    replicas = _sampler_replicas(redis_url, prefix)
    served = {b["replica"]: set(b["info"].get("sessions", [])) for b in replicas}
    seen = [s for ss in served.values() for s in ss]
    ok = (len(replicas) == 2 and len(seen) == len(set(seen)) and len(set(seen)) >= sessions
          and all(served.values()))  # 12 sessions all on one replica by chance: p = 2 ** -11
    return {"check": "session_affinity", "ok": ok, "replicas": len(replicas), "sessions_seen": len(set(seen)),
            "per_replica": {r: len(ss) for r, ss in served.items()}, "seconds": round(time.monotonic() - t0, 1)}


def hub_push(gw: Gateway, hub: Any, token: str, tinker_path: str) -> dict[str, Any]:
    """A hub push through the gateway's native API runs on the hub-pusher deployment (via Redis): the fake hub gets
    the checkpoint's files in a private repo, with the tenant's token."""
    t0 = time.monotonic()
    headers = {"X-API-Key": gw.api_key}
    with httpx.Client(base_url=f"{gw.base_url}/native/v1", headers=headers, timeout=30) as http:
        assert http.put("/hub/tokens/huggingface", json={"token": token}).status_code == 200
        started = http.post("/checkpoints/push", json={"tinker_path": tinker_path, "repo_id": "ray/lora"})
        assert started.status_code == 202, started.text
        push_id, body = started.json()["push_id"], started.json()
        while body["status"] in ("queued", "running") and time.monotonic() - t0 < 120:
            time.sleep(0.5)
            body = http.get(f"/pushes/{push_id}").json()
    repo = hub.repos.get("ray/lora")
    files = sorted(repo.files) if repo else []
    ok = (body["status"] == "succeeded" and repo is not None and repo.visibility == "private"
          and "adapter_model.safetensors" in files and f"Bearer {token}" in hub.seen_auth
          and token not in gw.log())
    return {"check": "hub_push", "ok": ok, "status": body["status"], "error": body.get("error"), "files": files,
            "seconds": round(time.monotonic() - t0, 1)}


def runtime_budgets(gw: Gateway, redis_url: str, prefix: str, model: str, token_budget: int) -> dict[str, Any]:
    """The trainer replica applies what the gateway's settings and the YAML config say (workers/runtime.py): a
    device budget of 0 and a host budget of 0 (TWINKLE_ADAPTER_*_BUDGET_BYTES) send an idle adapter to the spill dir
    under the data dir, the scheduler packs up to the config's `limits.train_token_budget`, and the gateway publishes
    the tenant's resident-adapter quota (set with `tenants set-quota`) into Redis for the trainer."""
    import redis
    import tinker

    t0 = time.monotonic()
    # checked while the session lives: finishing it releases both adapters (and deletes their spill files)
    with tinker.ServiceClient(base_url=gw.base_url, api_key=gw.api_key) as sc:
        first = sc.create_lora_training_client(base_model=model, rank=4, seed=1)
        sft(first, 2)
        second = sc.create_lora_training_client(base_model=model, rank=4, seed=2)
        losses = sft(second, 2)  # the first adapter is idle now: paged out, to disk
        info: dict[str, Any] = {}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the next heartbeat reports the tiers after the last step
            beats = [b for name, bs in heartbeats(redis_url, prefix).items() if name.startswith("trainer-") for b in bs]
            info = beats[0]["info"] if beats else {}
            if info.get("paging", {}).get("tiers", {}).get("disk", 0) >= 1:
                break
            time.sleep(0.5)
        spilled = sorted(p.name for p in (gw.data_dir / "adapter-spill").rglob("*.safetensors"))
    client = redis.Redis.from_url(redis_url)
    try:
        published = {k.decode(): v.decode() for k, v in client.hgetall(f"{prefix}:quota:resident").items()}
    finally:
        client.close()
    paging = info.get("paging", {})
    ok = (info.get("token_budget") == token_budget and paging.get("device_budget_bytes") == 0
          and paging.get("host_budget_bytes") == 0 and paging.get("tiers", {}).get("disk", 0) >= 1
          and len(spilled) >= 1 and sorted(v for k, v in published.items() if k != "*") == ["1"]
          and all(math.isfinite(loss) for loss in losses))
    return {"check": "runtime_budgets", "ok": ok, "trainer_info": info, "spilled": spilled, "published": published,
            "seconds": round(time.monotonic() - t0, 1)}
