"""The GPU benchmark's code path, run on CPU with tiny Qwen3 dimensions (the lead runs it on an H200)."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import gpu_mfu


def test_gpu_mfu_runs_on_cpu_with_tiny_dims(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["gpu_mfu.py", "--device", "cpu", "--dtype", "float32", "--shapes", "tiny", "--tenants", "1,3",
            "--tokens-per-step", "96", "--seq-len", "16", "--steps", "1", "--warmup", "0", "--rank", "4"]
    monkeypatch.setattr(sys, "argv", argv)
    gpu_mfu.main()
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["benchmark"] == "gpu_mfu" and [r["tenants"] for r in out["results"]] == [1, 3]
    for r in out["results"]:
        assert r["tokens_per_step"] == 96 and r["shape"] == "tiny"
        assert r["fb_tokens_per_s"] > 0 and 0 < r["lora_mfu_fb"] < 1e-3  # a CPU is far from 989 TFLOP/s
        assert r["lora_mfu_step"] <= r["lora_mfu_fb"]
    n = out["results"][0]["matmul_params"]
    assert n == 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 512 * 64  # 2 x (q,o + k,v + gate,up,down) + lm_head
