"""`/readyz`: what the gateway reports about the pieces it depends on (database, queue, worker deployments)."""

from __future__ import annotations

from pydantic import BaseModel


class Check(BaseModel):
    name: str  # "database", "queue"
    ok: bool
    detail: str = ""


class DeploymentReport(BaseModel):
    name: str  # the Ray Serve deployment, e.g. "trainer-SmolLM2-135M-Instruct-1a2b3c"
    kind: str  # trainer | sampler | sample-router | hub-pusher
    base_model: str | None = None
    expected_replicas: int
    live_replicas: int  # replicas whose heartbeat has not expired
    ok: bool


class Readiness(BaseModel):
    ready: bool
    checks: list[Check]
    deployments: list[DeploymentReport] = []
