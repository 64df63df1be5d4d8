"""A Ray cluster for tests, run inside a loopback-only network namespace (see tests/integration/ray_flow.py).

Each node is a `ray start --block` child of the test process (head, then optional worker nodes on the same
machine, each with its own custom resources so deployments can be pinned to it). Ray's state lives in a short
temp dir of its own, never /tmp/ray, so it cannot meet another Ray on the machine. Teardown terminates the nodes
and then SIGKILLs whatever is left in this network namespace, all of which this test started: never `ray stop`,
which would reach Ray processes outside the test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.server import free_port


def ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


class RayCluster:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.temp_dir = Path(tempfile.mkdtemp(prefix="tr", dir="/tmp"))  # unix socket paths must stay short
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[subprocess.Popen[bytes]] = []
        # A machine shared with other test runs can be slow: give the raylet time to register. Token auth is off
        # explicitly (the cluster lives in a loopback-only namespace); otherwise a ~/.ray/auth_token left by some
        # local `ray.init()` turns it on for the nodes but not for every client.
        self.env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
                    "RAY_raylet_start_wait_time_s": "180", "RAY_AUTH_MODE": "disabled"}

    def _start(self, args: list[str], name: str) -> None:
        log = open(self.log_dir / f"ray-{name}.log", "ab")
        cmd = [ray_bin(), "start", "--block", "--disable-usage-stats", "--node-ip-address=127.0.0.1", *args]
        self.nodes.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env))

    def start_head(self, num_cpus: float, resources: dict[str, float], timeout: float = 120) -> RayCluster:
        self._start(["--head", f"--port={self.port}", f"--num-cpus={int(num_cpus)}", "--include-dashboard=false",
                     f"--temp-dir={self.temp_dir}", f"--resources={json.dumps(resources)}"], "head")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.nodes[0].poll() is not None:
                raise RuntimeError(f"ray head exited:\n{self.log('head')}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"ray head did not listen within {timeout}s:\n{self.log('head')}")

    def add_node(self, num_cpus: float, resources: dict[str, float], name: str) -> None:
        self._start([f"--address={self.address}", f"--num-cpus={int(num_cpus)}",
                     f"--resources={json.dumps(resources)}"], name)

    def check(self) -> None:
        """Raise if a node's `ray start --block` exited (the node is gone)."""
        for p in self.nodes:
            if p.poll() is not None:
                raise RuntimeError(f"a Ray node exited with {p.returncode}: {' '.join(map(str, p.args))}")

    def log(self, name: str) -> str:
        p = self.log_dir / f"ray-{name}.log"
        return p.read_text(errors="replace")[-5000:] if p.exists() else ""

    def serve_logs(self, tail: int = 6000) -> str:
        """The replicas' logs (Serve writes one file per replica), for failure reports."""
        out = []
        for f in sorted(self.temp_dir.glob("session_*/logs/serve/*.log")):
            text = f.read_text(errors="replace")
            if text.strip():
                out.append(f"--- {f.name} ---\n{text[-tail:]}")
        for f in sorted(self.temp_dir.glob("session_*/logs/worker-*.err")):
            text = f.read_text(errors="replace")
            if "Traceback" in text or "Error" in text:
                out.append(f"--- {f.name} ---\n{text[-tail:]}")
        return "\n".join(out)

    def grep_serve_logs(self, needle: str) -> int:
        n = 0
        for f in self.temp_dir.glob("session_*/logs/**/*"):
            if f.is_file() and f.suffix in (".log", ".err", ".out"):
                n += f.read_text(errors="replace").count(needle)
        return n

    def stop(self) -> None:
        for p in reversed(self.nodes):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.nodes:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        kill_namespace_leftovers()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def kill_namespace_leftovers() -> None:
    """SIGKILL every other process in this network namespace (this test made the namespace and all in it)."""
    me = os.getpid()
    try:
        mine = os.readlink("/proc/self/ns/net")
        root = os.readlink("/proc/1/ns/net")
    except OSError:
        return
    if mine == root:  # not inside a namespace of our own: touch nothing
        return
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            if os.readlink(entry / "ns/net") == mine:
                os.kill(int(entry.name), signal.SIGKILL)
        except OSError:
            continue
