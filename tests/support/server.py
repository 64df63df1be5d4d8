"""Runs `twinkle-server serve` (and, for the cluster wiring, `twinkle-server worker`) as subprocesses on free ports,
for conformance and end-to-end tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx

from tests.support.process import ManagedProcess, free_port, quiet_env

__all__ = ["ServerProcess", "WorkerProcess", "cli", "free_port"]


def cli(*args: str, data_dir: Path, env: dict[str, str] | None = None, python: str = sys.executable) -> str:
    """Run a `twinkle-server` subcommand (with `python`: another venv's, tests/compat); returns stdout."""
    out = subprocess.run(
        [python, "-m", "deploy.cli", *args, "--data-dir", str(data_dir)],
        capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=120,
    )
    if out.returncode != 0:
        raise RuntimeError(f"twinkle-server {' '.join(args)} failed:\n{out.stderr}")
    return out.stdout


def healthy(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


class ServerProcess(ManagedProcess):
    what = "server"

    def __init__(self, data_dir: Path, base_model: str, env: dict[str, str] | None = None,
                 python: str = sys.executable, args: tuple[str, ...] = (), name: str | None = None) -> None:
        self.data_dir = data_dir
        self.model_folder = base_model  # what `--base-model` loads
        self.base_model = name or base_model  # what clients call it: `name` (`--served-model-name`), or the folder
        # more `serve` arguments (e.g. more base models, served names)
        self.args = (("--served-model-name", name) if name else ()) + args
        self.env = quiet_env(env)
        self.python = python  # the server's interpreter: the test's own, or the project venv's (tests/compat)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        super().__init__(data_dir / f"server-{self.port}.log")

    def create_key(self, tenant: str) -> str:
        return cli("keys", "create", "--tenant", tenant, data_dir=self.data_dir, env=self.env,
                   python=self.python).strip()

    def start(self, timeout: float = 180.0) -> ServerProcess:
        """Start (or, after `kill()`, restart on the same port) and wait for /healthz."""
        self.launch([self.python, "-m", "deploy.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                     "--data-dir", str(self.data_dir), "--base-model", self.model_folder, *self.args], self.env)
        self.wait_until(lambda: healthy(f"{self.base_url}/api/v1/healthz"), timeout)
        return self


class WorkerProcess(ManagedProcess):
    """`twinkle-server worker` as a subprocess (cluster wiring: TWINKLE_REDIS_URL must be in `env`)."""

    what = "worker"
    log_tail = 30000
    READY = "holds the lease of"

    def __init__(self, data_dir: Path, base_model: str, env: dict[str, str], args: tuple[str, ...] = ()) -> None:
        self.data_dir = data_dir
        self.base_model = base_model
        self.args = args  # more `worker` arguments (e.g. more base models, served names)
        self.lanes = 1 + args.count("--base-model")  # training queues it must hold before it is ready
        self.env = quiet_env(env)
        self.starts = 0
        self._mark = 0
        super().__init__(data_dir / f"worker-{uuid.uuid4().hex[:8]}.log")

    def start(self, wait: bool = True, timeout: float = 180.0) -> WorkerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== worker start {self.starts} =====\n".encode())
        self._mark = self.log_path.stat().st_size
        self.starts += 1
        self.launch([sys.executable, "-m", "deploy.cli", "worker", "--data-dir", str(self.data_dir),
                     "--base-model", self.base_model, *self.args], self.env)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until this start of the worker holds the lease of each of its models' training queues (it is then
        consuming their jobs)."""
        self.wait_until(self._holds_lease, timeout, interval=0.1)

    def _holds_lease(self) -> bool:
        with open(self.log_path, "rb") as f:
            f.seek(self._mark)
            lines = f.read().decode(errors="replace").splitlines()
        lines = [json.loads(line).get("msg", "") if line.startswith("{") else line for line in lines]  # JSON logs too
        return len({line for line in lines if self.READY in line and line.endswith("|train")}) >= self.lanes


def two_tenant_server(data_dir: Path, base_model: str, python: str = sys.executable) -> ServerProcess:
    """A started server with keys of two tenants (`api_key_a`, `api_key_b`); keys are re-checked every second."""
    srv = ServerProcess(data_dir, base_model, env={"TWINKLE_AUTH_CACHE_SECONDS": "1"}, python=python)
    srv.api_key_a = srv.create_key("tenant-a")  # type: ignore[attr-defined]
    srv.api_key_b = srv.create_key("tenant-b")  # type: ignore[attr-defined]
    srv.start()
    return srv


def student_teacher_server(data_dir: Path, student: Path, teacher: Path, names: tuple[str, str]) -> ServerProcess:
    """A started server serving two models of one tokenizer under `names` (student first), tenant A's key."""
    srv = ServerProcess(data_dir, str(student), env={"TWINKLE_AUTH_CACHE_SECONDS": "1"},
                        args=("--served-model-name", names[0], "--base-model", str(teacher),
                              "--served-model-name", names[1]))
    srv.api_key_a = srv.create_key("tenant-a")  # type: ignore[attr-defined]
    srv.start()
    return srv


def add_server_log(item: object, report: object, fixture: str) -> None:
    """In a conftest's pytest_runtest_makereport: a failed test's report gets the log of its `fixture` server."""
    funcargs = getattr(item, "funcargs", {})
    srv = funcargs.get(fixture)
    if getattr(report, "failed", False) and isinstance(srv, ServerProcess):
        report.sections.append(("server log", srv.log()))  # type: ignore[attr-defined]

