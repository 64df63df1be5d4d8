"""One model cache for every data dir: the default model is converted once per machine, even when two servers
with different data dirs start at the same moment (a file lock beside the target), and the cache is a setting."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.specs import spec_from_settings
from server.config import Settings

# In each process: the real resolve_base_model and convert_gguf_once (lock, partial folder, rename); only the
# dequantisation itself is replaced by a copy of the tiny model that takes a second, and records who ran it.
SCRIPT = """
import os, shutil, sys, time
from pathlib import Path
from workers.engine import model_assets
tiny, gguf, data_dir, cache, log = map(Path, sys.argv[1:6])
def convert(gguf_file, out_dir):
    with open(log, "a") as f:
        f.write(f"{os.getpid()}\\n")
    time.sleep(1.0)
    shutil.copytree(tiny, out_dir, dirs_exist_ok=True)
model_assets._convert_gguf = convert
model_assets._smollm2_gguf_path = lambda: gguf
print(model_assets.resolve_base_model(model_assets.DEFAULT_BASE_MODEL, data_dir, cache))
"""


def _start(tiny: Path, gguf: Path, data_dir: Path, cache: Path, log: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", SCRIPT, str(tiny), str(gguf), str(data_dir), str(cache), str(log)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_data_dirs_convert_once(tiny_model_dir: Path, tmp_path: Path) -> None:
    gguf, cache, log = tmp_path / "model.gguf", tmp_path / "cache", tmp_path / "conversions"
    gguf.write_bytes(b"GGUF")
    procs = [_start(tiny_model_dir, gguf, tmp_path / f"data-{i}", cache, log) for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    folders = {out.strip() for out, _ in outs}
    target = cache / "HuggingFaceTB--SmolLM2-135M-Instruct"
    assert folders == {str(target)} and (target / "config.json").is_file()
    assert len(log.read_text().split()) == 1  # converted once, by one of them; the other waited and reused it
    assert not list(cache.glob(".*.partial-*"))
    assert not (tmp_path / "data-0" / "models").exists() and not (tmp_path / "data-1" / "models").exists()

    t0 = time.monotonic()  # a third data dir later: nothing converted
    third = _start(tiny_model_dir, gguf, tmp_path / "data-2", cache, log)
    out, err = third.communicate(timeout=120)
    assert third.returncode == 0 and out.strip() == str(target), err
    assert len(log.read_text().split()) == 1 and time.monotonic() - t0 < 60


def test_a_data_dir_converted_by_an_older_version_keeps_its_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    import shutil

    legacy = tmp_path / "data" / "models" / "HuggingFaceTB--SmolLM2-135M-Instruct"
    shutil.copytree(tiny_model_dir, legacy)
    gguf, log = tmp_path / "model.gguf", tmp_path / "conversions"
    gguf.write_bytes(b"GGUF")
    proc = _start(tiny_model_dir, gguf, tmp_path / "data", tmp_path / "cache", log)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and out.strip() == str(legacy), err
    assert not log.exists()


def test_the_cache_is_a_setting(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TWINKLE_MODEL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert Settings().model_cache_dir == tmp_path / "xdg" / "twinkle-server" / "models"
    monkeypatch.setenv("TWINKLE_MODEL_CACHE_DIR", str(tmp_path / "mine"))
    settings = Settings(data_dir=tmp_path / "d")
    assert settings.model_cache_dir == tmp_path / "mine"
    assert spec_from_settings(settings).storage.models_dir == tmp_path / "mine"
