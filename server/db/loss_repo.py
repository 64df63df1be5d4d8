"""SQL of the loss curves (server/services/loss_history.py): batched inserts, the per-run bound, one read for many
runs. Core statements on `Database.connection()`: no ORM objects for rows that are only copied."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import Table, bindparam, delete, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection

from server.db.models import LossPointRow

T: Table = LossPointRow.__table__  # type: ignore[assignment]


async def add(conn: AsyncConnection, rows: Sequence[dict[str, Any]]) -> None:
    """Insert points (`tenant_id`, `model_id`, `seq_id`, `loss`, `tokens`, `at`) in one executemany."""
    if rows:
        await conn.execute(insert(T), list(rows))


async def keep_newest(conn: AsyncConnection, model_ids: Sequence[str], keep: int) -> None:
    """Delete each run's points below its `keep` newest seq_ids (one executemany of one statement)."""
    if not model_ids:
        return
    kth = (select(T.c.seq_id).where(T.c.model_id == bindparam("run")).order_by(T.c.seq_id.desc())
           .limit(1).offset(keep - 1).scalar_subquery())
    await conn.execute(delete(T).where(T.c.model_id == bindparam("run"), T.c.seq_id < kth),
                       [{"run": m} for m in model_ids])


async def points(conn: AsyncConnection, tenant_id: str, model_ids: Sequence[str]
                 ) -> dict[str, list[tuple[int, float, int, float]]]:
    """The stored (seq_id, loss, tokens, unix time) of each of the tenant's runs in `model_ids`, by seq_id; another
    tenant's run yields nothing."""
    out: dict[str, list[tuple[int, float, int, float]]] = {}
    if not model_ids:
        return out
    q = (select(T.c.model_id, T.c.seq_id, T.c.loss, T.c.tokens, T.c.at)
         .where(T.c.tenant_id == tenant_id, T.c.model_id.in_(list(model_ids)))
         .order_by(T.c.model_id, T.c.seq_id))
    for model_id, seq_id, loss, tokens, at in (await conn.execute(q)).all():
        when = at if at.tzinfo is not None else at.replace(tzinfo=UTC)  # SQLite hands back naive UTC times
        out.setdefault(model_id, []).append((int(seq_id), float(loss), int(tokens), when.timestamp()))
    return out


def when(unix: float) -> datetime:
    return datetime.fromtimestamp(unix, UTC)
