"""`GET /metrics`: the Prometheus text of server/services/metrics.py (requests are counted by server/api/observe.py).

Open by default, like any scrape target on a private network; with `TWINKLE_METRICS_TOKEN` set it needs
`Authorization: Bearer <that token>` (a separate secret from the tenants' keys: a scraper never holds one).
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from server.api.deps import Ctx
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
