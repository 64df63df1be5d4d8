"""End-to-end run of the Ray backend, meant to run inside a loopback-only network namespace (test_ray_serve.py):

    unshare -n sh -c 'ip link set lo up; exec python tests/integration/ray_flow.py --scenario single --work DIR'

It starts a test-owned redis-server, a Ray cluster (one node, or two with the trainer and the sampler pinned to
different nodes by custom resources), and `twinkle-server serve --backend ray` with the tiny model; waits for
`/readyz`; runs the stock tinker SDK's SFT + sampling flow; in the `single` scenario it also SIGKILLs the trainer
replica mid-run and checks that Serve replaced it and the final weights and optimizer state equal an uninterrupted
run's, checks session affinity over two sampler replicas, and pushes a checkpoint through the hub-pusher deployment
to a fake hub; the `budgets` scenario checks that the trainer replica applies the paging budgets, the token budget
and the tenants' published quotas (workers/runtime.py); the `two-models` scenario serves two base models from the
YAML's models list, each trained and sampled by a tenant of its own; the `two-node` scenario runs with tracing on
and checks that the replicas' job spans reach an OTLP collector in the gateway's traces. Prints one `RESULT {json}`
line per check and exits 1 on any failure (with the logs).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["RAY_AUTH_MODE"] = "disabled"  # the same as the test cluster's nodes (tests/support/ray_cluster.py)

import httpx

from tests.integration.fake_hub import FakeHub
from tests.support.otlp import OtlpReceiver
from tests.support.ray_cluster import RayCluster
from tests.support.ray_sdk import (
    Gateway,
    heartbeats,
    hub_push,
    model_replicas,
    replica_metrics,
    runtime_budgets,
    sdk_flow,
    session_affinity,
    traces,
    weights_survive_kill,
)
from tests.support.redis_server import RedisServer
from tests.support.server import cli
from tests.support.tiny_model import build_tiny_model

HUB_TOKEN = "hf_ray_test_token_123"
SECRET = "ray-test-secret-0123456789"
SCENARIOS = {
    # one node, 2 CPUs: trainer 0.5, two sampler replicas 0.5 each, router and pusher 0.1 each
    "single": {"head": (2, {"trainer_node": 1, "sampler_node": 1}), "node": None},
    # the trainer on the head, the sampler on a second node: pinned by custom resources
    "two-node": {"head": (1, {"trainer_node": 1}), "node": (1, {"sampler_node": 1})},
    # one node: the trainer's paging budgets (environment), token budget (YAML) and a tenant's published quota
    "budgets": {"head": (2, {"trainer_node": 1, "sampler_node": 1}), "node": None},
    # one node: two base models in the YAML's models list, each with its own trainer, sampler and router
    "two-models": {"head": (2, {"trainer_node": 1, "sampler_node": 1}), "node": None},
}
BUDGET_TOKENS = 1234  # limits.train_token_budget of the budgets scenario


def app_config(model_dirs: list[Path], scenario: str) -> dict:
    cpus = {"two-node": 0.7, "two-models": 0.4}.get(scenario, 0.5)
    sampler_replicas = 2 if scenario == "single" else 1  # two replicas: sessions must stick to one of them
    limits = {"worker_lease_seconds": 3, "snapshot_every_steps": 3, "reclaim_idle_seconds": 10}
    if scenario == "budgets":
        limits["train_token_budget"] = BUDGET_TOKENS
    fast = {"health_check_period_s": 1, "health_check_timeout_s": 10, "graceful_shutdown_timeout_s": 2}
    return {
        "app_name": "twinkle-test",
        "models": [{
            "name": str(model_dir), "dtype": "float32", "device": "cpu",
            "trainer": {"num_cpus": cpus, "resources": {"trainer_node": 0.5}, **fast},
            "sampler": {"backend": "torch", "replicas": sampler_replicas, "num_cpus": cpus,
                        "resources": {"sampler_node": 0.25},
                        "max_ongoing_requests": 16, **fast},
            "router": {"num_cpus": 0.1},
        } for model_dir in model_dirs],
        "pusher": {"num_cpus": 0.1, "replicas": 1},
        "limits": limits,
    }


def run(scenario: str, work: Path) -> list[dict]:
    import yaml

    results: list[dict] = []
    t0 = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    model_dir = build_tiny_model(work / "model")
    models = [model_dir, build_tiny_model(work / "model-b", seed=1)] if scenario == "two-models" else [model_dir]
    redis = RedisServer(work / "redis").start()
    hub = FakeHub({HUB_TOKEN}).__enter__()  # a stand-in Hugging Face Hub on loopback, for the pusher deployment
    # the Ray nodes' environment: the pusher may reach the hub, and shares the gateway's secret (it unseals tokens)
    os.environ.update({"HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1", "TWINKLE_SIGNING_SECRET": SECRET})
    cluster = RayCluster(work)
    collector = OtlpReceiver().__enter__() if scenario == "two-node" else None  # tracing on, to this collector
    gateway: Gateway | None = None
    try:
        head_cpus, head_res = SCENARIOS[scenario]["head"]
        cluster.start_head(head_cpus, head_res)
        if SCENARIOS[scenario]["node"] is not None:
            cpus, res = SCENARIOS[scenario]["node"]
            cluster.add_node(cpus, res, "node2")
        cfg = work / "ray-app.yaml"
        cfg.write_text(yaml.safe_dump(app_config(models, scenario)))
        env = {"TWINKLE_REDIS_URL": redis.url, "TWINKLE_REDIS_PREFIX": "raytest", "TWINKLE_LONG_POLL_SECONDS": "10",
               "TWINKLE_HF_ENDPOINT": hub.url, **cluster.env}
        if collector is not None:  # the replicas get the endpoint from the gateway's settings (worker_options)
            env.update({"TWINKLE_OTEL_ENDPOINT": collector.url + "/v1/traces",
                        "TWINKLE_OTEL_SERVICE_NAME": "twinkle-ray-test", "OTEL_BSP_SCHEDULE_DELAY": "100"})
        if scenario == "budgets":  # from the gateway's settings to the trainer replica's runtime
            env.update({"TWINKLE_ADAPTER_DEVICE_BUDGET_BYTES": "0", "TWINKLE_ADAPTER_HOST_BUDGET_BYTES": "0",
                        "TWINKLE_QUOTA_CACHE_SECONDS": "1"})
        gateway = Gateway(work / "data", cfg, cluster.address, env)
        gateway.start()
        if scenario == "budgets":
            cli("tenants", "set-quota", "ray-tenant", "--max-resident-adapters", "1", data_dir=gateway.data_dir,
                env=gateway.env)
        ready_s = gateway.wait_ready(timeout=420, alive=cluster.check)
        results.append({"check": "ready", "ok": True, "seconds": round(ready_s, 1),
                        "readyz": httpx.get(f"{gateway.base_url}/readyz").json()})
        beats = heartbeats(redis.url, "raytest")
        if scenario == "budgets":
            results.append(runtime_budgets(gateway, redis.url, "raytest", str(model_dir), BUDGET_TOKENS))
        elif scenario == "two-models":  # each model trained and sampled by a tenant of its own
            served = [str(m) for m in models]
            key_b = cli("keys", "create", "--tenant", "ray-tenant-b", data_dir=gateway.data_dir,
                        env=gateway.env).strip()
            results.append(sdk_flow(gateway, served[0], served, name="sdk_flow_a"))
            results.append(sdk_flow(gateway, served[1], served, api_key=key_b, name="sdk_flow_b"))
            results.append(model_replicas(gateway, redis.url, "raytest", served))
        else:
            results.append(flow := sdk_flow(gateway, str(model_dir)))
            results.append(replica_metrics(gateway, flow))
        if scenario == "two-node":
            results.append(placement(cluster, beats))
        if collector is not None:
            results.append(traces(collector))
        if scenario == "single":
            results.append(hub_push(gateway, hub, HUB_TOKEN, flow["path"]))
            results.append(session_affinity(gateway, redis.url, "raytest", str(model_dir)))
            results.append(weights_survive_kill(gateway, redis.url, "raytest", str(model_dir), cluster))
    except Exception as e:  # noqa: BLE001 - reported as a failed check with the logs
        import traceback

        results.append({"check": "error", "ok": False, "error": repr(e), "trace": traceback.format_exc()})
    finally:
        failed = any(not r["ok"] for r in results)
        if failed:
            print("--- gateway log ---\n" + (gateway.log() if gateway else ""))
            print("--- ray head ---\n" + cluster.log("head"))
            print("--- serve logs ---\n" + cluster.serve_logs())
        if gateway is not None:
            gateway.stop()
        cluster.stop()
        redis.stop()
        hub.__exit__(None, None, None)
        if collector is not None:
            collector.__exit__(None, None, None)
    results.append({"check": "total", "ok": True, "seconds": round(time.monotonic() - t0, 1)})
    return results


def placement(cluster: RayCluster, beats: dict[str, list[dict]]) -> dict:
    """The trainer and the sampler replicas run on different nodes, each the one with its custom resource."""
    import ray

    ray.init(address=cluster.address, log_to_driver=False)
    try:
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    finally:
        ray.shutdown()
    trainer = next(b for name, bs in beats.items() if name.startswith("trainer-") for b in bs)
    sampler = next(b for name, bs in beats.items() if name.startswith("sampler-") for b in bs)
    ok = (len(nodes) == 2 and trainer["node"] != sampler["node"]
          and "trainer_node" in nodes.get(trainer["node"], {}) and "sampler_node" in nodes.get(sampler["node"], {}))
    return {"check": "placement", "ok": ok, "trainer_node": trainer["node"][:12], "sampler_node": sampler["node"][:12],
            "nodes": len(nodes)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), required=True)
    ap.add_argument("--work", type=Path, required=True)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # the test's timeout: still tear everything down
    results = run(args.scenario, args.work)
    for r in results:
        print("RESULT " + json.dumps(r, default=str), flush=True)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
