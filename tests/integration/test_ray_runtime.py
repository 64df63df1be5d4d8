"""Under `--backend ray` the trainer replica is built by the same runtime as every other wiring (workers/runtime.py),
so the settings that used to be dropped there apply: in a loopback-only namespace (as test_ray_serve.py), with
TWINKLE_ADAPTER_DEVICE_BUDGET_BYTES=0 and TWINKLE_ADAPTER_HOST_BUDGET_BYTES=0 in the gateway's environment and
`limits.train_token_budget` in the YAML config, two stock-SDK training runs leave the idle adapter spilled under
`<data dir>/adapter-spill/`, the trainer's heartbeat reports the budgets and tiers its runtime applies, and the
gateway publishes the tenant's resident-adapter quota (`tenants set-quota`) into Redis for the trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.test_ray_serve import run_scenario

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(1200)]
BUDGET_TOKENS = 1234  # ray_flow.BUDGET_TOKENS (ray_flow.py is a script: importing it would set its environment)


def test_ray_trainer_applies_paging_and_token_budgets(tmp_path: Path) -> None:
    checks, _, seconds = run_scenario("budgets", tmp_path / "ray-budgets")
    print(f"budgets scenario: {seconds:.0f}s")
    for check in checks.values():
        print(json.dumps({k: v for k, v in check.items() if k not in ("readyz", "trace")}))
    assert "error" not in checks, checks.get("error")
    assert checks["ready"]["ok"]
    budgets = checks["runtime_budgets"]
    info = budgets["trainer_info"]
    assert info["token_budget"] == BUDGET_TOKENS, info  # the dispatcher's scheduler packs up to the config's budget
    assert info["paging"]["device_budget_bytes"] == 0 and info["paging"]["host_budget_bytes"] == 0, info
    assert info["paging"]["tiers"]["disk"] >= 1, info  # the idle adapter went to the spill dir
    assert budgets["spilled"], budgets  # files under <data dir>/adapter-spill/
    assert [v for k, v in budgets["published"].items() if k != "*"] == ["1"], budgets  # the tenant's quota
    assert budgets["ok"], budgets
