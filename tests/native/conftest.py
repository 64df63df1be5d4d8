"""The native Twinkle protocol with twinkle-kit 0.5.1's own client, unmodified, against a server subprocess
(scripts/test_native.sh).

The tests run in a venv of their own holding twinkle-kit 0.5.1 and what its client and its client-side data preparation
import (torch CPU, transformers, datasets, peft, tinker 0.16.1, ray[serve]); the server and the tiny model it serves run
from the project's venv ($TWINKLE_SERVER_PYTHON, default .venv/bin/python). Elsewhere (the main suite's venv has no
twinkle_client) the test modules are not collected.

The served model is named like a hub id, `twinkle-test/tiny-llama` (a folder of that relative path under the server's
working directory), so the model routes `/api/v1/model/{M}/twinkle/...` see a name with a slash. On the client side
the same folder is the tokenizer that twinkle's `Template` encodes the data with.

twinkle_client keeps base URL, API key and session id in module globals: `connect()` (re)initialises them, so
"tenant B's client" means every object of this process now speaks with B's key and session.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import ServerProcess, add_server_log, healthy

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MODELSCOPE_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if importlib.util.find_spec("twinkle_client") is None:  # the main suite's venv: scripts/test_native.sh runs these
    collect_ignore_glob = ["test_*.py"]

ROOT = Path(__file__).resolve().parents[2]
SERVER_PYTHON = os.environ.get("TWINKLE_SERVER_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
MODEL_NAME = "twinkle-test/tiny-llama"
_BUILD = ("import sys; from pathlib import Path; from tests.support.tiny_model import build_tiny_model; "
          "build_tiny_model(Path(sys.argv[1]))")


class NativeServer(ServerProcess):
    """`twinkle-server serve` started in `models_root`, serving the relative folder MODEL_NAME under it."""

    def __init__(self, data_dir: Path, models_root: Path, python: str) -> None:
        self.models_root = models_root
        self.model_dir = models_root / MODEL_NAME
        super().__init__(data_dir, MODEL_NAME, env={"TWINKLE_AUTH_CACHE_SECONDS": "1",
                                                    "PYTHONPATH": str(ROOT)}, python=python)

    def launch(self, cmd: list[str], env: dict[str, str] | None = None) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.models_root)

    def start(self, timeout: float = 180.0) -> NativeServer:
        self.launch([self.python, "-m", "deploy.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                     "--data-dir", str(self.data_dir), "--base-model", self.base_model], self.env)
        self.wait_until(lambda: healthy(f"{self.base_url}/api/v1/healthz"), timeout)
        return self


@pytest.fixture(scope="session")
def native_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NativeServer]:
    models_root = tmp_path_factory.mktemp("models")
    subprocess.run([SERVER_PYTHON, "-c", _BUILD, str(models_root / MODEL_NAME)], cwd=ROOT, check=True, timeout=300)
    srv = NativeServer(tmp_path_factory.mktemp("server"), models_root, SERVER_PYTHON)
    srv.api_key_a = srv.create_key("tenant-a")  # type: ignore[attr-defined]
    srv.api_key_b = srv.create_key("tenant-b")  # type: ignore[attr-defined]
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def connect(native_server: NativeServer) -> Iterator[Callable[[str], Any]]:
    """`connect(key)` -> a TwinkleClient for that key (init_twinkle_client); the previous one's heartbeat stops."""
    from twinkle_client import init_twinkle_client

    clients: list[Any] = []

    def _connect(api_key: str) -> Any:
        for c in clients:
            c.close()
        client = init_twinkle_client(base_url=native_server.base_url, api_key=api_key, session_heartbeat_interval=5)
        clients.append(client)
        return client

    yield _connect
    for c in clients:
        c.close()


@pytest.fixture(scope="session")
def sc_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.native.data import write_jsonl

    return write_jsonl(tmp_path_factory.mktemp("data") / "self_cognition.jsonl")


@pytest.fixture(scope="session")
def sc_batches(native_server: NativeServer, sc_jsonl: Path) -> list[list[dict[str, Any]]]:
    """The encoded self-cognition rows in batches of 4 (2 batches), from twinkle's local Dataset / DataLoader."""
    from tests.native.data import self_cognition_loader

    batches = list(self_cognition_loader(sc_jsonl, native_server.model_dir, batch_size=4))
    assert len(batches) == 2 and all(len(b) == 4 for b in batches)
    return batches


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    add_server_log(item, outcome.get_result(), "native_server")
