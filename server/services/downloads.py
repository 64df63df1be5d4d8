"""Signed, time-limited download URLs for external_weights exports, served by the gateway itself.

A URL names the checkpoint row, one file of it and an expiry, and carries an HMAC-SHA256 signature over those plus
the row's storage key (server/services/secrets.py), so it opens exactly that file of exactly that export until it
expires: no API key is needed to fetch it, nothing else can be reached with it, and a deleted export is gone.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import BinaryIO, Iterator
from urllib.parse import quote

from api_schemas.tinker.rest import ExternalWeightsUrlsResponse
from jobqueue.storage import StorageKeyError
from server.db.models import CheckpointRow
from server.errors import DomainError, NotFound
from server.services import checkpoints as ckpt
from server.services.context import Context
from server.services.secrets import Keyring

CHUNK = 1 << 20


class Forbidden(DomainError):
    status, category = 403, "user"


@dataclass(frozen=True)
class Download:
    file: BinaryIO
    size: int
    filename: str

    def chunks(self) -> Iterator[bytes]:
        with self.file:
            while block := self.file.read(CHUNK):
                yield block


def keyring(ctx: Context) -> Keyring:
    if ctx.keyring is None:
        raise ckpt.StorageUnavailable("this gateway has no server secret configured")
    return ctx.keyring


def _message(row_id: int, storage_key: str, relpath: str, expires: int) -> str:
    return f"{row_id}|{storage_key}|{relpath}|{expires}"


async def external_weights_urls(
    ctx: Context, tenant_id: str, model_id: str, name: str, base_url: str
) -> ExternalWeightsUrlsResponse:
    """URLs for every file of an export the tenant owns, or that is published."""
    row = await ckpt.readable(ctx, tenant_id, f"tinker://{model_id}/external_weights/{name}")
    files = await asyncio.to_thread(ckpt.storage(ctx).files, row.storage_key)
    if not files:
        raise NotFound(f"the files of {row.tinker_path} are gone (deleted or expired)")
    expires = int(time.time()) + ctx.settings.download_url_ttl_seconds
    base = (ctx.settings.public_base_url or base_url).rstrip("/")
    keys = keyring(ctx)
    urls = {}
    for rel in files:
        sig = keys.sign(_message(row.id, row.storage_key, rel, expires))
        urls[rel] = f"{base}/api/v1/downloads/{row.id}/{quote(rel)}?expires={expires}&sig={sig}"
    return ExternalWeightsUrlsResponse(urls=urls, expires=datetime.fromtimestamp(expires, timezone.utc))


async def open_download(ctx: Context, row_id: int, relpath: str, expires: int, sig: str) -> Download:
    """The file a signed URL names; 403 for a bad signature or an expired URL, 404 once the export is gone."""
    async with ctx.db.session() as s:
        row = await s.get(CheckpointRow, row_id)
    if row is None or row.kind != "external_weights" or row.status != "ready":
        raise NotFound("this export does not exist (deleted or expired)")
    if not keyring(ctx).verify(_message(row.id, row.storage_key, relpath, expires), sig):
        raise Forbidden("invalid download signature")
    if expires < time.time():
        raise Forbidden("this download URL has expired; ask for new ones with get_external_weights_urls")
    store = ckpt.storage(ctx)
    try:
        files = await asyncio.to_thread(store.files, row.storage_key)
        if relpath not in files:
            raise NotFound(f"{row.tinker_path} has no file {relpath}")
        f = await asyncio.to_thread(store.open_file, row.storage_key, relpath)
    except (FileNotFoundError, StorageKeyError) as e:
        raise NotFound(f"{row.tinker_path} has no file {relpath}") from e
    return Download(file=f, size=files[relpath], filename=relpath.rsplit("/", 1)[-1])
