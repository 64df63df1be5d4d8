"""The signed download route of external weights: no API key, the URL's signature and expiry are the permission."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query
from fastapi.responses import StreamingResponse

from server.api.deps import Ctx
from server.db.models import SQL_INT_MAX
from server.services import downloads

router = APIRouter()


@router.get("/downloads/{checkpoint_row}/{relpath:path}", response_class=StreamingResponse,
            responses={200: {"description": "The file", "content": {"application/octet-stream": {}}}})
async def download_external_weights(
    checkpoint_row: Annotated[int, Path(ge=1, le=SQL_INT_MAX)], relpath: str, ctx: Ctx, expires: Annotated[int, Query()], sig: Annotated[str, Query()]
) -> StreamingResponse:
    d = await downloads.open_download(ctx, checkpoint_row, relpath, expires, sig)
    headers = {"Content-Length": str(d.size), "Content-Disposition": f'attachment; filename="{d.filename}"'}
    return StreamingResponse(d.chunks(), media_type="application/octet-stream", headers=headers)
