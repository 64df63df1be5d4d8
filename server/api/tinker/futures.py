"""Futures: retrieve_future (result bytes, a try_again, or a failed-future body), retrieve_futures (completions
of a sampling session since a cursor) and cancel_future."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from api_schemas.tinker.futures import (
    CancelFutureRequest,
    CancelFutureResponse,
    RetrieveFuturesRequest,
    RetrieveFuturesResponse,
)
from api_schemas.tinker.types import RetrieveFutureRequest
from server.api.deps import Ctx, Tenant
from server.services import futures

router = APIRouter()


@router.post("/retrieve_future", responses={200: {"description": "The result (protobuf for forward/backward "
                                                   "outputs and samples unless Accept asks for JSON only), a "
                                                   "try_again or a failed-future body",
                                                   "content": {"application/json": {}, "application/x-protobuf": {}}}})
async def retrieve_future(req: RetrieveFutureRequest, request: Request, ctx: Ctx, tenant: Tenant) -> Response:
    answer = await futures.retrieve(ctx, tenant, req.request_id, request.headers.get("accept"))
    return Response(content=answer.body, media_type=answer.media_type)


@router.post("/retrieve_futures")
async def retrieve_futures(req: RetrieveFuturesRequest, ctx: Ctx, tenant: Tenant) -> RetrieveFuturesResponse:
    return await futures.retrieve_many(ctx, tenant, req)


@router.post("/cancel_future")
async def cancel_future(req: CancelFutureRequest, ctx: Ctx, tenant: Tenant) -> CancelFutureResponse:
    return await futures.cancel(ctx, tenant, req.request_id)
