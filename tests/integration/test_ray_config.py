"""The Ray backend's configuration and packaging, without starting Ray: the YAML application config is validated
with field-naming errors (and the CLI fails at start with them), every shipped config is valid, the session router
keeps sessions on their replica, and docker-compose.yml / the Dockerfile / the KubeRay example are consistent
(`docker compose config -q` where a compose CLI is installed)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy.ray_config import ConfigError, load_config, parse_config, slug

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.ray


@pytest.mark.parametrize(("data", "field", "message"), [
    ({"models": []}, "models", "at least 1 item"),
    ({"models": [{"name": "m", "sampler": {"replicas": 0}}]}, "models.0.sampler.replicas", "greater than or equal"),
    ({"models": [{"name": "m", "trainr": {}}]}, "models.0.trainr", "Extra inputs"),
    ({"models": [{"name": "m", "sampler": {"backend": "tgi"}}]}, "models.0.sampler.backend", "'torch' or 'vllm'"),
    ({"models": [{"name": "m", "device": "cuda"}]}, "models.0", "trainer.num_gpus"),
    ({"models": [{"name": "m"}, {"name": "m"}]}, "(top level)", "listed twice"),
    ({"models": [{"name": "m"}], "limits": {"result_ttl_seconds": 10}}, "limits.result_ttl_seconds", "300"),
    ({"models": [{"name": "m", "sampler": {"autoscaling": {"min_replicas": 5, "max_replicas": 2}}}]},
     "models.0.sampler.autoscaling", "min_replicas"),
])
def test_invalid_config_names_the_field(data: dict, field: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(data, "app.yaml")
    text = str(e.value)
    assert "app.yaml" in text and f"  {field}:" in text and message in text, text


def test_valid_config_defaults_and_resources() -> None:
    cfg = parse_config({"models": [{"name": "org/m", "trainer": {"num_gpus": 1, "resources": {"gpu_node": 1}}}]})
    m = cfg.models[0]
    assert m.source == "org/m" and m.sampler.backend == "torch" and m.sampler.replicas == 1
    assert m.trainer.actor_options() == {"num_cpus": 1.0, "num_gpus": 1.0, "resources": {"gpu_node": 1.0}}
    assert slug("org/m") != slug("other/m") and re.fullmatch(r"[A-Za-z0-9-]+", slug("org/Qwen3.5 8B"))


@pytest.mark.parametrize("name", ["ray-app.yaml", "ray-app.compose.yaml", "ray-app.kuberay.yaml"])
def test_shipped_configs_are_valid(name: str) -> None:
    cfg = load_config(ROOT / "deploy" / name)
    assert cfg.models and cfg.fingerprint() == load_config(ROOT / "deploy" / name).fingerprint()


def test_cli_fails_at_start_naming_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  - name: m\n    sampler: {replicas: -1}\n")
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", "--backend", "ray", "--config", str(bad),
                          "--data-dir", str(tmp_path / "d"), "--redis-url", "redis://127.0.0.1:1/0"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2, out.stderr
    assert "models.0.sampler.replicas" in out.stderr and str(bad) in out.stderr, out.stderr
    missing = subprocess.run([sys.executable, "-m", "deploy.cli", "serve", "--backend", "ray", "--config",
                              str(tmp_path / "nope.yaml"), "--data-dir", str(tmp_path / "d")],
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert missing.returncode == 2 and "does not exist" in missing.stderr, missing.stderr


def test_session_router_is_sticky_and_moves_only_a_removed_replicas_sessions() -> None:
    pytest.importorskip("ray.serve")
    from workers.session_router import rank_replicas

    replicas = [f"r{i}" for i in range(4)]
    sessions = [f"sampler-session-{i}" for i in range(400)]
    first = {s: rank_replicas(s, replicas)[0] for s in sessions}
    assert first == {s: rank_replicas(s, list(reversed(replicas)))[0] for s in sessions}  # order-independent
    counts = {r: list(first.values()).count(r) for r in replicas}
    assert min(counts.values()) > 50, counts  # spread over every replica
    after = {s: rank_replicas(s, replicas[:3])[0] for s in sessions}
    moved = [s for s in sessions if first[s] != after[s]]
    assert moved and all(first[s] == "r3" for s in moved)  # only the removed replica's sessions moved


def test_compose_file_is_consistent() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"gateway", "redis", "postgres", "ray-head", "ray-worker"} <= set(services)
    for name in ("gateway", "redis", "postgres", "ray-head", "ray-worker"):
        assert "healthcheck" in services[name], name
    assert "--appendonly" in services["redis"]["command"] and "yes" in services["redis"]["command"]
    assert services["gateway"]["env_file"] == "deploy/env.example" and (ROOT / "deploy/env.example").is_file()
    dockerfile = (ROOT / "Dockerfile").read_text()
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, flags=re.MULTILINE))
    assert {"cpu", "cuda"} <= targets
    assert services["gateway"]["build"]["target"] in targets
    config = services["gateway"]["command"][services["gateway"]["command"].index("--config") + 1]
    assert load_config(ROOT / config.removeprefix("/app/"))
    env = dict(line.split("=", 1) for line in (ROOT / "deploy/env.example").read_text().splitlines()
               if line and not line.startswith("#"))
    assert {"TWINKLE_REDIS_URL", "TWINKLE_DATABASE_URL", "TWINKLE_SIGNING_SECRET"} <= set(env)


def _compose_cli() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_docker_compose_config_passes() -> None:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no docker compose CLI installed")
    out = subprocess.run([*cli, "config", "-q"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_kuberay_example_points_at_a_valid_application() -> None:
    docs = list(yaml.safe_load_all((ROOT / "deploy/kuberay/rayservice.yaml").read_text()))
    kinds = {d["kind"]: d for d in docs}
    assert {"RayService", "Deployment", "Service", "Secret"} <= set(kinds)
    serve_config = yaml.safe_load(kinds["RayService"]["spec"]["serveConfigV2"])
    (app,) = serve_config["applications"]
    module, func = app["import_path"].split(":")
    assert module == "deploy.ray_app" and func == "app_builder"
    assert load_config(ROOT / app["args"]["config"].removeprefix("/app/"))
    gateway = kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert gateway["readinessProbe"]["httpGet"]["path"] == "/readyz" and "--no-deploy" in gateway["command"]
    cluster = kinds["RayService"]["spec"]["rayClusterConfig"]
    assert "trainer_node" in cluster["headGroupSpec"]["rayStartParams"]["resources"]
    assert "sampler_node" in cluster["workerGroupSpecs"][0]["rayStartParams"]["resources"]
