"""Older tinker SDKs, unmodified, against a server subprocess (scripts/test_sdk_compat.sh).

The tests run in a venv of their own holding the old SDK (tinker==0.16.1, no torch); the server, and the tiny model it
serves, run from the project's venv ($TWINKLE_SERVER_PYTHON, default .venv/bin/python). Under any other SDK version
(the main suite's 0.38) the tests skip.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server import ServerProcess, add_server_log, two_tenant_server

ROOT = Path(__file__).resolve().parents[2]
SERVER_PYTHON = os.environ.get("TWINKLE_SERVER_PYTHON") or str(ROOT / ".venv" / "bin" / "python")
_BUILD = ("import sys; from pathlib import Path; from tests.support.tiny_model import build_tiny_model; "
          "build_tiny_model(Path(sys.argv[1]))")


@pytest.fixture(scope="session")
def compat_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = tmp_path_factory.mktemp("tiny-model") / "model"
    subprocess.run([SERVER_PYTHON, "-c", _BUILD, str(model)], cwd=ROOT, check=True, timeout=300)
    srv = two_tenant_server(tmp_path_factory.mktemp("server"), str(model), python=SERVER_PYTHON)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def full_param_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server whose operator offers full-parameter training on its model (TWINKLE_FULL_PARAM_MODELS=*)."""
    model = tmp_path_factory.mktemp("tiny-model-full") / "model"
    subprocess.run([SERVER_PYTHON, "-c", _BUILD, str(model)], cwd=ROOT, check=True, timeout=300)
    srv = ServerProcess(tmp_path_factory.mktemp("server-full"), str(model), python=SERVER_PYTHON,
                        env={"TWINKLE_FULL_PARAM_MODELS": "*", "TWINKLE_AUTH_CACHE_SECONDS": "1"})
    srv.api_key_a = srv.create_key("tenant-a")  # type: ignore[attr-defined]
    srv.start()
    yield srv
    srv.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    for fixture in ("compat_server", "full_param_server"):
        add_server_log(item, outcome.get_result(), fixture)
