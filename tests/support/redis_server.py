"""A test-owned redis-server on a free loopback port (optionally with AOF), started and stopped by the test."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.support.server import free_port


class RedisServer:
    def __init__(self, workdir: Path, aof: bool = False, port: int | None = None) -> None:
        self.workdir = workdir
        self.aof = aof
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    def start(self, timeout: float = 20.0) -> "RedisServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        persistence = (["--appendonly", "yes", "--appendfsync", "everysec", "--save", ""] if self.aof
                       else ["--appendonly", "no", "--save", ""])
        cmd = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
               "--protected-mode", "yes", *persistence]
        log = open(self.workdir / f"redis-{self.port}.log", "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {self.log()}")
            if self._ping():
                return self
            time.sleep(0.05)
        raise RuntimeError(f"redis-server did not answer within {timeout}s: {self.log()}")

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def log(self) -> str:
        p = self.workdir / f"redis-{self.port}.log"
        return p.read_text(errors="replace")[-5000:] if p.exists() else ""

    def shutdown(self) -> None:
        """SHUTDOWN (the server writes its AOF and exits), as an operator's restart would."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                s.sendall(b"SHUTDOWN\r\n")
                s.recv(64)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
