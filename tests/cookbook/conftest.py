"""tinker-cookbook 0.6.1's library loops, unmodified, against a server subprocess (scripts/test_cookbook.sh).

The tests run in a venv of their own holding tinker-cookbook (installed --no-deps with its declared requirements, less
the unpublished tml-renderers) and tinker 0.38.0; the server and the tiny model it serves run from the project's venv
($TWINKLE_SERVER_PYTHON, default .venv/bin/python). Elsewhere (the main suite's venv has no tinker_cookbook) the test
modules are not collected.

The served model is named by its folder's path, so the cookbook's `get_tokenizer(model_name)` loads it offline; the
chat format is the cookbook's generic `role_colon` renderer (the tiny model belongs to no family the cookbook knows).
The cookbook reads the key from TINKER_API_KEY.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import ServerProcess, add_server_log

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

if importlib.util.find_spec("tinker_cookbook") is None:  # the main suite's venv: scripts/test_cookbook.sh runs these
    collect_ignore_glob = ["test_*.py"]

ROOT = Path(__file__).resolve().parents[2]
SERVER_PYTHON = os.environ.get("TWINKLE_SERVER_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
_BUILD = ("import sys; from pathlib import Path; from tests.support.tiny_model import build_tiny_model; "
          "build_tiny_model(Path(sys.argv[1]), seed=int(sys.argv[2]), logit_scale=float(sys.argv[3]))")


def build_model(folder: Path, seed: int = 0, logit_scale: float = 1.0) -> Path:
    """A tiny model built by the server's interpreter (the one that serves it)."""
    subprocess.run([SERVER_PYTHON, "-c", _BUILD, str(folder), str(seed), str(logit_scale)], cwd=ROOT, check=True,
                   timeout=300)
    return folder


def start_server(data_dir: Path, models: list[Path]) -> ServerProcess:
    args: list[str] = []
    for m in models[1:]:
        args += ["--base-model", str(m)]
    srv = ServerProcess(data_dir, str(models[0]), env={"PYTHONPATH": str(ROOT)}, python=SERVER_PYTHON,
                        args=tuple(args))
    srv.api_key_a = srv.create_key("cookbook")  # type: ignore[attr-defined]
    srv.start()
    return srv


@pytest.fixture(scope="session", autouse=True)
def no_pricing_download() -> None:
    """The loops' cost tracker downloads a pricing file from the Tinker docs once per process; the tests reach no
    host outside this machine, so the cookbook's cache is marked as fetched (its own "no pricing" state: token
    counts only) before any loop starts."""
    from tinker_cookbook.utils import cost_estimation

    cost_estimation._pricing_fetched = True  # noqa: SLF001 - the module's documented once-per-process cache


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = start_server(tmp_path_factory.mktemp("server"), [model_dir])
    yield srv
    srv.stop()


@pytest.fixture
def cookbook_env(server: ServerProcess, monkeypatch: pytest.MonkeyPatch) -> ServerProcess:
    """The cookbook's clients find the server's key in TINKER_API_KEY."""
    monkeypatch.setenv("TINKER_API_KEY", server.api_key_a)  # type: ignore[attr-defined]
    return server


def metric_rows(log_path: Path) -> list[dict[str, Any]]:
    """The rows the cookbook's ml_log wrote to <log_path>/metrics.jsonl, one per step."""
    with open(log_path / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    add_server_log(item, outcome.get_result(), "server")
