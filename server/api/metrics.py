"""`GET /metrics` (Prometheus text) and the middleware that counts every HTTP request by its route template.

Open by default, like any scrape target on a private network; with `TWINKLE_METRICS_TOKEN` set it needs
`Authorization: Bearer <that token>` (a separate secret from the tenants' keys: a scraper never holds one).
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.api.deps import TENANT, Ctx
from server.api.gate import ROUTE
from server.services import metrics

router = APIRouter(tags=["health"])


@router.get("/metrics", response_class=Response, responses={401: {"description": "metrics token missing or wrong"}})
async def prometheus(ctx: Ctx, request: Request) -> Response:
    token = ctx.settings.metrics_token
    if token is not None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token.get_secret_value()}".encode()):
            return JSONResponse({"detail": "this server's /metrics needs Authorization: Bearer <TWINKLE_METRICS_TOKEN>",
                                 "category": "user"}, status_code=401)
    return Response(await metrics.render(ctx), media_type=metrics.CONTENT_TYPE)


class HttpMetrics:
    """Counts each request once it is answered: its route's template (set by the gate; "unmatched" for a path no
    route serves), method, status, and its tenant when it authenticated."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception escaping the app is answered 500 by the outermost layer

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            route = scope.get(ROUTE) or _fastapi_route(scope)
            metrics.count_request(route, scope["method"], status, scope.get(TENANT))


def _fastapi_route(scope: Scope) -> str:
    """The template of a route the gate does not know (docs, /metrics itself), or "unmatched"."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else "unmatched"
