"""A test-owned redis-server on a free loopback port (optionally with AOF), started and stopped by the test."""

from __future__ import annotations

import shutil
import socket
import subprocess
from pathlib import Path

from tests.support.process import ManagedProcess, free_port


class RedisServer(ManagedProcess):
    what = "redis-server"
    log_tail = 5000

    def __init__(self, workdir: Path, aof: bool = False, port: int | None = None, fsync: str = "everysec") -> None:
        self.workdir = workdir
        self.aof = aof
        self.fsync = fsync  # with aof: "always" loses no acknowledged write to a kill -9
        self.port = port or free_port()
        super().__init__(workdir / f"redis-{self.port}.log")

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @staticmethod
    def available() -> bool:
        return shutil.which("redis-server") is not None

    def start(self, timeout: float = 20.0) -> RedisServer:
        persistence = (["--appendonly", "yes", "--appendfsync", self.fsync, "--save", ""] if self.aof
                       else ["--appendonly", "no", "--save", ""])
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.launch(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                     "--protected-mode", "yes", *persistence])
        self.wait_until(self._ping, timeout, interval=0.05)
        return self

    def _ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def shutdown(self) -> None:
        """SHUTDOWN (the server writes its AOF and exits), as an operator's restart would."""
        if not self.running():
            return
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                s.sendall(b"SHUTDOWN\r\n")
                s.recv(64)
        except OSError:
            pass
        assert self.proc is not None
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.kill()

    def stop(self, timeout: float = 10.0) -> None:
        super().stop(timeout)
