"""The tinker-SDK examples, a few steps each on the tiny random model, each asserting its signal moves the right way
(see each example's docstring for why RL asserts the GRPO objective rather than the reward on this model)."""

from __future__ import annotations

import math

import pytest

from tests.examples.conftest import run_example
from tests.support.server import ServerProcess

pytestmark = pytest.mark.timeout(600)


def test_sft_self_cognition_tinker(server: ServerProcess) -> None:
    out, stdout = run_example("sft_self_cognition_tinker.py", "--base-url", server.base_url, "--steps", "4",
                              "--lr", "1e-2", "--rank", "8", api_key=server.api_key_a)  # type: ignore[attr-defined]
    assert out["base_model"] == server.base_model  # the server's first model by default
    assert math.isfinite(out["first_loss"]) and out["last_loss"] < out["first_loss"] * 0.95, out
    assert isinstance(out["answer"], str) and "trained adapter on" in stdout


def test_dpo_lora(server: ServerProcess) -> None:
    out, _ = run_example("dpo_lora.py", "--base-url", server.base_url, "--steps", "3", "--lr", "1e-2",
                         "--rank", "8", "--api-key", server.api_key_a)  # type: ignore[attr-defined]
    assert out["first_loss"] == pytest.approx(math.log(2), rel=1e-4), out  # policy == reference at step 0
    assert out["last_loss"] < out["first_loss"] and out["last_margin"] > 0 and out["last_accuracy"] > 0.5, out


def test_dpo_multi_tenant_with_given_keys(server: ServerProcess) -> None:
    keys = f"{server.api_key_a},{server.api_key_b}"  # type: ignore[attr-defined]
    out, stdout = run_example("dpo_multi_tenant.py", "--base-url", server.base_url, "--steps", "3", "--lr", "1e-2",
                              "--rank", "8", "--api-keys", keys)
    tenants = out["tenants"]
    assert [t["prefers"] for t in tenants] == ["helpful", "curt"] and out["all_losses_fell"], out
    for t in tenants:  # each adapter learned its own tenant's (opposite) preference
        assert t["first_loss"] == pytest.approx(math.log(2), rel=1e-4) and t["last_margin"] > 0, t
    assert "[tenant 0 helpful]" in stdout and "[tenant 1 curt   ]" in stdout


def test_dpo_multi_tenant_creates_keys(server: ServerProcess) -> None:
    out, _ = run_example("dpo_multi_tenant.py", "--base-url", server.base_url, "--steps", "2", "--lr", "1e-2",
                         "--rank", "4", "--data-dir", str(server.data_dir), "--tenants", "3")
    assert len(out["tenants"]) == 3 and out["all_losses_fell"], out


def test_grpo_math(server: ServerProcess) -> None:
    out, _ = run_example("grpo_math.py", "--base-url", server.base_url, "--steps", "3", "--lr", "1e-2",
                         "--rank", "8", api_key=server.api_key_b)  # type: ignore[attr-defined]
    assert 0 <= out["first_reward"] <= 1.2 and 0 <= out["last_reward"] <= 1.2, out
    # the deterministic signal: the first update made the rewarded answers more likely, the penalised ones less
    assert out["surrogate_gain"] is not None and out["surrogate_gain"] > 0, out


def test_examples_need_a_key(server: ServerProcess) -> None:
    import subprocess
    import sys

    from tests.examples.conftest import EXAMPLES

    out = subprocess.run([sys.executable, str(EXAMPLES / "dpo_lora.py"), "--base-url", server.base_url],
                         capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=120)
    assert out.returncode != 0 and "TWINKLE_API_KEY" in out.stderr, out
