"""Shared route dependencies: the service context and the authenticated tenant."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Header, Request

from server.auth.keys import KeyCache
from server.errors import Unauthorized
from server.services.context import Context


async def get_ctx(request: Request) -> Context:  # async: FastAPI runs a plain `def` dependency on a worker thread
    ctx: Context = request.app.state.ctx
    return ctx


async def get_tenant(request: Request, x_api_key: Annotated[str | None, Header()] = None) -> str:
    if not x_api_key:
        raise Unauthorized("missing X-API-Key header")
    cache: KeyCache = request.app.state.key_cache
    ctx: Context = request.app.state.ctx  # not Depends(get_ctx): one dependency less to solve per request
    tenant_id = await cache.tenant(ctx.db.session, x_api_key)
    if tenant_id is None:
        raise Unauthorized("invalid or revoked API key")
    return tenant_id


Ctx = Annotated[Context, Depends(get_ctx)]
Tenant = Annotated[str, Depends(get_tenant)]
