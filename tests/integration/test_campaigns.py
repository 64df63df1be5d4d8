"""The campaigns of issue 19, short. Load (benchmarks/load_campaign.py): stock-SDK clients of three tenants in all
three roles (SFT, RL with sampling, REST reads and saves) at once against a real server; every future resolves,
nothing but 4xx is ever answered, and the server lives. Fault (benchmarks/fault_campaign.py): kill -9 in cluster
mode. The full campaigns' figures are in SECURITY.md."""

from __future__ import annotations

from pathlib import Path

from benchmarks.load_campaign import ROLES, run


def test_short_load_campaign(tmp_path: Path) -> None:
    out = run(clients=6, tenants=3, seconds=20, rss_every=2, future_timeout=120, work_dir=tmp_path)
    assert out["non_4xx_errors"] == 0, out["errors"]
    assert out["lost_futures"] == 0
    assert out["server_alive"]
    assert all(out["roles"][r] == 2 for r in ROLES)
    kinds = out["latency_ms"]
    for kind in ("forward_backward", "optim_step", "sample", "save_for_sampler", "list_runs", "list_checkpoints"):
        assert kinds[kind]["n"] > 0, kind  # every role did its work
    assert out["samples_per_s"] > 0 and out["rss_mb"]["max"] > 0


def test_short_fault_campaign(tmp_path: Path) -> None:
    """Five kill -9 (worker, gateway or Redis with AOF always) while three tenants train in cluster mode: no future
    lost, no error, and every tenant's weights equal an uninterrupted replay of its steps (no job ran twice or not at
    all). Seed 0 kills the gateway three times: it found the retried request that another gateway process refused."""
    from benchmarks.fault_campaign import run as fault_run

    out = fault_run(kills=5, tenants=3, seed=0, future_timeout=180, work_dir=tmp_path)
    assert out["kills"] == 5 and out["kills_by_target"].get("gateway", 0) >= 1
    assert out["lost_futures"] == 0, out
    assert out["errors"] == {}, out["first_errors"]
    assert out["duplicated_effects"] == 0, out["worst_weight_gap"]
    assert all(n > 0 for n in out["steps"])
