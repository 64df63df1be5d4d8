"""The Ray backend end to end, each scenario in a loopback-only network namespace of its own (unshare -n): a local
Ray cluster (2 CPUs, no dashboard), a test-owned Redis, `twinkle-server serve --backend ray` with the tiny model, and
the stock tinker SDK. tests/integration/ray_flow.py does the work and prints one RESULT line per check:
- single node: `/readyz` turns ready, SFT + sampling pass, each of several sampling sessions is served by one of
  the two sampler replicas only, a hub push runs on the pusher deployment (to a fake hub); the trainer replica is SIGKILLed mid-run, Serve replaces
  it, and the final weights and optimizer state equal an uninterrupted run's (snapshot + replay);
- two nodes (a second `ray start` in the same namespace): the trainer on the head, the sampler on the other node
  (custom resources), and the flow still passes; tracing is on, and the replicas' job spans reach an OTLP collector
  as children of the gateway's request spans;
- two base models in the YAML's models list: each has its own trainer, sampler and router, and a tenant on each
  trains and samples.
Skipped only when Ray Serve is not installed, there is no redis-server, or network namespaces are not permitted.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(1200)]
ROOT = Path(__file__).resolve().parents[2]


def _require_namespace() -> None:
    pytest.importorskip("ray.serve")
    pytest.importorskip("redis")
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server binary")
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("unshare or ip (iproute2) is missing")
    probe = subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"network namespaces are not permitted here: {probe.stderr.decode(errors='replace')[:200]}")


def run_scenario(scenario: str, work: Path, timeout: float = 1100) -> tuple[dict[str, dict], str, float]:
    """Run ray_flow.py in a new network namespace; returns its checks by name, its output and its duration."""
    _require_namespace()
    script = f"ip link set lo up; exec {sys.executable} {ROOT / 'tests/integration/ray_flow.py'} " \
             f"--scenario {scenario} --work {work}"
    t0 = time.monotonic()
    proc = subprocess.run(["unshare", "-n", "sh", "-c", script], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)
    out = proc.stdout + proc.stderr
    checks = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[len("RESULT "):])
            checks[r["check"]] = r
    if proc.returncode != 0 or "error" in checks:
        print(out[-30000:])
    return checks, out, time.monotonic() - t0


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    checks, _, seconds = run_scenario("single", tmp_path_factory.mktemp("ray-single"))
    print(f"single-node scenario: {seconds:.0f}s")
    for check in checks.values():
        print(json.dumps({k: v for k, v in check.items() if k not in ("readyz", "trace")}))
    return checks


def test_ray_deployments_ready_and_sdk_flow(single: dict[str, dict]) -> None:
    assert "error" not in single, single.get("error")
    ready = single["ready"]
    assert ready["ok"]
    kinds = sorted(d["kind"] for d in ready["readyz"]["deployments"])
    assert kinds == ["hub-pusher", "sample-router", "sampler", "trainer"]
    assert all(d["live_replicas"] >= 1 for d in ready["readyz"]["deployments"])
    flow = single["sdk_flow"]
    assert flow["ok"], flow
    assert flow["loss_last"] < flow["loss_first"] * 0.9
    assert single["metrics"]["ok"], single["metrics"]  # each replica's metrics in the gateway's /metrics


def test_ray_hub_push_runs_on_the_pusher_deployment(single: dict[str, dict]) -> None:
    assert "error" not in single, single.get("error")
    push = single["hub_push"]
    assert push["status"] == "succeeded", push
    assert push["ok"], push  # private repo with the adapter files, sent with the tenant's token


def test_ray_sampling_session_sticks_to_one_of_two_sampler_replicas(single: dict[str, dict]) -> None:
    assert "error" not in single, single.get("error")
    affinity = single["session_affinity"]
    assert affinity["replicas"] == 2, affinity
    assert all(n > 0 for n in affinity["per_replica"].values()), affinity  # sessions spread over both
    assert affinity["ok"], affinity  # and no session was served by both replicas


def test_ray_trainer_replica_killed_run_completes_with_same_weights(single: dict[str, dict]) -> None:
    assert "error" not in single, single.get("error")
    kill = single["trainer_kill"]
    assert kill["new_pids"] and kill["old_pid"] not in kill["new_pids"], kill  # Serve started a new replica
    assert kill["rebuilt_logged"] >= 1, kill  # which rebuilt the adapter from snapshot + replay
    assert kill["max_abs_diff"] < 1e-6, kill
    assert kill["ok"], kill


def test_ray_two_nodes_trainer_and_sampler_on_different_nodes(tmp_path: Path) -> None:
    checks, _, seconds = run_scenario("two-node", tmp_path / "ray-two")
    print(f"two-node scenario: {seconds:.0f}s")
    assert "error" not in checks, checks.get("error")
    placement = checks["placement"]
    assert placement["nodes"] == 2 and placement["trainer_node"] != placement["sampler_node"], placement
    assert placement["ok"], placement
    # tracing on: the trainer replica's and the sample router's job spans joined the gateway's request traces
    assert checks["traces"]["ok"], checks["traces"]
    assert checks["sdk_flow"]["ok"], checks["sdk_flow"]
    assert checks["metrics"]["ok"], checks["metrics"]  # each replica's metrics in the gateway's /metrics


def test_ray_two_base_models_each_with_its_own_replicas(tmp_path: Path) -> None:
    """The YAML's models list with two base models: each gets its own trainer, sampler and router, and a tenant on
    each trains and samples through the stock SDK."""
    checks, _, seconds = run_scenario("two-models", tmp_path / "ray-models")
    print(f"two-models scenario: {seconds:.0f}s")
    assert "error" not in checks, checks.get("error")
    assert checks["ready"]["ok"]
    kinds = sorted(d["kind"] for d in checks["ready"]["readyz"]["deployments"])
    assert kinds == ["hub-pusher", *["sample-router"] * 2, *["sampler"] * 2, *["trainer"] * 2], kinds
    for name in ("sdk_flow_a", "sdk_flow_b"):
        flow = checks[name]
        assert len(flow["models"]) == 2 and flow["loss_last"] < flow["loss_first"] * 0.9, flow
        assert flow["ok"], flow
    assert checks["model_replicas"]["ok"], checks["model_replicas"]
