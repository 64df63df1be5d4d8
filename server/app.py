"""create_app: the FastAPI gateway. The lifespan builds the database and service context; routes are thin."""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import Any
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware import Middleware

from api_schemas.hub import HubPusher
from api_schemas.models import ServedModel
from jobqueue import tracing
from jobqueue.base import GatewayQueue
from jobqueue.storage import CheckpointStorage
from server.api import dashboard, health, metrics, openai
from server.api import openapi as openapi_doc
from server.api.observe import Observe
from server.api.gate import Gate, default_limit
from server.api.tinker import bootstrap, futures, models, sampling, sessions, training
from server.api.native import hub as native_hub
from server.api.native import manage as native_manage
from server.api.native import model as native_model
from server.api.native import processor as native_processor
from server.api.native import sampler as native_sampler
from server.api.native import usage as native_usage
from server.api.tinker import checkpoints, custom_losses, downloads, runs
from server.auth.keys import Generation, KeyCache, SharedAuth, sql_generation
from server.auth.rate_limits import RequestLimiter
from server.config import Settings
from server.db.database import Database
from server.errors import DomainError
from server.services.audit import KeyUse
from server.services.context import Context
from server.services.lifecycle import run_maintenance
from server.services.quotas import Admission
from server.services.secrets import Keyring, load_secret
from server.services.tenant_limits import TenantLimits

log = logging.getLogger(__name__)

Background = Callable[[], Coroutine[Any, Any, None]]


def create_app(
    settings: Settings,
    queue: GatewayQueue,
    served: dict[str, ServedModel],
    background: Sequence[Background] = (),
    pusher: HubPusher | None = None,
    limits: TenantLimits | None = None,
    unavailable: dict[str, str] | None = None,
    shared: SharedAuth | None = None,
) -> FastAPI:
    """`background` are long-running coroutines started with the app (the in-process workers in embedded mode);
    `pusher` uploads checkpoints to a model hub (workers/checkpoints/hub.py, wired by deploy/); `limits` are the
    tenants' quotas (shared with an in-process engine, which reads their adapters-in-memory limit);
    `unavailable`: the base models that failed to load and were left out ({name: why}, reported by /readyz);
    `shared`: the key generation and request buckets every gateway of a cluster shares (in Redis: deploy/cluster.py),
    None: this process's own (embedded mode)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        db = Database(settings.sqlalchemy_url)
        await db.create_schema()
        storage = CheckpointStorage(settings.storage_location, settings.storage_cache_dir)
        quotas = limits or TenantLimits(settings)
        quotas.bind(db)
        admission = Admission(queue, quotas)  # requests over a tenant's quota wait here (server/services/quotas.py)
        app.state.ctx = ctx = Context(settings=settings, db=db, queue=queue, admission=admission, models=served,
                                      unavailable=dict(unavailable or {}), storage=storage, keyring=Keyring(load_secret(settings)), pusher=pusher)
        tasks = [asyncio.create_task(fn()) for fn in background]
        tasks.append(asyncio.create_task(run_maintenance(ctx)))  # TTL sweep, unsettled saves, auto-push
        for t in tasks:
            t.add_done_callback(_log_crash)
        try:
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            try:
                await ctx.usage.flush(db)  # the last round's token counts
            except Exception:
                log.exception("writing the usage counts at shutdown failed")
            try:
                await ctx.losses.flush(db)  # the last round's loss points (server/services/loss_history.py)
            except Exception:
                log.exception("writing the loss points at shutdown failed")
            await admission.close()
            await queue.close()
            await db.close()
            await asyncio.to_thread(tracing.flush)  # the spans still buffered (jobqueue/tracing.py)

    # spans of each request and of its jobs in the in-process workers, when an OTLP collector is configured
    tracing.setup_from(settings.otel_endpoint, settings.otel_service_name, "gateway")
    app = FastAPI(title="Twinkle server", version="0.1.0", lifespan=lifespan, **_telemetry(settings))
    app.state.key_cache, app.state.rate_limiter = _key_cache(settings, shared)
    # Routes are matched in order: the per-step ones (training, futures) first; no two of these paths overlap.
    for module in (training, futures, sampling, sessions, models, bootstrap):
        app.include_router(module.router, prefix="/api/v1", tags=["tinker"])
    app.include_router(openai.router, prefix="/v1", tags=["openai"])
    for module in (checkpoints, runs, downloads, custom_losses):
        app.include_router(module.router, prefix="/api/v1", tags=["tinker"])
    app.include_router(native_hub.router, prefix="/native/v1", tags=["native"])
    app.include_router(native_usage.router, prefix="/native/v1", tags=["native"])
    for module in (native_manage, native_model, native_sampler, native_processor):  # twinkle_client (api/native/)
        app.include_router(module.router, prefix="/api/v1", tags=["twinkle"])
    app.include_router(health.router)  # /healthz, /readyz (load balancers, docker-compose, Kubernetes)
    app.include_router(metrics.router)  # /metrics (Prometheus)
    app.include_router(dashboard.router)  # /dashboard (web pages) and /dashboard/api/overview
    openapi_doc.install(app)  # every route's error answers in the document (server/api/openapi.py)

    # Innermost of the middleware (appended, where add_middleware puts a later one in front): authentication and
    # the body bound of every route, and the per-step routes' fast path (server/api/gate.py).
    app.user_middleware.append(Middleware(Gate, state=app.state, routes=app.router.routes,
                                          limit=default_limit(settings.max_request_bytes),
                                          limits={"/api/v1/create_custom_loss": custom_losses.BODY_LIMIT}))

    app.add_middleware(Observe)  # outside the gate: request ids and counts of every request, per-step ones too

    @app.exception_handler(DomainError)
    async def _domain_error(_: Request, e: DomainError) -> Response:
        status, body, headers = e.as_json()
        return Response(body, status_code=status, headers=headers, media_type="application/json")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # FastAPI's and Starlette's own (a body that is not JSON: 400; no such route: 404; 405) in our body
        category = "user" if e.status_code < 500 else "server"
        return JSONResponse({"detail": str(e.detail), "category": category}, status_code=e.status_code,
                            headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        errors = [{"loc": list(err.get("loc", ())), "msg": err.get("msg", "")} for err in e.errors()]
        return JSONResponse({"detail": "invalid request body", "errors": errors, "category": "user"}, status_code=422)

    return app


def _key_cache(settings: Settings, shared: SharedAuth | None) -> tuple[KeyCache, RequestLimiter]:
    """The API key cache and the request limiter (server/auth/keys.py, server/auth/rate_limits.py): checked against
    the cluster's shared generation and buckets, or against SQL and in-process buckets without them."""
    generation: Generation = shared.generation if shared else sql_generation(settings.auth_check_seconds)
    limiter = shared.limiter if shared else RequestLimiter()
    return KeyCache(settings.auth_cache_seconds, generation, KeyUse(settings.audit_key_use_seconds)), limiter


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task crashed", exc_info=task.exception())


def _telemetry(settings: Settings) -> dict[str, Any]:
    """FastAPI's native OpenTelemetry instrumentation (FastAPI >= 0.160) only when `TWINKLE_OTEL_TELEMETRY` asks for
    it: otherwise FastAPI looks the global providers up on every request (~20 us each, per-step requests included)."""
    if "telemetry" not in inspect.signature(FastAPI.__init__).parameters:  # older FastAPI (the vLLM venv's)
        return {}
    on = settings.otel_telemetry
    return {"telemetry": {"tracing": on, "metrics": on, "logs": on}}
