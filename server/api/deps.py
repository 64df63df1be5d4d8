"""Shared route dependencies: the service context and the authenticated tenant.

A route declares its authentication by depending on `Tenant` (the Tinker routes: X-API-Key, or Authorization /
Twinkle-Authorization: Bearer) or `BearerTenant`
(the OpenAI routes: Authorization: Bearer, or X-API-Key). The gate (server/api/gate.py) reads that declaration
and authenticates before the body is read, leaving the tenant in the scope; these dependencies then return it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import Depends, Header, Query, Request

from server.auth.credentials import OPENAI_KEY, TINKER_KEY, KeyHeaders, authenticate
from server.db.models import SQL_INT_MAX
from server.services.context import Context

TENANT = "twinkle.tenant"  # the scope key the gate leaves the authenticated tenant under


async def get_ctx(request: Request) -> Context:  # async: FastAPI runs a plain `def` dependency on a worker thread
    ctx: Context = request.app.state.ctx
    return ctx


# The Header parameters only document the accepted headers in OpenAPI; the key is read by `authenticate`.
async def get_tenant(request: Request, x_api_key: Annotated[str | None, Header()] = None,
                     authorization: Annotated[str | None, Header()] = None,
                     twinkle_authorization: Annotated[str | None, Header(alias="Twinkle-Authorization")] = None) -> str:
    return await _tenant(request, TINKER_KEY)


async def get_bearer_tenant(request: Request, authorization: Annotated[str | None, Header()] = None,
                            x_api_key: Annotated[str | None, Header()] = None) -> str:
    return await _tenant(request, OPENAI_KEY)


# The dependencies that authenticate, and the headers each accepts (read by the gate).
KEY_HEADERS: dict[Callable[..., Any], KeyHeaders] = {get_tenant: TINKER_KEY, get_bearer_tenant: OPENAI_KEY}


async def _tenant(request: Request, accepted: KeyHeaders) -> str:
    tenant: str | None = request.scope.get(TENANT)
    if tenant is None:  # a route the gate did not see (none in create_app's app): the same check, here
        ctx: Context = request.app.state.ctx  # not Depends(get_ctx): one dependency less to solve per request
        tenant = await authenticate(request.app.state.key_cache, ctx.db, request.scope, accepted)
    return tenant


Ctx = Annotated[Context, Depends(get_ctx)]
Tenant = Annotated[str, Depends(get_tenant)]
BearerTenant = Annotated[str, Depends(get_bearer_tenant)]
Offset = Annotated[int, Query(ge=0, le=SQL_INT_MAX)]  # a list's offset (a larger one overflows SQL: 422)
