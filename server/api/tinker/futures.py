"""retrieve_future: long-polls and answers with the result bytes, a try_again, or a failed-future body."""

from __future__ import annotations

from fastapi import APIRouter, Response

from api_schemas.tinker.types import RetrieveFutureRequest
from server.api.deps import Ctx, Tenant
from server.services import futures

router = APIRouter()


@router.post("/retrieve_future")
async def retrieve_future(req: RetrieveFutureRequest, ctx: Ctx, tenant: Tenant) -> Response:
    answer = await futures.retrieve(ctx, tenant, req.request_id)
    return Response(content=answer.body, media_type=answer.media_type)
