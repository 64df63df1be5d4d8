"""`twinkle-server doctor`: everything in place (exit 0), and every broken piece named with what to fix (exit 1):
an unreachable database and Redis, a missing model folder, a taken port, the Ray backend without Redis. Real
Redis and Postgres for the healthy case."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.support.process import free_port


def _doctor(data_dir: Path, *args: str) -> tuple[int, dict[str, str]]:
    """The exit status and each check's line by what it checks ("database", "model X", "disk (data dir)", ...)."""
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "doctor", "--data-dir", str(data_dir), *args],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    rows = out.stdout.splitlines()
    assert rows, out.stderr
    lines = {}
    for line in rows[:-1]:
        what = line[8:].split("  ")[0].strip()  # "  <status:5> <what padded>  <detail>"
        lines[what] = line.strip()
    return out.returncode, {**lines, "last": rows[-1]}


def test_doctor_passes_when_everything_is_there(tmp_path: Path, tiny_model_dir: Path, redis_url: str,
                                                postgres_url: str) -> None:
    code, lines = _doctor(tmp_path / "d", "--base-model", str(tiny_model_dir), "--port", str(free_port()))
    assert code == 0, lines
    assert lines["database"].split()[0] == "ok" and "created at the first start" in lines["database"]
    assert lines["redis"].split()[0] == "skip" and lines["ray"].split()[0] == "skip"
    assert lines["port"].split()[0] == "ok" and lines[f"model {tiny_model_dir}"].split()[0] == "ok"
    assert lines["last"] == "everything a start needs is in place"

    code, lines = _doctor(tmp_path / "d", "--base-model", str(tiny_model_dir), "--port", str(free_port()),
                          "--redis-url", redis_url, "--database-url", postgres_url)
    assert code == 0, lines
    assert lines["redis"].split()[0] == "ok" and "answers" in lines["redis"]
    assert lines["database"].split()[0] == "warn" and "schema empty" in lines["database"]  # a new database
    assert "@" not in lines["database"]  # the URL's credentials are never printed


def test_doctor_names_each_problem_and_its_fix(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, lines = _doctor(tmp_path / "d", "--base-model", str(tmp_path / "no-such-model"), "--port", str(port),
                              "--redis-url", "redis://127.0.0.1:1/0",
                              "--database-url", "postgresql://u:secret@127.0.0.1:1/x")
    assert code == 1
    for what in ("database", "redis", "port", f"model {tmp_path / 'no-such-model'}"):
        assert lines[what].split()[0] == "FAIL", lines
    assert "TWINKLE_DATABASE_URL" in lines["database"] and "secret" not in lines["database"]
    assert "start Redis" in lines["redis"] and "choose --port" in lines["port"]
    assert "does not exist" in lines[f"model {tmp_path / 'no-such-model'}"]
    assert lines["last"] == "4 problem(s) to fix"

    code, lines = _doctor(tmp_path / "d", "--backend", "ray", "--port", str(free_port()),
                          "--base-model", str(tmp_path))
    assert code == 1 and lines["ray"].split()[0] == "FAIL" and "TWINKLE_REDIS_URL" in lines["ray"]
