"""create_custom_loss: upload a traced loss (SDK 0.38, custom_loss_server_side); the future resolves to its loss id."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api_schemas.tinker.custom_loss import MAX_REQUEST_BYTES, CreateCustomLossRequest
from api_schemas.tinker.types import UntypedFuture
from server.api.deps import Ctx, Tenant
from server.api.gate import BodyLimit
from server.services import custom_losses

router = APIRouter()

# The gate's bound for this route's body (server/app.py), tighter than max_request_bytes.
BODY_LIMIT = BodyLimit(MAX_REQUEST_BYTES, f"a create_custom_loss body may have at most {MAX_REQUEST_BYTES} bytes")

_BODY = {"requestBody": {"required": True, "content": {"application/json": {"schema": {
    "title": "CreateCustomLossRequest", "type": "object",
    "required": list(CreateCustomLossRequest.model_json_schema()["required"]),
    "description": "session_id, custom_loss_seq_id, name, inputs [{name, rank}] and graph {format: 1, nodes}: "
                   "the SDK's encode_graph output. Checked against the allowlist before anything is stored.",
}}}}}


@router.post("/create_custom_loss", openapi_extra=_BODY)
async def create_custom_loss(request: Request, ctx: Ctx, tenant: Tenant) -> UntypedFuture:
    body = await request.body()  # read by the gate, bounded by BODY_LIMIT
    return await custom_losses.create(ctx, tenant, body)
