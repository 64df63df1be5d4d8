"""The native protocol's processor routes (`/api/v1/processor/twinkle/{create,call}`): server-held datasets, data
loaders and input processors of twinkle_client (twinkle_client.dataset / dataloader / processor). The objects are
bound to the caller's tenant and `X-Twinkle-Session-Id` session; `call` answers `{"result": ...}`, and 410 only at
the end of an iteration (the client turns it into StopIteration). Service: server/services/native/datasets.py."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Header

from server.api.deps import Ctx, Tenant
from server.services.native import datasets

router = APIRouter(prefix="/processor/twinkle")

JsonBody = Annotated[dict[str, Any], Body(default_factory=dict)]
SessionId = Annotated[str | None, Header(alias="X-Twinkle-Session-Id")]


@router.post("/create")
async def create(ctx: Ctx, tenant: Tenant, body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    return await datasets.create(ctx, tenant, session, body)


@router.post("/call")
async def call(ctx: Ctx, tenant: Tenant, body: JsonBody, session: SessionId = None) -> dict[str, Any]:
    return await datasets.call(ctx, tenant, session, body)
