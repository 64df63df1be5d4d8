"""Keys and audit across a cluster: two gateway apps sharing one Postgres and one Redis. A key revoked or rotated
through one is refused by the other on its very next request once the key command has returned (no cache expiry to
wait for: each gateway reads the key generation every auth_check_seconds, and the command waits that long); the
request rate limit is one bucket for both; the audit log has the key use (once per window), the key changes and a
publish; no log line of the run holds a key."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from deploy.cluster import build_gateway_app
from server.auth.keys import announce_key_change
from server.config import Settings
from server.services import audit, tenant_limits, tenants
from tests.integration.conftest import fresh_database

RUNS = "/api/v1/training_runs"


@pytest.fixture
def gateways(redis_url: str, prefix: str, tmp_path: Path) -> Iterator[tuple[TestClient, TestClient, Settings]]:
    with fresh_database(prefix) as url:
        settings = Settings(data_dir=tmp_path, database_url=url.replace("postgresql://", "postgresql+asyncpg://"),
                            redis_url=redis_url, redis_prefix=prefix, auth_cache_seconds=3600,
                            auth_check_seconds=0.2)
        apps = [build_gateway_app(settings) for _ in range(2)]  # the cluster gateway as `serve` builds it
        with TestClient(apps[0]) as one, TestClient(apps[1]) as two:
            yield one, two, settings


def _db(client: TestClient):  # type: ignore[no-untyped-def]
    return client.app.state.ctx.db  # type: ignore[attr-defined]


def _call(client: TestClient, fn, *args):  # type: ignore[no-untyped-def]
    return client.portal.call(fn, *args)  # type: ignore[union-attr]


def _announce(client: TestClient, settings: Settings) -> bool:
    """What the key commands do after their change: bump the generation, wait auth_check_seconds."""
    return bool(_call(client, announce_key_change, settings.redis_url, settings.redis_prefix,
                      settings.auth_check_seconds))


def _status(client: TestClient, key: str) -> int:
    return client.get(RUNS, headers={"X-API-Key": key}).status_code


def test_revoke_and_rotation_apply_on_every_gateway_at_once(gateways, caplog) -> None:  # type: ignore[no-untyped-def]
    one, two, settings = gateways
    caplog.set_level(logging.DEBUG)
    db = _db(one)
    key, key_id = _call(one, tenants.create_key, db, "acme")
    assert _status(one, key) == 200 and _status(two, key) == 200  # both gateways now hold it in their cache (1 h)
    _call(one, tenants.revoke, db, key_id)
    assert _announce(one, settings)
    assert _status(two, key) == 401 and _status(one, key) == 401  # the next request, no cache expiry waited for
    assert _status(two, "tml-" + "x" * 43) == 401  # a wrong key

    old, _ = _call(one, tenants.create_key, db, "acme")
    assert _status(two, old) == 200
    new, new_id, rotated = _call(one, tenants.rotate_key, db, "acme", timedelta(hours=1))
    _announce(one, settings)
    assert _status(two, old) == 200 and _status(two, new) == 200  # within the grace period both work
    _, _, rotated = _call(one, tenants.rotate_key, db, "acme", timedelta(0))  # grace over: every older key ends
    _announce(one, settings)
    assert new_id in rotated and _status(two, old) == 401 and _status(one, new) == 401

    logged = "\n".join(r.getMessage() + str(r.args) for r in caplog.records)
    for text in (key, old, new, key[4:20], new[4:20]):
        assert text not in logged  # used, revoked, rotated keys: never in a log line


def test_grace_period_ends_on_its_own(gateways) -> None:  # type: ignore[no-untyped-def]
    one, two, settings = gateways
    db = _db(one)
    old, _ = _call(one, tenants.create_key, db, "acme")
    _call(one, tenants.rotate_key, db, "acme", timedelta(seconds=1))
    _announce(one, settings)
    assert _status(two, old) == 200  # cached again, now with its end of grace
    time.sleep(1.2)  # the grace period passes; nothing is announced: the cached entry's own expiry refuses it
    assert _status(two, old) == 401


def test_request_rate_is_one_bucket_for_the_cluster(gateways) -> None:  # type: ignore[no-untyped-def]
    one, two, _ = gateways
    db = _db(one)
    key, _ = _call(one, tenants.create_key, db, "acme")
    _call(one, lambda: tenant_limits.set_quota(db, "acme", requests_per_minute=2, request_burst=3))
    for client in (one, two):
        client.app.state.ctx.admission.limits._cache.clear()  # type: ignore[attr-defined]  # quota_cache_seconds
    headers = {"X-API-Key": key}
    assert [c.get(RUNS, headers=headers).status_code for c in (one, two, one)] == [200, 200, 200]
    limited = two.get(RUNS, headers=headers)
    assert limited.status_code == 429, limited.text
    assert limited.json()["category"] == "rate_limited" and 1 <= int(limited.headers["Retry-After"]) <= 30
    polled = one.post("/api/v1/retrieve_future", headers=headers, json={"request_id": "nope"})
    assert polled.status_code == 404  # polling is not counted: it gets its answer, not a 429
    native = one.get("/api/v1/twinkle/training_runs", headers=headers)
    assert native.status_code == 200, native.text  # nor is the native client's protocol (it does not retry 429)
    other, _ = _call(one, tenants.create_key, db, "other")
    assert _status(one, other) == 200  # another tenant's bucket is its own


def test_audit_log_rows(gateways) -> None:  # type: ignore[no-untyped-def]
    one, two, _ = gateways
    db = _db(one)
    key, key_id = _call(one, tenants.create_key, db, "acme")
    for _ in range(3):
        assert _status(one, key) == 200 and _status(two, key) == 200
    r = one.post(f"{RUNS}/nope/checkpoints/sampler_weights/x/publish", headers={"X-API-Key": key,
                                                                                "X-Request-Id": "req-77"})
    assert r.status_code == 404  # not audited: nothing was published
    put = two.put("/native/v1/hub/tokens/huggingface", json={"token": "hf_secret_token_1"},
                  headers={"X-API-Key": key, "X-Request-Id": "req-78"})
    assert put.status_code == 200, put.text
    _call(one, tenants.revoke, db, key_id)
    rows = _call(one, audit.entries, db, "acme")
    actions = [e.action for e in rows]
    assert actions.count("key.use") == 2  # first use on each gateway in the window, not every request
    assert actions[0] == "key.create" and actions[-1] == "key.revoke" and "checkpoint.publish" not in actions
    token = next(e for e in rows if e.action == "hub.token.set")
    assert (token.key_id, token.request_id, token.target) == (key_id, "req-78", "huggingface")
    assert all("hf_secret" not in (e.target or "") for e in rows)
    use = next(e for e in rows if e.action == "key.use")
    assert use.key_id == key_id and use.client == "testclient" and use.request_id
    assert all(key not in (e.target or "") for e in rows)
    assert _call(one, audit.entries, db, "other") == []
    assert [e.action for e in _call(one, audit.entries, db, None, None, "key.*")] == [
        a for a in actions if a.startswith("key.")]
