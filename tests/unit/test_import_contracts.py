"""The floors of the layout hold: import-linter's contracts (pyproject.toml, [tool.importlinter]) are all kept.

deploy -> server | workers (never each other) -> jobqueue -> api_schemas; api_schemas without torch or FastAPI; the
engine without the Tinker wire types. A second test shows the check bites: a copy of the tree with one forbidden
import added fails it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("api_schemas", "jobqueue", "server", "workers", "deploy")


def _lint(cwd: Path) -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.fail("lint-imports is missing: install the test extra (scripts/install.sh test)")
    return subprocess.run([str(exe), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_import_contracts_are_kept() -> None:
    run = _lint(ROOT)
    assert run.returncode == 0, f"an import contract is broken:\n{run.stdout}\n{run.stderr}"
    assert "0 broken" in run.stdout


@pytest.mark.parametrize(("module", "forbidden", "contract"), [
    ("server/services/__init__.py", "import workers.scheduler", "Floors"),
    ("jobqueue/__init__.py", "from server import config", "Floors"),
    ("api_schemas/__init__.py", "import fastapi", "api_schemas holds wire contracts only"),
    ("workers/engine/__init__.py", "import api_schemas.tinker", "The engine never sees"),
])
def test_a_forbidden_import_breaks_a_contract(tmp_path: Path, module: str, forbidden: str, contract: str) -> None:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\n{forbidden}  # the forbidden import under test\n")
    run = _lint(tmp_path)
    assert run.returncode != 0, run.stdout
    broken = [line for line in run.stdout.splitlines() if line.endswith("BROKEN")]
    assert any(line.startswith(contract) for line in broken), run.stdout
