"""The web dashboard in headless Chromium (Debian's `chromium`, driven by Playwright): two tenants train with the
stock tinker SDK; tenant A's key shows A's runs with their loss curves and nothing of B's; the operator's key
(`keys create --admin`) shows both tenants, their keys by prefix only, the queues and the adapter pool. Every
request the page makes goes to the gateway itself; a native (twinkle_client) run's steps are drawn too.
Screenshots are saved under the test's tmp dir (and copied to $TWINKLE_TEST_ARTIFACTS when it is set)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from tests.support.server import ServerProcess, cli

CHROMIUM = Path("/usr/bin/chromium")
pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is not installed "
                                "(apt-get install -y chromium); the dashboard's browser test needs it")

TOKENS = [[3, 8, 13, 21, 34, 55, 89, 144], [5, 17, 42, 99, 7, 23, 61]]
STEP_TOKENS = sum(len(t) - 1 for t in TOKENS)  # trained tokens of one forward_backward


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def _train(sc: tinker.ServiceClient, base_model: str, steps: int, save: str | None) -> tuple[str, list[float]]:
    """A run of `steps` forward_backward + optim_step; (its id, each step's loss:sum)."""
    tc = sc.create_lora_training_client(base_model=base_model, rank=4).result()
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward([_datum(t) for t in TOKENS], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    if save:
        tc.save_state(save).result()
    return tc.model_id, losses


@pytest.fixture(scope="module")
def trained(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    srv = ServerProcess(tmp_path_factory.mktemp("dashboard"), str(server_model_dir),
                        env={"TWINKLE_MAINTENANCE_INTERVAL_SECONDS": "0.3"})  # usage written every 0.3 s
    keys = {"a": srv.create_key("dash-a"), "b": srv.create_key("dash-b"),
            "op": cli("keys", "create", "--tenant", "ops", "--admin", data_dir=srv.data_dir, env=srv.env).strip()}
    srv.start()
    try:
        with tinker.ServiceClient(base_url=srv.base_url, api_key=keys["a"]) as sc:  # A's session ends here
            run_a, losses_a = _train(sc, srv.base_model, 3, save="a-step3")
        with tinker.ServiceClient(base_url=srv.base_url, api_key=keys["b"]) as sc:  # B's goes on during the tests
            run_b, losses_b = _train(sc, srv.base_model, 2, save=None)
            yield {"srv": srv, "keys": keys, "run_a": run_a, "losses_a": losses_a, "run_b": run_b,
                   "losses_b": losses_b}
    finally:
        srv.stop()


def _overview(srv: ServerProcess, key: str | None) -> httpx.Response:
    return httpx.get(f"{srv.base_url}/dashboard/api/overview", headers={"X-API-Key": key} if key else {}, timeout=30)


def _usage_written(srv: ServerProcess, key: str, tokens_trained: int) -> None:
    """Until the maintenance loop has written the tenant's trained tokens (every 0.3 s here)."""
    deadline = time.monotonic() + 15
    while _overview(srv, key).json()["tenants"][0]["usage"]["tokens_trained"] != tokens_trained:
        assert time.monotonic() < deadline, _overview(srv, key).json()["tenants"][0]["usage"]
        time.sleep(0.2)


def test_overview_json_is_per_key(trained: dict[str, Any]) -> None:
    srv, keys = trained["srv"], trained["keys"]
    _usage_written(srv, keys["a"], 3 * STEP_TOKENS)
    _usage_written(srv, keys["b"], 2 * STEP_TOKENS)
    assert _overview(srv, None).status_code == 401
    assert _overview(srv, "tml-not-a-key").status_code == 401

    a = _overview(srv, keys["a"]).json()
    assert a["role"] == "tenant" and a["service"] is None
    assert [t["name"] for t in a["tenants"]] == ["dash-a"]
    (run,) = a["tenants"][0]["runs"]
    saved = f"tinker://{trained['run_a']}/weights/a-step3"
    assert run["run_id"] == trained["run_a"] and run["last_checkpoint"] == saved
    assert [p["loss"] for p in run["losses"]] == trained["losses_a"]
    assert a["tenants"][0]["keys"] is None and trained["run_b"] not in str(a)
    assert [c["tinker_path"] for c in a["tenants"][0]["checkpoints"]] == [saved]
    assert a["tenants"][0]["usage"]["tenant"] == "dash-a" and a["tenants"][0]["usage"]["storage_bytes"] > 0

    op = _overview(srv, keys["op"])
    body = op.json()
    assert body["role"] == "operator" and body["viewer"] == "ops"
    by_name = {t["name"]: t for t in body["tenants"]}
    assert set(by_name) == {"dash-a", "dash-b", "ops"}
    assert [p["loss"] for p in by_name["dash-b"]["runs"][0]["losses"]] == trained["losses_b"]
    assert by_name["dash-b"]["runs"][0]["last_checkpoint"] is None and by_name["ops"]["runs"] == []
    assert [k["prefix"] for k in by_name["dash-a"]["keys"]] == [keys["a"][:10]]
    assert by_name["ops"]["keys"][0]["admin"] and not by_name["dash-b"]["keys"][0]["admin"]
    assert by_name["dash-b"]["usage"]["tokens_trained"] == 2 * STEP_TOKENS
    assert by_name["dash-a"]["usage"]["tokens_trained"] == 3 * STEP_TOKENS
    for key in keys.values():  # prefixes only: no key (nor its hash) is in the operator's view
        assert key not in op.text and key[10:] not in op.text
    lanes = {(q["base_model"], q["lane"]) for q in body["service"]["queues"]}
    assert lanes == {(srv.base_model, "train"), (srv.base_model, "sample")}
    assert {(t["base_model"], t["tier"]) for t in body["service"]["adapters"]} == {
        (srv.base_model, tier) for tier in ("device", "host", "disk")}


def test_live_runs_and_the_pool(trained: dict[str, Any]) -> None:
    """A's session ended: its run is released (not live) and leaves the adapter pool; B's run stays, live."""
    srv, keys = trained["srv"], trained["keys"]
    deadline = time.monotonic() + 20
    while True:
        body = _overview(srv, keys["op"]).json()
        live = {r["run_id"]: r["live"] for t in body["tenants"] for r in t["runs"]}
        pooled = sum(t["adapters"] for t in body["service"]["adapters"])
        if (live, pooled) == ({trained["run_a"]: False, trained["run_b"]: True}, 1) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert (live, pooled) == ({trained["run_a"]: False, trained["run_b"]: True}, 1), body["service"]


def _login(page: Any, base_url: str, key: str) -> None:
    page.goto(f"{base_url}/dashboard")
    page.fill("#key", key)
    page.click("form#login button[type=submit]")
    page.wait_for_selector("#who[data-role]", timeout=30_000)


def _artifact(tmp_path: Path, page: Any, name: str) -> Path:
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 1000
    target = os.environ.get("TWINKLE_TEST_ARTIFACTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(target) / name)
    return shot


def test_dashboard_in_chromium(trained: dict[str, Any], tmp_path: Path) -> None:
    from playwright.sync_api import sync_playwright

    srv, keys = trained["srv"], trained["keys"]
    _usage_written(srv, keys["b"], 2 * STEP_TOKENS)
    requested: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("request", lambda r: requested.append(r.url))
            _login(page, srv.base_url, keys["a"])
            assert page.get_attribute("#who", "data-role") == "tenant"
            assert page.locator("[data-tenant]").count() == 1
            assert page.locator("[data-tenant='dash-a']").count() == 1
            run = page.locator(f"[data-run='{trained['run_a']}']")
            points = run.locator("svg.loss-curve polyline").get_attribute("points")
            assert points is not None and len(points.split()) == len(trained["losses_a"]) == 3
            ys = [float(pt.split(",")[1]) for pt in points.split()]  # svg y grows downwards: a higher loss is higher up
            order = sorted(range(3), key=lambda i: trained["losses_a"][i])
            assert sorted(range(3), key=lambda i: -ys[i]) == order
            text = page.inner_text("body")
            assert "dash-b" not in text and trained["run_b"] not in text and "Adapter pool" not in text
            assert "a-step3" in text and run.locator(".badge").inner_text() == "ended"
            assert page.inner_text("table.usage tbody td.num >> nth=0") == str(3 * STEP_TOKENS)
            assert keys["a"] not in page.content() and keys["a"] not in page.url
            assert page.evaluate("Object.values(sessionStorage)") == [keys["a"]]
            _artifact(tmp_path, page, "dashboard-tenant-a.png")

            page.click("#logout")
            assert page.is_visible("form#login") and page.evaluate("sessionStorage.length") == 0
            _login(page, srv.base_url, keys["op"])
            assert page.get_attribute("#who", "data-role") == "operator"
            for name in ("dash-a", "dash-b", "ops"):
                assert page.locator(f"[data-tenant='{name}']").count() == 1
            b_points = page.locator(f"[data-run='{trained['run_b']}'] svg.loss-curve polyline").get_attribute("points")
            assert b_points is not None and len(b_points.split()) == 2
            assert page.inner_text(f"[data-run='{trained['run_b']}'] .badge") == "live"
            assert page.locator("#service-card table.queues tbody tr").count() == 2
            assert page.locator("#service-card table.adapters tbody tr td.num").count() >= 1
            summary = page.inner_text("#tenants-card table.tenants")
            assert "dash-a" in summary and "dash-b" in summary and str(2 * STEP_TOKENS) in summary
            keys_a = page.inner_text("[data-tenant='dash-a'] table.keys")
            assert keys["a"][:10] in keys_a
            html = page.content()
            assert all(k not in html and k[10:] not in html for k in keys.values())
            _artifact(tmp_path, page, "dashboard-operator.png")

            page.goto(f"{srv.base_url}/dashboard")  # a new page load keeps the tab's login, and nothing else
            page.wait_for_selector("#who[data-role='operator']", timeout=30_000)
        finally:
            browser.close()
    network = [u for u in requested if not u.startswith("data:")]
    assert network and all(u.startswith(srv.base_url + "/dashboard") for u in network), network


def test_native_client_steps_are_drawn_too(trained: dict[str, Any]) -> None:
    """twinkle_client's forward_backward (the native protocol) goes through the same job path: its run gets a point
    per call, and only its own tenant's key (besides the operator's) sees it."""
    from tests.support.native_http import Native, rows, setup_adapter

    srv = trained["srv"]
    key = srv.create_key("dash-native")
    c = Native(srv, key)
    setup_adapter(c, gas=1)
    for _ in range(3):
        c.ok("forward_backward", inputs=rows(n=2), adapter_name="default")
        c.ok("clip_grad_and_step", adapter_name="default")
    (tenant,) = _overview(srv, key).json()["tenants"]
    (run,) = tenant["runs"]
    assert tenant["name"] == "dash-native" and run["live"] and len(run["losses"]) == 3
    assert all(p["loss"] > 0 and p["tokens"] == 24 for p in run["losses"])
    assert [p["seq_id"] for p in run["losses"]] == sorted(p["seq_id"] for p in run["losses"])
    assert run["run_id"] not in _overview(srv, trained["keys"]["a"]).text
