"""Smoke tests of the tinker-SDK examples (examples/*.py): each runs as a user would run it, a subprocess against a
two-tenant server with the tiny model, for a few steps; the test reads its final JSON summary line. The
twinkle_client examples are run from tests/native/test_examples_native.py (scripts/test_native.sh)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.server import ServerProcess, add_server_log, two_tenant_server
from tests.support.server import student_teacher_server as serve_student_teacher
from tests.support.tiny_model import build_tiny_model

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def run_example(script: str, *args: str, api_key: str | None = None, python: str = sys.executable,
                timeout: float = 300) -> tuple[dict[str, Any], str]:
    """Run examples/<script> with `args`; returns (its last line as JSON, its whole stdout)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MODELSCOPE_OFFLINE": "1"}
    env.pop("TWINKLE_API_KEY", None)
    if api_key:
        env["TWINKLE_API_KEY"] = api_key
    out = subprocess.run([python, str(EXAMPLES / script), *args], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=timeout)
    assert out.returncode == 0, f"{script} failed ({out.returncode}):\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines, f"{script} printed nothing:\n{out.stderr[-4000:]}"
    result = json.loads(lines[-1])
    assert result["example"] == Path(script).stem, result
    return result, out.stdout


@pytest.fixture(scope="session")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = two_tenant_server(tmp_path_factory.mktemp("examples-server"), str(tiny_model_dir))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def student_teacher_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """Two tiny models side by side (the distillation examples): the student (the suite's tiny model) served first,
    a teacher with other weights (another seed, the same tokenizer, a sharper output head) second."""
    teacher = build_tiny_model(tmp_path_factory.mktemp("tiny-teacher") / "model", seed=5, logit_scale=8.0)
    srv = serve_student_teacher(tmp_path_factory.mktemp("distill-server"), tiny_model_dir, teacher,
                                ("tiny-student", "tiny-teacher"))
    yield srv
    srv.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    add_server_log(item, outcome.get_result(), "server")
    add_server_log(item, outcome.get_result(), "student_teacher_server")
