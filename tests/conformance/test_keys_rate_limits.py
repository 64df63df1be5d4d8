"""One embedded server, JSON logs at debug level with the access log on: the stock SDK under a request rate limit
is slowed by 429s (Retry-After) but finishes its training; a wrong key and a revoked key get 401; and no line the
server wrote holds any of those keys."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.support.server import ServerProcess, cli

RUNS = "/api/v1/training_runs"


@pytest.fixture(scope="module")
def srv(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp("keys-server"), str(tiny_model_dir),
                           env={"TWINKLE_ACCESS_LOG": "true", "TWINKLE_QUOTA_CACHE_SECONDS": "0",
                                "TWINKLE_AUTH_CHECK_SECONDS": "0"},  # a revoke applies on the next request
                           args=("--log-level", "debug", "--log-format", "json"))
    server.key_slow = server.create_key("slow")  # type: ignore[attr-defined]
    cli("tenants", "set-quota", "slow", "--requests-per-minute", "120", "--request-burst", "2",
        data_dir=server.data_dir)
    server.start()
    yield server
    server.stop()


def _http_429s(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("twinkle_http_requests_total{") and 'status="429"' in line)


def test_sdk_is_slowed_not_failed_by_the_request_rate(srv: ServerProcess) -> None:
    before = _http_429s(srv.base_url)
    tokens = [3, 8, 13, 21, 34]
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 4})
    with tinker.ServiceClient(base_url=srv.base_url, api_key=srv.key_slow) as sc:  # type: ignore[attr-defined]
        tc = sc.create_lora_training_client(base_model=srv.base_model, rank=4).result()
        for _ in range(3):
            out = tc.forward_backward([datum], "cross_entropy").result()
            assert out.loss_fn_outputs
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    hit = _http_429s(srv.base_url) - before
    print(f"\nstock SDK, 120 requests/min, burst 2: 3 SFT steps finished after {hit:.0f} answers of 429")
    assert hit > 0  # the limit was hit, and the SDK went on after Retry-After
    answers = [httpx.get(f"{srv.base_url}{RUNS}", headers={"X-API-Key": srv.key_slow}) for _ in range(4)]
    limited = [a for a in answers if a.status_code == 429]
    assert limited and limited[0].json()["category"] == "rate_limited" and "Retry-After" in limited[0].headers


def test_no_key_is_ever_logged(srv: ServerProcess) -> None:
    key = srv.create_key("logged")
    wrong = "tml-" + "Q" * 43
    assert httpx.get(f"{srv.base_url}{RUNS}", headers={"X-API-Key": key}).status_code == 200
    assert httpx.get(f"{srv.base_url}{RUNS}", headers={"Authorization": f"Bearer {wrong}"}).status_code == 401
    assert httpx.get(f"{srv.base_url}{RUNS}?api_key={wrong}").status_code == 401
    key_id = next(line.split()[0] for line in cli("keys", "list", data_dir=srv.data_dir).splitlines()
                  if " logged " in line)
    cli("keys", "revoke", key_id, data_dir=srv.data_dir)
    refused = httpx.get(f"{srv.base_url}{RUNS}", headers={"X-API-Key": key})
    assert refused.status_code == 401 and key not in refused.text
    log = srv.log()
    assert '"GET /api/v1/training_runs' in log or "/api/v1/training_runs" in log  # the access log is in there
    secrets = [key, wrong, srv.key_slow]  # type: ignore[attr-defined]
    for secret in secrets:
        assert secret not in log and secret[4:24] not in log
    assert not re.search(r"tml-[A-Za-z0-9_-]{20,}", log)  # not a key of anyone (the first-start box prints none)
    audit = cli("audit", "--tenant", "logged", data_dir=srv.data_dir)
    assert "key.create" in audit and "key.use" in audit and "key.revoke" in audit and key not in audit


def test_rotate_key_command(srv: ServerProcess) -> None:
    old = srv.create_key("rotating")
    assert httpx.get(f"{srv.base_url}{RUNS}", headers={"X-API-Key": old}).status_code == 200
    new = cli("tenants", "rotate-key", "rotating", "--grace", "1h", data_dir=srv.data_dir).strip()
    assert new.startswith("tml-") and new != old
    assert [httpx.get(f"{srv.base_url}{RUNS}", headers={"X-API-Key": k}).status_code for k in (old, new)] == [200, 200]
    newest = cli("tenants", "rotate-key", "rotating", "--grace", "0", data_dir=srv.data_dir).strip()
    answers = [httpx.get(f"{srv.base_url}{RUNS}", headers={"X-API-Key": k}).status_code for k in (old, new, newest)]
    assert answers == [401, 401, 200]  # grace 0: every older key ends at once
    assert "expires" in cli("keys", "list", data_dir=srv.data_dir)
    assert cli("audit", "--action", "key.rotate", "--json", data_dir=srv.data_dir).count('"key.rotate"') == 2
