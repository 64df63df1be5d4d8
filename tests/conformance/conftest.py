"""Conformance tests: the real tinker==0.38.0 SDK against a server subprocess with the tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.support.server import ServerProcess


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("server"), str(tiny_model_dir), env={"TWINKLE_AUTH_CACHE_SECONDS": "1"})
    srv.api_key_a = srv.create_key("tenant-a")  # type: ignore[attr-defined]
    srv.api_key_b = srv.create_key("tenant-b")  # type: ignore[attr-defined]
    srv.start()
    yield srv
    srv.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    srv = item.funcargs.get("server") if hasattr(item, "funcargs") else None
    if report.failed and isinstance(srv, ServerProcess):
        report.sections.append(("server log", srv.log()))
