"""Runs `twinkle-server serve` as a subprocess on a free port, for conformance and end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cli(*args: str, data_dir: Path, env: dict[str, str] | None = None) -> str:
    """Run a `twinkle-server` subcommand; returns stdout."""
    out = subprocess.run(
        [sys.executable, "-m", "deploy.cli", *args, "--data-dir", str(data_dir)],
        capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=120,
    )
    if out.returncode != 0:
        raise RuntimeError(f"twinkle-server {' '.join(args)} failed:\n{out.stderr}")
    return out.stdout


class ServerProcess:
    def __init__(self, data_dir: Path, base_model: str, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.base_model = base_model
        self.env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", **(env or {})}
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = data_dir / f"server-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def create_key(self, tenant: str) -> str:
        return cli("keys", "create", "--tenant", tenant, data_dir=self.data_dir, env=self.env).strip()

    def start(self, timeout: float = 180.0) -> "ServerProcess":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "deploy.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--data-dir", str(self.data_dir), "--base-model", self.base_model]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/api/v1/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server did not start within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-20000:] if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL the server (a crash); `start()` brings it back on the same port."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class WorkerProcess:
    """`twinkle-server worker` as a subprocess (cluster wiring: TWINKLE_REDIS_URL must be in `env`)."""

    READY = "holds the lease of"

    def __init__(self, data_dir: Path, base_model: str, env: dict[str, str]) -> None:
        self.data_dir = data_dir
        self.base_model = base_model
        self.env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", **env}
        self.log_path = data_dir / f"worker-{uuid.uuid4().hex[:8]}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, wait: bool = True, timeout: float = 180.0) -> "WorkerProcess":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== worker start {self.starts} =====\n".encode())
        self._mark = self.log_path.stat().st_size
        self.starts += 1
        log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "deploy.cli", "worker", "--data-dir", str(self.data_dir),
               "--base-model", self.base_model]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Until this start of the worker holds its training queue's lease (it is then consuming jobs)."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log()}")
            with open(self.log_path, "rb") as f:
                f.seek(self._mark)
                if any(self.READY in line and line.endswith("|train") for line in f.read().decode(errors="replace").splitlines()):
                    return
            time.sleep(0.1)
        raise RuntimeError(f"worker did not take its lease within {timeout}s:\n{self.log()}")

    def kill(self) -> None:
        """SIGKILL: no clean-up, no lease release, in-flight jobs unacknowledged."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-30000:] if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
