"""What the Ray wiring adds on Redis, against a real Redis and without Ray: hub pushes from the gateway to the
checkpoint-pusher's consumer (token sealed in transit, outcomes and failures reported), and `/readyz` following
the replicas' heartbeats of the declared deployments."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from pydantic import SecretStr

from api_schemas.hub import HubPushFailed, HubPushOutcome, HubPushSpec, Progress
from jobqueue.heartbeats import Heartbeats
from jobqueue.hub_push_queue import HubPushConsumer, RedisHubPusher
from jobqueue.keys import Keys
from jobqueue.sealing import Sealer, cluster_secret

pytest.importorskip("redis")
pytestmark = pytest.mark.ray
SECRET = b"s" * 32


def spec(repo: str) -> HubPushSpec:
    return HubPushSpec(provider="huggingface", endpoint="http://hub.invalid", token=SecretStr("hf_secret_token"),
                       repo_id=repo, storage_key="t/run/sampler_weights/a", commit_message="c")


async def _push_round_trip(redis_url: str, prefix: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    keys = Keys(prefix)
    seen: list[HubPushSpec] = []

    async def upload(s: HubPushSpec, progress: Progress) -> HubPushOutcome:
        seen.append(s)
        if s.repo_id == "me/broken":
            raise HubPushFailed("hub said no")
        progress(5, 10)
        await asyncio.sleep(2.5)  # long enough for the progress to be published and read between the gateway's pops
        progress(10, 10)
        return HubPushOutcome(url=f"http://hub.invalid/{s.repo_id}")

    consumer = HubPushConsumer(client, keys, SECRET, upload, name="c1", concurrency=2)
    task = asyncio.create_task(consumer.run())
    gateway = RedisHubPusher(client, keys, SECRET, timeout=30)
    reported: list[tuple[int, int]] = []
    try:
        ok, bad = await asyncio.gather(gateway(spec("me/lora"), lambda d, t: reported.append((d, t))),
                                       gateway(spec("me/broken"), lambda d, t: None), return_exceptions=True)
        assert isinstance(ok, HubPushOutcome) and ok.url.endswith("me/lora")
        assert reported and set(reported) <= {(5, 10), (10, 10)}  # the pusher's progress, read from Redis
        assert not await client.keys(f"{prefix}:hubpush:progress:*")  # removed with the outcome
        assert isinstance(bad, HubPushFailed) and "hub said no" in str(bad)
        assert sorted(s.repo_id for s in seen) == ["me/broken", "me/lora"]
        assert seen[0].token.get_secret_value() == "hf_secret_token"  # the token arrives intact
        assert not await client.keys(f"{prefix}:hubpush:spec:*")  # taken and deleted
        assert await client.xlen(keys.hub_push_stream) == 0  # acknowledged and removed

        # a pusher without the shared secret reports it instead of pushing
        consumer.stop()
        await asyncio.wait_for(task, 10)
        blind = HubPushConsumer(client, keys, None, upload, name="c2")
        task = asyncio.create_task(blind.run())
        with pytest.raises(HubPushFailed, match="TWINKLE_SIGNING_SECRET"):
            await gateway(spec("me/other"), lambda d, t: None)
        assert len(seen) == 2
        blind.stop()
        await asyncio.wait_for(task, 10)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await client.aclose()


def test_hub_push_through_redis(redis_url: str, prefix: str) -> None:
    asyncio.run(_push_round_trip(redis_url, prefix))


def test_sealing_hides_and_authenticates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = Sealer(SECRET, b"p"), Sealer(b"t" * 32, b"p")
    blob = a.seal(b'{"token": "hf_secret_token"}')
    assert b"hf_secret_token" not in blob and a.unseal(blob) == b'{"token": "hf_secret_token"}'
    with pytest.raises(ValueError):
        b.unseal(blob)
    with pytest.raises(ValueError):
        a.unseal(blob[:-1] + bytes([blob[-1] ^ 1]))
    monkeypatch.delenv("TWINKLE_SIGNING_SECRET", raising=False)
    assert cluster_secret(tmp_path) is None
    (tmp_path / "server-secret").write_text("ab" * 32)
    assert cluster_secret(tmp_path) == bytes.fromhex("ab" * 32)
    monkeypatch.setenv("TWINKLE_SIGNING_SECRET", "x" * 20)
    assert cluster_secret(tmp_path) != bytes.fromhex("ab" * 32)


def test_readyz_follows_declared_deployments_and_heartbeats(redis_url: str, prefix: str, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi.testclient import TestClient

    from deploy.ray_app import build_ray_gateway_app
    from server.config import Settings

    monkeypatch.delenv("TWINKLE_DATABASE_URL", raising=False)
    settings = Settings(data_dir=tmp_path, redis_url=redis_url, redis_prefix=prefix)

    async def declare() -> None:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_url)
        hb = Heartbeats(client, Keys(prefix))
        await hb.declare({"trainer-m": {"kind": "trainer", "base_model": "m", "replicas": 1},
                          "hub-pusher": {"kind": "hub-pusher", "replicas": 1}}, "fp")
        await hb.beat("hub-pusher", "r1", os.getpid(), "node-a", ttl=30)
        await hb.beat("trainer-m", "old", 1, "node-a", ttl=-1)  # an expired heartbeat: a dead replica
        await client.aclose()

    async def beat_trainer() -> None:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(redis_url)
        await Heartbeats(client, Keys(prefix)).beat("trainer-m", "new", os.getpid(), "node-b", ttl=30)
        await client.aclose()

    with TestClient(build_ray_gateway_app(settings)) as http:
        assert http.get("/healthz").json() == {"status": "ok"}
        asyncio.run(declare())
        r = http.get("/readyz")
        assert r.status_code == 503, r.text
        body = r.json()
        by_name = {d["name"]: d for d in body["deployments"]}
        assert by_name["trainer-m"]["live_replicas"] == 0 and not by_name["trainer-m"]["ok"]
        assert by_name["hub-pusher"]["ok"] and {c["name"]: c["ok"] for c in body["checks"]} == {
            "database": True, "queue": True, "models": True}
        asyncio.run(beat_trainer())
        r = http.get("/readyz")
        assert r.status_code == 200 and r.json()["ready"], r.text


def test_readyz_embedded_mode_is_ready_without_redis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi.testclient import TestClient

    from jobqueue.local_queue import LocalQueue
    from server.app import create_app
    from server.config import Settings

    monkeypatch.delenv("TWINKLE_DATABASE_URL", raising=False)
    app = create_app(Settings(data_dir=tmp_path), LocalQueue(), {})
    with TestClient(app) as http:
        r = http.get("/readyz")
        assert r.status_code == 200 and r.json()["checks"][1] == {"name": "queue", "ok": True, "detail": "in-process"}
