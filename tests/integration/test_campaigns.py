"""The load campaign (benchmarks/load_campaign.py), short: stock-SDK clients of three tenants in all three roles
(SFT, RL with sampling, REST reads and saves) at once against a real server; every future resolves, nothing but
4xx is ever answered, and the server lives. The full campaign's figures are in SECURITY.md."""

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
