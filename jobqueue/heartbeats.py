"""Liveness of the cluster's worker deployments, through Redis: replicas beat, the deployer declares, readyz reads.

Each Ray Serve replica (workers/deployments.py) rewrites its own field of `Keys.replicas(deployment)` every few
seconds with its pid, node and an expiry; the deployer (deploy/ray_app.py) records in `Keys.deployments` which
deployments should exist. The gateway's `/readyz` (server/services/health.py) is ready when Redis answers and every
declared deployment has at least one replica whose heartbeat has not expired. Only Redis is involved, so the
gateway needs no connection to Ray.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jobqueue.keys import Keys

if TYPE_CHECKING:  # redis is the cluster extra; this module is imported where it may be missing
    import redis.asyncio as aioredis


@dataclass(frozen=True)
class ReplicaBeat:
    deployment: str
    replica: str
    pid: int
    node: str  # Ray node id (or host name outside Ray)
    expires_at: float  # unix time
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DeploymentStatus:
    name: str
    expected: dict[str, Any]  # what the deployer declared (kind, base_model, replicas)
    live: list[ReplicaBeat]

    @property
    def ready(self) -> bool:
        return bool(self.live)


class Heartbeats:
    def __init__(self, client: aioredis.Redis, keys: Keys) -> None:
        self.client = client
        self.keys = keys

    async def beat(self, deployment: str, replica: str, pid: int, node: str, ttl: float,
                   info: dict[str, Any] | None = None) -> None:
        """Mark `replica` alive for `ttl` seconds (call again well before it runs out)."""
        body = json.dumps({"pid": pid, "node": node, "expires_at": time.time() + ttl, "info": info or {}})
        key = self.keys.replicas(deployment)
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.hset(key, replica, body)
            pipe.expire(key, max(1, int(ttl * 4)))  # the whole hash goes when every replica is gone
            await pipe.execute()

    async def leave(self, deployment: str, replica: str) -> None:
        await self.client.hdel(self.keys.replicas(deployment), replica)

    async def live(self, deployment: str) -> list[ReplicaBeat]:
        """Replicas of `deployment` whose heartbeat has not expired; expired fields are pruned."""
        key = self.keys.replicas(deployment)
        rows = await self.client.hgetall(key)
        now, out, stale = time.time(), [], []
        for replica, raw in rows.items():
            d = json.loads(raw)
            name = _s(replica)
            if d["expires_at"] < now:
                stale.append(name)
                continue
            out.append(ReplicaBeat(deployment, name, int(d["pid"]), str(d["node"]), float(d["expires_at"]),
                                   d.get("info") or {}))
        if stale:
            await self.client.hdel(key, *stale)
        return sorted(out, key=lambda b: b.replica)

    async def declare(self, expected: dict[str, dict[str, Any]], fingerprint: str) -> None:
        """Replace the set of deployments that must be live (the deployer calls this after each deploy)."""
        key = self.keys.deployments
        async with self.client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, "_fingerprint", fingerprint)
            for name, spec in expected.items():
                pipe.hset(key, name, json.dumps(spec))
            await pipe.execute()

    async def declared(self) -> tuple[str | None, dict[str, dict[str, Any]]]:
        rows = await self.client.hgetall(self.keys.deployments)
        decoded = {_s(k): _s(v) for k, v in rows.items()}
        fingerprint = decoded.pop("_fingerprint", None)
        return fingerprint, {k: json.loads(v) for k, v in decoded.items()}

    async def status(self) -> list[DeploymentStatus]:
        _, expected = await self.declared()
        return [DeploymentStatus(name, spec, await self.live(name)) for name, spec in sorted(expected.items())]


def _s(v: bytes | str) -> str:
    return v.decode() if isinstance(v, bytes) else v
