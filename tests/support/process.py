"""What every test-owned subprocess (gateway, worker, redis-server) shares: a free loopback port, a log file the
process writes to, waiting until it is ready, and stopping it (politely, then by force)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def quiet_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a test's server process: offline, no OpenMP spin-waiting, plus `env`."""
    return {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "HF_HUB_OFFLINE": "1", **(env or {})}


class ManagedProcess:
    """One subprocess whose stdout and stderr go to `log_path`; `what` names it in errors."""

    what = "process"
    log_tail = 20000  # characters of the log shown in errors and test reports

    def __init__(self, log_path: Path) -> None:
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def launch(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)

    def wait_until(self, ready: Callable[[], bool], timeout: float, interval: float = 0.2) -> float:
        """Poll `ready` until it is true (returns the seconds it took); fails if the process exits first."""
        assert self.proc is not None, f"{self.what} was never started"
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.what} exited with {self.proc.returncode}:\n{self.log()}")
            if ready():
                return time.monotonic() - t0
            time.sleep(interval)
        raise RuntimeError(f"{self.what} was not ready within {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-self.log_tail :] if self.log_path.exists() else ""

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL (a crash): no clean-up at all."""
        if self.running():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
        if self.running():
            assert self.proc is not None
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()


class CrashInjector:
    """`during` hook of an SFT loop (tests/support/sft.py) that SIGKILLs a worker at the chosen steps, a random
    moment (up to `max_delay` s) after the step's requests were sent, and starts it again at once. A kill waits until
    the previous restart holds its lease (is consuming jobs), so every kill hits a working worker."""

    def __init__(self, worker: WorkerLike, kill_steps: set[int], rng: random.Random, max_delay: float) -> None:
        self.worker, self.kill_steps, self.rng, self.max_delay = worker, kill_steps, rng, max_delay
        self.killers: list[threading.Thread] = []

    def __call__(self, step: int) -> None:
        if step not in self.kill_steps:
            return
        self.join()
        self.worker.wait_ready()
        t = threading.Thread(target=self._kill_later, args=(self.rng.uniform(0.0, self.max_delay),))
        t.start()
        self.killers.append(t)

    def _kill_later(self, delay: float) -> None:
        threading.Event().wait(delay)
        self.worker.kill()
        self.worker.start(wait=False)

    def join(self) -> None:
        for t in self.killers:
            t.join()


class WorkerLike(Protocol):
    def wait_ready(self, timeout: float = ...) -> None: ...
    def kill(self) -> None: ...
    def start(self, wait: bool = ..., timeout: float = ...) -> object: ...
