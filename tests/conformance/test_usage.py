"""Usage accounting: a tenant's training, forward, sampling and saves show in its own usage (native endpoint) and
in `twinkle-server usage`, by the exact token counts; another tenant sees only its own (zeros)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.support.server import ServerProcess, cli

TRAIN = [[3, 8, 13, 21, 34, 55, 89, 144], [5, 17, 42, 99, 7, 23, 61]]
PROMPT = [5, 17, 42, 99, 7, 23]


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


@pytest.fixture(scope="module")
def usage_server(server_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    srv = ServerProcess(tmp_path_factory.mktemp("usage"), str(server_model_dir),
                        env={"TWINKLE_MAINTENANCE_INTERVAL_SECONDS": "0.3"})
    srv.key_1 = srv.create_key("usage-one")  # type: ignore[attr-defined]
    srv.key_2 = srv.create_key("usage-two")  # type: ignore[attr-defined]
    srv.start()
    yield srv
    srv.stop()


def _usage(srv: ServerProcess, key: str, **params: str) -> httpx.Response:
    return httpx.get(f"{srv.base_url}/native/v1/usage", headers={"X-API-Key": key}, params=params, timeout=10)


def test_usage_follows_what_a_tenant_did(usage_server: ServerProcess) -> None:
    srv = usage_server
    t0 = time.time()
    with tinker.ServiceClient(base_url=srv.base_url, api_key=srv.key_1) as sc:  # type: ignore[attr-defined]
        tc = sc.create_lora_training_client(base_model=srv.base_model, rank=4).result()
        tc.forward_backward([datum(t) for t in TRAIN], "cross_entropy").result()
        tc.forward([datum(TRAIN[0])], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        saved = tc.save_state("u1").result().path
        sampler = sc.create_sampling_client(base_model=srv.base_model).result()
        out = sampler.sample(types.ModelInput.from_ints(PROMPT), 3,
                             types.SamplingParams(max_tokens=5, temperature=0.0, stop=[])).result()
        rest = tinker.RestClient(base_url=srv.base_url, api_key=srv.key_1)  # type: ignore[attr-defined]
        sizes = [c.size_bytes for c in rest.list_user_checkpoints(limit=100).result().checkpoints]
    trained = sum(len(t) - 1 for t in TRAIN)
    expected = {"tokens_trained": trained, "tokens_forward": len(TRAIN[0]) - 1,
                "tokens_sampled": sum(len(s.tokens) for s in out.sequences), "tokens_prefilled": len(PROMPT)}
    assert expected["tokens_sampled"] == 15 and saved.startswith("tinker://")

    deadline = time.monotonic() + 15
    while True:  # written by the maintenance loop (every 0.3 s here)
        r = _usage(srv, srv.key_1)  # type: ignore[attr-defined]
        assert r.status_code == 200, r.text
        got = r.json()
        if {k: got[k] for k in expected} == expected or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {k: got[k] for k in expected} == expected, got
    assert got["tenant"] == "usage-one" and got["storage_bytes"] == sum(sizes) > 0
    assert 0 < got["adapter_hours"] <= (time.time() - t0 + 5) / 3600

    other = _usage(srv, srv.key_2).json()  # type: ignore[attr-defined]
    assert other["tenant"] == "usage-two" and all(other[k] == 0 for k in (*expected, "storage_bytes"))
    assert other["adapter_hours"] == 0

    future = _usage(srv, srv.key_1, since="2999-01-01T00:00:00").json()  # type: ignore[attr-defined]
    assert all(future[k] == 0 for k in expected) and future["storage_bytes"] == got["storage_bytes"]

    # the operator's command reads the same rows
    line = cli("usage", "--tenant", "usage-one", "--json", data_dir=srv.data_dir, env=srv.env).strip()
    row = json.loads(line)
    assert {k: row[k] for k in expected} == expected and row["storage_bytes"] == got["storage_bytes"]
    assert row["tenant_id"] == got["tenant_id"] and row["tenant_id"] != other["tenant_id"]
    table = cli("usage", "--since", "1h", data_dir=srv.data_dir, env=srv.env)
    assert "usage-one" in table and "usage-two" in table and str(trained) in table and got["tenant_id"] in table


def test_usage_refusals(usage_server: ServerProcess) -> None:
    srv = usage_server
    bad = _usage(srv, srv.key_1, since="last tuesday")  # type: ignore[attr-defined]
    assert bad.status_code == 400 and bad.json()["category"] == "user" and "since" in bad.json()["detail"]
    assert httpx.get(f"{srv.base_url}/native/v1/usage").status_code == 401
    for args, code in ((["--tenant", "nobody"], 1), (["--since", "yesterday"], 2)):
        done = subprocess.run([sys.executable, "-m", "deploy.cli", "usage", *args, "--data-dir", str(srv.data_dir)],
                              capture_output=True, text=True, env=srv.env, timeout=60)
        assert done.returncode == code and "error" in done.stderr, done.stderr
