"""Probes: `/healthz` (the process serves HTTP) and `/readyz` (database, queue and worker deployments reachable)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from api_schemas.native.health import Readiness
from server.api.deps import Ctx
from server.services import health

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(ctx: Ctx) -> JSONResponse:
    report = await health.readiness(ctx)
    return JSONResponse(report.model_dump(mode="json"), status_code=200 if report.ready else 503)
