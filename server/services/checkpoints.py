"""Checkpoint naming and lookup: tinker:// paths, storage keys, ownership and publication rules."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from server.db import repositories as repo
from server.db.models import CheckpointRow, utcnow
from server.errors import BadRequest, NotFound
from server.services.context import Context

KINDS = ("weights", "sampler_weights", "external_weights")
MIN_TTL, MAX_TTL = 3600, 10 * 365 * 24 * 3600


@dataclass(frozen=True)
class TinkerPath:
    model_id: str
    kind: str
    name: str

    @classmethod
    def parse(cls, path: str) -> "TinkerPath":
        if not path.startswith("tinker://"):
            raise BadRequest(f"{path!r} is not a tinker:// path")
        parts = path[len("tinker://") :].split("/")
        if len(parts) != 3 or not all(parts) or parts[1] not in KINDS:
            raise BadRequest(f"{path!r} is not tinker://<run>/<{'|'.join(KINDS)}>/<name>")
        return cls(*parts)


def storage_key(tenant_id: str, model_id: str, kind: str, name: str) -> str:
    return f"{tenant_id}/{model_id}/{kind}/{name}"


def expiry(ttl_seconds: int | None) -> datetime | None:
    if ttl_seconds is None:
        return None
    if not MIN_TTL <= ttl_seconds <= MAX_TTL:
        raise BadRequest(f"ttl_seconds must be between {MIN_TTL} and {MAX_TTL}, or null for no expiry")
    return utcnow() + timedelta(seconds=ttl_seconds)


async def readable(ctx: Context, tenant_id: str, path: str) -> CheckpointRow:
    """A ready checkpoint the tenant owns or that is published; 404 otherwise (no hint that it exists)."""
    p = TinkerPath.parse(path)
    async with ctx.db.session() as s:
        row = await repo.checkpoint(s, p.model_id, p.kind, p.name)
    if row is None or (row.tenant_id != tenant_id and not row.public):
        raise NotFound(f"checkpoint {path} not found")
    if row.status != "ready":
        raise BadRequest(f"checkpoint {path} is not ready (status: {row.status})")
    return row


async def record_result(ctx: Context, request_id: str, ok: bool, size_bytes: int | None) -> None:
    """Called when a save job's result is seen: the pending row becomes ready (with its size) or failed."""
    async with ctx.db.session() as s:
        for row in await repo.checkpoints_by_request(s, request_id):
            if row.status == "pending":
                row.status = "ready" if ok else "failed"
                row.size_bytes = size_bytes
