"""The twinkle_client examples (examples/sft_self_cognition_native.py, examples/rl_multi_turn.py), each run as a
user would run it: a subprocess of this venv's python against the native server with the tiny model, a few steps,
its final JSON summary line checked. Run by scripts/test_native.sh (e.g. `scripts/test_native.sh -k examples`)."""

from __future__ import annotations

import math
import sys

import pytest

from tests.examples.conftest import run_example
from tests.native.conftest import MODEL_NAME, NativeServer

pytestmark = pytest.mark.timeout(600)


def test_sft_self_cognition_native(native_server: NativeServer) -> None:
    srv = native_server
    out, stdout = run_example("sft_self_cognition_native.py", "--base-url", srv.base_url, "--steps", "4",
                              "--lr", "1e-2", "--rank", "8", "--tokenizer", str(srv.model_dir),
                              api_key=srv.api_key_a, python=sys.executable)  # type: ignore[attr-defined]
    assert out["base_model"] == MODEL_NAME  # the server's first model by default
    # the loss over the whole data set (forward_only before and after) fell
    assert math.isfinite(out["first_loss"]) and out["last_loss"] < out["first_loss"] * 0.99, out
    assert out["adapter"].startswith("twinkle://") and "/sampler_weights/" in out["adapter"], out
    assert isinstance(out["answer"], str) and "step   3" in stdout


def test_rl_multi_turn(native_server: NativeServer) -> None:
    srv = native_server
    out, _ = run_example("rl_multi_turn.py", "--base-url", srv.base_url, "--steps", "3", "--lr", "1e-2",
                         "--rank", "8", "--tokenizer", str(srv.model_dir), "--api-key", srv.api_key_b,  # type: ignore[attr-defined]
                         python=sys.executable)
    assert out["turns_per_rollout"] == 2 and out["labels_per_rollout"] > 8, out  # both turns' tokens are labels
    assert 0 <= out["first_reward"] <= 1 and 0 <= out["last_reward"] <= 1, out
    # the deterministic signal: the first update raised the rewarded rollouts' logprobs over the penalised ones'
    assert out["surrogate_gain"] is not None and out["surrogate_gain"] > 0, out
