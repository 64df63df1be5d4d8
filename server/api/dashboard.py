"""The web dashboard: static pages served by the gateway itself (no CDN, nothing from the internet) and the one
JSON route they read, `GET /dashboard/api/overview` (server/services/dashboard.py).

The page asks for an API key in a form, keeps it in the tab's sessionStorage and sends it as `X-API-Key` (never in a
URL). The JSON route authenticates like every Tinker route (the gate: 401 for a missing, unknown or revoked key);
an operator's key (`keys create --admin`) gets every tenant, any other key its own tenant only.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response

from api_schemas.dashboard import Overview
from server.api.deps import Ctx, Tenant
from server.auth.credentials import TINKER_KEY, is_operator
from server.services import dashboard

router = APIRouter(tags=["dashboard"])

STATIC = Path(__file__).resolve().parent.parent / "dashboard_static"
_FILES = {"app.js": "text/javascript", "style.css": "text/css"}  # every file a page may load: nothing else is served
# Scripts and styles from this origin only (none inline), no frames, no referrer: a key typed into the page stays there.
_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-store"}


@router.get("/dashboard", include_in_schema=False)
@router.get("/dashboard/", include_in_schema=False)
async def page() -> Response:
    return FileResponse(STATIC / "index.html", media_type="text/html", headers=_HEADERS)


@router.get("/dashboard/static/{name}", include_in_schema=False)
async def asset(name: str) -> Response:
    media_type = _FILES.get(name)
    if media_type is None:
        return Response(status_code=404)
    return FileResponse(STATIC / name, media_type=media_type, headers=_HEADERS)


@router.get("/dashboard/api/overview", response_model=Overview,
            responses={401: {"description": "a missing, unknown or revoked API key"}})
async def overview(ctx: Ctx, tenant_id: Tenant, request: Request, response: Response) -> Overview:
    """What the key may see: its tenant's runs (with loss points), checkpoints and usage; an operator's key every
    tenant, their keys (prefixes only) and the service's queues and adapters."""
    response.headers.update(_HEADERS)
    operator = await is_operator(ctx.db.session, request.scope["headers"], TINKER_KEY)
    return await dashboard.overview(ctx, tenant_id, operator)
