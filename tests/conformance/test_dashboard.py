"""The web dashboard in headless Chromium (Debian's `chromium`, driven by Playwright): two tenants train with the
stock tinker SDK; tenant A's key shows A's runs with their loss curves and nothing of B's; the operator's key
(`keys create --admin`) shows both tenants, their keys by prefix only, the queues and the adapter pool. Every
request the page makes goes to the gateway itself. Screenshots are saved under the test's tmp dir (and copied to
$TWINKLE_TEST_ARTIFACTS when it is set)."""

from __future__ import annotations

import os
import shutil
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


def _datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def _train(srv: ServerProcess, key: str, steps: int, save: str | None) -> tuple[str, list[float]]:
    """A run of `steps` forward_backward + optim_step; (its id, each step's loss:sum)."""
    with tinker.ServiceClient(base_url=srv.base_url, api_key=key) as sc:
        tc = sc.create_lora_training_client(base_model=srv.base_model, rank=4).result()
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
    srv = ServerProcess(tmp_path_factory.mktemp("dashboard"), str(server_model_dir))
    keys = {"a": srv.create_key("dash-a"), "b": srv.create_key("dash-b"),
            "op": cli("keys", "create", "--tenant", "ops", "--admin", data_dir=srv.data_dir, env=srv.env).strip()}
    srv.start()
    try:
        run_a, losses_a = _train(srv, keys["a"], 3, save="a-step3")
        run_b, losses_b = _train(srv, keys["b"], 2, save=None)
        yield {"srv": srv, "keys": keys, "run_a": run_a, "losses_a": losses_a, "run_b": run_b, "losses_b": losses_b}
    finally:
        srv.stop()


def _overview(srv: ServerProcess, key: str | None) -> httpx.Response:
    return httpx.get(f"{srv.base_url}/dashboard/api/overview", headers={"X-API-Key": key} if key else {}, timeout=30)


def test_overview_json_is_per_key(trained: dict[str, Any]) -> None:
    srv, keys = trained["srv"], trained["keys"]
    assert _overview(srv, None).status_code == 401
    assert _overview(srv, "tml-not-a-key").status_code == 401

    a = _overview(srv, keys["a"]).json()
    assert a["role"] == "tenant" and a["service"] is None
    assert [t["name"] for t in a["tenants"]] == ["dash-a"]
    (run,) = a["tenants"][0]["runs"]
    assert run["run_id"] == trained["run_a"] and run["recent"]
    assert [p["loss"] for p in run["losses"]] == trained["losses_a"]
    assert a["tenants"][0]["keys"] is None and trained["run_b"] not in str(a)
    assert [c["tinker_path"] for c in a["tenants"][0]["checkpoints"]] == [f"tinker://{trained['run_a']}/weights/a-step3"]
    assert a["tenants"][0]["usage"]["tenant"] == "dash-a"

    op = _overview(srv, keys["op"])
    body = op.json()
    assert body["role"] == "operator" and body["viewer"] == "ops"
    by_name = {t["name"]: t for t in body["tenants"]}
    assert set(by_name) == {"dash-a", "dash-b", "ops"}
    assert [p["loss"] for p in by_name["dash-b"]["runs"][0]["losses"]] == trained["losses_b"]
    assert [k["prefix"] for k in by_name["dash-a"]["keys"]] == [keys["a"][:10]]
    assert by_name["ops"]["keys"][0]["admin"] and not by_name["dash-b"]["keys"][0]["admin"]
    for key in keys.values():  # prefixes only: no key (nor its hash) is in the operator's view
        assert key not in op.text and key[10:] not in op.text
    lanes = {(q["base_model"], q["lane"]) for q in body["service"]["queues"]}
    assert lanes == {(srv.base_model, "train"), (srv.base_model, "sample")}
    assert sum(t["adapters"] for t in body["service"]["adapters"]) >= 2  # A's and B's runs are in the pool


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
            assert "a-step3" in text
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
            assert page.locator("#service-card table.queues tbody tr").count() == 2
            assert page.locator("#service-card table.adapters tbody tr td.num").count() >= 1
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
